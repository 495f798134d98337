"""The Tofino builds (p4/tna.py, written by p4/gen.py --arch tna|t2na): the committed
programs are what the generator writes; with the open Tofino compiler (marker tofino),
both compile for their targets with no error, and the P4Info the compiler writes names
the same tables, actions, counters and registers, with the same ids, as
ina_collectives/control/schema.py. Without the compiler those cases skip, saying why."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ina_collectives.control import schema as S
from ina_collectives.testing import tofino
from tests.conftest import ROOT

tna = tofino.tna_module()

needs_compiler = pytest.mark.skipif(tofino.find_compiler() is None,
                                    reason=tofino.missing_compiler())


@pytest.mark.parametrize("arch", sorted(tna.ARCHES))
def test_the_committed_tofino_program_is_what_gen_py_writes(arch, tmp_path):
    subprocess.run([sys.executable, str(ROOT / "p4" / "gen.py"), "--arch", arch,
                    "--out-dir", str(tmp_path)], check=True, timeout=120)
    name = f"ina_aggregator_{arch}.p4"
    assert (tmp_path / name).read_text() == (ROOT / "p4" / name).read_text(), (
        f"p4/{name} is stale: python p4/gen.py --arch {arch}")


def test_the_compile_commands_p4_readme_quotes_are_the_suites():
    """p4/README.md's p4c-barefoot lines, from the checkout's root into build/<arch>, are
    what compile_tofino runs: a newcomer compiles what the suite compiled."""
    import re
    import shlex

    text = re.sub(r"\\\n\s*", " ", (ROOT / "p4" / "README.md").read_text())
    quoted = [shlex.split(line)[1:] for line in text.splitlines()
              if line.strip().startswith("p4c-barefoot ")]
    want = [tofino.compile_arguments(arch, f"build/{arch}") for arch in sorted(tna.ARCHES)]
    assert sorted(quoted) == sorted(want), quoted


def expected(arch: str) -> dict[str, int]:
    """Every entity a Tofino build has, by schema name, with its schema id."""
    build = tna.BUILDS[arch]
    k, groups = build.k, S.sub_blocks(build.k, build.block)
    things = [*(t for t in (*S.TABLES, *S.ACTIONS) if t not in S.LEAF_ONLY),
              S.EPOCH, S.BITMAP, S.COUNT,
              *S.pair_registers(groups), *(S.value_register(i, 32) for i in range(k))]
    ids = {t.name: t.id for t in things}
    ids[S.DROPS_COUNTER_NAME] = S.DROPS_COUNTER_ID
    ids[S.JOB_RESULTS_COUNTER_NAME] = S.JOB_RESULTS_COUNTER_ID
    return ids


def written(build: tofino.TofinoBuild) -> dict[str, int]:
    """The P4Info's entities by name (the pipeline's prefix, ``pipe.``, left out)."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    info = text_format.Parse(build.p4info.read_text(), p4info_pb2.P4Info())
    found = {}
    for group in (info.tables, info.actions, info.counters, info.registers):
        for entity in group:
            found[entity.preamble.name.removeprefix("pipe.")] = entity.preamble.id
    return found


