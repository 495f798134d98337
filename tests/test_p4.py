"""The P4 program and its P4Info: generated reproducibly, consistent with each other and
with what the controller and the software switch use (ina_collectives.control.schema)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ina_collectives import protocol as P
from ina_collectives.control import schema as S
from tests.conftest import ROOT, needs_p4_extra

P4DIR = ROOT / "p4"


def read_p4info(path: Path):
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    return text_format.Parse(path.read_text(), p4info_pb2.P4Info())


@needs_p4_extra  # gen.py writes the P4Info with protobuf
def test_gen_is_reproducible(tmp_path):
    subprocess.run([sys.executable, str(P4DIR / "gen.py"), "--out-dir", str(tmp_path)],
                   check=True)
    for name in ("ina_aggregator.p4", "ina_aggregator.p4info.txt"):
        assert (tmp_path / name).read_bytes() == (P4DIR / name).read_bytes(), (
            f"p4/{name} is not what p4/gen.py writes: run python p4/gen.py and commit")


@needs_p4_extra
def test_gen_other_sizes(tmp_path):
    subprocess.run([sys.executable, str(P4DIR / "gen.py"), "--elements", "8", "--slots",
                    "16", "--out-dir", str(tmp_path)], check=True)
    program = (tmp_path / "ina_aggregator.p4").read_text()
    assert "const bit<16> ELEMENTS        = 8;" in program
    assert "parse_value_7" in program and "parse_value_8" not in program
    build = S.read_build(read_p4info(tmp_path / "ina_aggregator.p4info.txt"))
    assert (build.k, build.slots) == (8, 16)


@needs_p4_extra
def test_p4info_names_every_entity_the_controller_uses():
    info = read_p4info(P4DIR / "ina_aggregator.p4info.txt")
    build = S.read_build(info)  # raises, naming what is missing
    assert (build.k, build.slots) == (S.DEFAULT_ELEMENTS, S.DEFAULT_SLOTS)
    names = ({t.preamble.name for t in info.tables} | {a.preamble.name for a in info.actions}
             | {r.preamble.name for r in info.registers}
             | {c.preamble.name for c in info.counters})
    assert set(S.ENTITIES_USED) <= names, sorted(set(S.ENTITIES_USED) - names)
    fields = {(t.preamble.name, m.name) for t in info.tables for m in t.match_fields}
    for table in (S.WORKERS, S.REPLICAS):
        for key in table.keys:
            assert (table.name, key.name) in fields


@needs_p4_extra
def test_program_and_p4info_agree():
    """Every P4Info entity is declared in the program with its id, and every @id in the
    program is in the P4Info; key names, parameters and sizes match."""
    info = read_p4info(P4DIR / "ina_aggregator.p4info.txt")
    program = (P4DIR / "ina_aggregator.p4").read_text()
    declared = {}
    for m in re.finditer(r"control (\w+)\(.*?\n}\n", program, re.S):
        for d in re.finditer(r"@id\((0x[0-9a-f]+)\)\s*(?:action|table|register<bit<(\d+)>>"
                             r"\(CELLS\)|counter\((\d+), CounterType\.packets\))\s*(\w+)",
                             m.group(0)):
            declared[f"{m.group(1)}.{d.group(4)}"] = (int(d.group(1), 16), d.group(2),
                                                     d.group(3))
    entities = ([(t.preamble, None) for t in info.tables]
                + [(a.preamble, None) for a in info.actions]
                + [(r.preamble, str(r.type_spec.bitstring.bit.bitwidth))
                   for r in info.registers] + [(c.preamble, None) for c in info.counters])
    assert {p.name for p, _ in entities} == set(declared)
    for preamble, bits in entities:
        assert declared[preamble.name][0] == preamble.id, preamble.name
        if bits:
            assert declared[preamble.name][1] == bits, preamble.name
    cells = int(re.search(r"const bit<32> CELLS\s+= (\d+);", program).group(1))
    assert all(r.size == cells for r in info.registers)
    counter = next(iter(info.counters))
    assert declared[counter.preamble.name][2] == str(counter.size) == str(len(P.DROP_REASONS))
    for t in info.tables:
        body = re.search(rf"table {t.preamble.alias} {{(.*?)\n    }}", program, re.S).group(1)
        assert [m.name for m in t.match_fields] == re.findall(r'@name\("(\w+)"\)', body)
        assert f"size = {t.size};" in body
    # p4c lists every action of the program, helpers that no table names included.
    assert set(re.findall(r"^\s*action (\w+)\(", program, re.M)) == {
        a.preamble.alias for a in info.actions}
    for a in info.actions:
        sig = re.search(rf"action {a.preamble.alias}\((.*?)\)", program).group(1)
        have = [tuple(p.split()) for p in sig.split(", ")] if sig else []
        assert have == [(f"bit<{p.bitwidth}>", p.name) for p in a.params], a.preamble.name


def test_program_uses_the_wire_constants():
    program = (P4DIR / "ina_aggregator.p4").read_text()
    assert f"const bit<16> INA_PORT        = {P.UDP_PORT};" in program
    for i, reason in enumerate(P.DROP_REASONS):
        assert f"= {i};   // {reason}" in program
    header = re.search(r"header ina_t {(.*?)}", program, re.S).group(1)
    widths = [int(w) for w in re.findall(r"bit<(\d+)>", header)]
    assert sum(widths) == 8 * P.HEADER_BYTES


def test_core_imports_without_the_p4_extra(run_python):
    """grpc, p4runtime, p4runtime-shell and protobuf are the p4 extra's: the package, the
    switch, the controller module and ina-run import without them."""
    code = """
import ina_collectives, ina_collectives.switch, ina_collectives.control
import ina_collectives.launch, ina_collectives.control.schema, ina_collectives.switch.embedded
from ina_collectives.launch import p4_extra_installed
assert not p4_extra_installed()
try:
    ina_collectives.control.Controller("127.0.0.1:1", push="never").connect()
except ina_collectives.control.ControlError as exc:
    print(exc)
"""
    out = run_python(code, block=("grpc", "p4runtime_sh", "p4", "google"))
    assert out.returncode == 0, out.stderr
    assert "the controller needs the p4 extra" in out.stdout


@pytest.mark.mpi
def test_ina_run_without_the_p4_extra_lets_the_ranks_join(tmp_path, run_python):
    import json
    import pickle
    params = {"cases": [("float32", "sum", 30_000, 1)],
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    code = f"""
import sys
from ina_collectives.launch import main
sys.exit(main(["-np", "2", "--", sys.executable, "-m", "tests.rank_cases", "ina_cases",
               {json.dumps(params)!r}, {str(tmp_path)!r}]))
"""
    out = run_python(code, block=("grpc", "p4runtime_sh", "p4"), timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the p4 extra is not installed: the ranks join" in out.stderr
    for path in sorted(tmp_path.glob("rank*.pkl")):
        assert pickle.loads(path.read_bytes())["stats"]["engines"] == {"ina": 1}
    assert len(list(tmp_path.glob("rank*.pkl"))) == 2