@pytest.mark.tofino
@needs_compiler
@pytest.mark.parametrize("arch", sorted(tna.ARCHES))
def test_the_tofino_program_compiles_fits_and_its_p4info_has_the_schemas_names_and_ids(arch):
    """Zero errors from the compiler, a binary from the assembler within the chip's
    stages, the compiler's resource figures within each stage's and p4/README.md's, the
    P4Info's names and ids schema.py's, and the controller reads it as that chip's
    build; the compiler's output folder is a device config the controller packs."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    from ina_collectives.control import pipeline

    build = tofino.compile_tofino(arch)
    assert " error" not in build.log.lower().replace("0 errors", ""), build.log[-3000:]
    chip = S.TOFINO[build.target]
    assert (build.out / "pipe" / f"{build.target}.bin").is_file()
    assert build.stages() <= chip.stages
    # one stateful ALU per register: epoch, bitmaps, count, the pair, the K values
    assert build.stateful_alus() == 5 + chip.k
    figures = build.resources()
    assert sum(s["stateful_alus"][0] for s in figures["stages"]) == 5 + chip.k
    for stage in figures["stages"]:
        for key in ("sram", "tcam", "map_ram", "stateful_alus"):
            used, of = stage[key]
            assert 0 <= used <= of, (stage["stage"], key, stage[key])
    for kind, widths in figures["phv"].items():
        assert all(used <= of for used, of in widths.values()), (kind, widths)
    assert tofino.resource_table(build) in (ROOT / "p4" / "README.md").read_text(), (
        "p4/README.md's resource table is not this build's: python -m "
        "ina_collectives.testing.tofino " + arch)
    want, have = expected(arch), written(build)
    missing = sorted(set(want) - set(have))
    assert not missing, (missing, sorted(have))
    # Tables and actions keep schema.py's ids; registers and counters get the
    # compiler's own (it does not take @id on TNA's Register and Counter externs), which
    # the controller reads from the P4Info like every id.
    registers = {name for name in want
                 if name in (S.EPOCH.name, S.BITMAP.name, S.COUNT.name,
                             S.DROPS_COUNTER_NAME, S.JOB_RESULTS_COUNTER_NAME)
                 or name.startswith((S.VALUE_PREFIX, S.EXPONENT_PREFIX, S.PROPOSAL_PREFIX))}
    assert {name: have[name] for name in want if name not in registers} == {
        name: i for name, i in want.items() if name not in registers}
    read = S.read_build(text_format.Parse(build.p4info.read_text(), p4info_pb2.P4Info()))
    assert (read.chip, read.k, read.slots, read.block) == (chip.chip, chip.k, chip.slots,
                                                           chip.block)
    found = pipeline.find_tofino_build(build.out)
    assert (found.chip, found.program) == (chip.chip, f"ina_aggregator_{arch}")
    assert pipeline.unpack_tofino(pipeline.device_config(build.out, chip.chip)).binary == (
        found.binary.read_bytes())


@pytest.mark.tofino
@needs_compiler
def test_the_controller_pushes_a_tofino_build_and_installs_a_job_on_a_p4runtime_target(
        p4runtime_switch):
    """The compiler's output folder as ina-run's --device-config: the controller packs
    it, pushes it with its P4Info to a P4Runtime target (the software switch's), reads it
    as the Tofino 1 build, installs a job (its slots' epochs reset through the per-slot
    register) and tears it down; the target then serves as that build (capabilities 0)."""
    import socket

    from ina_collectives import protocol as P
    from ina_collectives.control import Controller, JobSpec, Worker

    build = tofino.compile_tofino("tna")
    with Controller(p4runtime_switch.p4runtime_address, None, build.out, push="always",
                    target="tofino", timeout=10) as controller:
        assert (controller.build.chip, controller.build.k) == ("tofino", S.TOFINO["tofino"].k)
        job = JobSpec(77, [Worker("127.0.0.1", 40001), Worker("127.0.0.1", 40002)], slots=4,
                      slot_base=2)
        controller.configure(job)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(5)
                sock.sendto(P.control_packet(0, 0, [P.CTRL_PROBE]),
                            (p4runtime_switch.host, p4runtime_switch.port))
                reply, _ = sock.recvfrom(1024)
            caps = int.from_bytes(reply[P.HEADER_BYTES + 8:P.HEADER_BYTES + 12], "big")
            assert caps == S.TOFINO["tofino"].capabilities
        finally:
            controller.teardown(job)


@pytest.mark.tofino
@needs_compiler
@pytest.mark.parametrize("arch", sorted(tna.ARCHES))
def test_the_controllers_own_tests_pass_with_the_tofino_builds_p4info(arch):
    """tests/control/test_controller.py, whole, with the Tofino build's P4Info and device
    config pushed to the software switch's P4Runtime server instead of the small v1model
    build's (INA_TEST_CONTROLLER_BUILD): its entries, reads, deletes, jobs and the
    allreduces of jobs configured through it, at the build's K, S and B."""
    tofino.compile_tofino(arch)  # (cached: the module's fixture finds it built)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/control/test_controller.py"], cwd=ROOT,
                          env={**os.environ, "INA_TEST_CONTROLLER_BUILD": arch},
                          capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    # Only the tests of what the Tofino builds keep otherwise skip (the module says why).
    assert re.search(r"\b\d+ passed, 4 skipped\b", tail.splitlines()[-1]), tail
