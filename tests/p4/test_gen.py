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


def generate(tmp_path: Path, *args: str) -> tuple[str, S.Build]:
    """Run p4/gen.py with these arguments into tmp_path: the program and its build."""
    subprocess.run([sys.executable, str(P4DIR / "gen.py"), *args, "--out-dir", str(tmp_path)],
                   check=True)
    program = (tmp_path / "ina_aggregator.p4").read_text()
    return program, S.read_build(read_p4info(tmp_path / "ina_aggregator.p4info.txt"))


@needs_p4_extra
def test_gen_other_sizes(tmp_path):
    program, build = generate(tmp_path, "--elements", "8", "--slots", "16")
    assert "const bit<16> ELEMENTS        = 8;" in program
    assert "parse_value_7" in program and "parse_value_8" not in program
    # B 32 >= K 8: one sub-block per packet, and the build says B = 8.
    assert (build.k, build.slots, build.block, build.value_bits) == (8, 16, 8, 32)
    assert "const bit<8>  BLOCK           = 8;" in program
    assert "parse_pair_0" in program and "parse_pair_1" not in program


@needs_p4_extra
def test_gen_16_bit_build(tmp_path):
    """K 128, V 16 (the 16-bit build): 16-bit value headers and registers, G = 4 pairs,
    the UDP length counts two bytes a value."""
    program, build = generate(tmp_path, "--elements", "128", "--value-bits", "16")
    assert (build.k, build.slots, build.block, build.value_bits) == (
        128, S.DEFAULT_SLOTS, 32, 16)
    assert build.groups == 4
    assert "const bit<8>  VALUE_BITS      = 16;" in program
    assert re.search(r"header value_t {\s*bit<16> v;", program)
    assert re.search(r"header control_value_t {\s*bit<32> v;", program)  # probes: int32
    assert "@id(0x1600017f) register<bit<16>>(CELLS) value_127;" in program
    assert "parse_pair_3" in program and "parse_pair_4" not in program
    assert "hdr.ina.blocks != ((hdr.ina.count + 31) >> 5)" in program
    assert "+ (hdr.ina.count << 1)) {" in program
    assert "bit<16> sum;" in program
    assert_consistent(program, read_p4info(tmp_path / "ina_aggregator.p4info.txt"))


@needs_p4_extra
@pytest.mark.parametrize("block, shift", [(1, None), (8, 3), (64, 6)])
def test_gen_block(tmp_path, block, shift):
    program, build = generate(tmp_path, "--elements", "64", "--block", str(block))
    assert (build.k, build.block, build.value_bits) == (64, block, 32)
    assert build.groups == 64 // block
    assert f"const bit<8>  BLOCK           = {block};" in program
    assert f"parse_pair_{64 // block - 1}" in program
    assert f"parse_pair_{64 // block} " not in program
    rounded = "hdr.ina.count" if shift is None else \
        f"((hdr.ina.count + {block - 1}) >> {shift})"
    assert f"hdr.ina.blocks != {rounded}\n" in program
    assert_consistent(program, read_p4info(tmp_path / "ina_aggregator.p4info.txt"))


def test_gen_refuses_a_block_the_build_cannot_say(tmp_path):
    out = subprocess.run([sys.executable, str(P4DIR / "gen.py"), "--elements", "8",
                          "--block", "32", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "the build's B is 8" in out.stderr
    out = subprocess.run([sys.executable, str(P4DIR / "gen.py"), "--value-bits", "8",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "--value-bits" in out.stderr


@needs_p4_extra
def test_read_build_derives_block_and_width():
    for k, block, bits in [(64, 32, 32), (128, 32, 16), (100, 16, 16), (64, 1, 32),
                           (64, 64, 16), (8, 8, 32)]:
        build = S.read_build(S.p4info(k, 16, block, bits))
        assert (build.k, build.slots, build.block, build.value_bits) == (k, 16, block, bits)
        assert build.groups == -(-k // block)
        assert {r.name for r in build.state_registers} <= set(build.ids)
        assert len(build.registers) == len(S.STATE_REGISTERS) + 2 * build.groups + k
    assert S.read_build(S.p4info(8, 16, 32)).block == 8  # B >= K: one sub-block


@needs_p4_extra
def test_read_build_names_what_is_wrong():
    info = S.p4info(64, 16)
    for r in info.registers:
        if r.preamble.name == f"{S.VALUE_PREFIX}3":
            r.type_spec.bitstring.bit.bitwidth = 16
    with pytest.raises(ValueError, match=r"value registers are of \[16, 32\] bits"):
        S.read_build(info)
    info = S.p4info(64, 16)
    for r in info.registers:
        if r.preamble.name.startswith(S.VALUE_PREFIX):
            r.type_spec.bitstring.bit.bitwidth = 8
    with pytest.raises(ValueError, match=r"\[8\] bits"):
        S.read_build(info)
    info = S.p4info(64, 16, 16)  # G 4: drop one exponent register
    del info.registers[[r.preamble.name for r in info.registers].index(
        f"{S.EXPONENT_PREFIX}2")]
    with pytest.raises(ValueError, match=f"no register {S.EXPONENT_PREFIX}2 of 16 bits"):
        S.read_build(info)
    info = S.p4info(64, 16, 16)  # G 4 -> 3 proposal registers: no B gives K 64 three
    del info.registers[[r.preamble.name for r in info.registers].index(
        f"{S.PROPOSAL_PREFIX}3")]
    with pytest.raises(ValueError, match="no sub-block size B"):
        S.read_build(info)


@needs_p4_extra
def test_p4info_names_every_entity_the_controller_uses():
    info = read_p4info(P4DIR / "ina_aggregator.p4info.txt")
    build = S.read_build(info)  # raises, naming what is missing
    assert (build.k, build.slots, build.block, build.value_bits) == (
        S.DEFAULT_ELEMENTS, S.DEFAULT_SLOTS, S.DEFAULT_BLOCK, S.DEFAULT_VALUE_BITS)
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
    assert_consistent((P4DIR / "ina_aggregator.p4").read_text(),
                      read_p4info(P4DIR / "ina_aggregator.p4info.txt"))


def assert_consistent(program: str, info) -> None:
    declared = {}
    for m in re.finditer(r"control (\w+)\(.*?\n}\n", program, re.S):
        for d in re.finditer(r"@id\((0x[0-9a-f]+)\)\s*(?:action|table|register<bit<(\d+)>>"
                             r"\((?:CELLS|JOB_IDS)\)|counter\((\d+), CounterType\.packets\))"
                             r"\s*(\w+)", m.group(0)):
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
    assert all(r.size == (S.JOB_IDS if r.preamble.name == S.UP_SEQ.name else cells)
               for r in info.registers)
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
    # Every header the program names is declared, emitted, and extracted by a parser
    # state that exists; every state a transition names exists.
    fields = set(re.findall(r"^    \w+\s+(\w+);", re.search(
        r"struct headers_t {(.*?)\n}", program, re.S).group(1), re.M))
    used = set(re.findall(r"hdr\.(\w+)\.", program))
    assert used <= fields, sorted(used - fields)
    emitted = set(re.findall(r"packet\.emit\(hdr\.(\w+)\);", program))
    assert emitted == fields
    states = set(re.findall(r"^    state (\w+) {", program, re.M))
    targets = set(re.findall(r":\s*(\w+);", re.search(
        r"parser ParserImpl.*?\n}\n", program, re.S).group(0)))
    assert targets - {"accept", "reject"} <= states, sorted(targets - states)
    extracted = set(re.findall(r"packet\.extract\(hdr\.(\w+)\);", program))
    assert extracted == fields - {"c1", "c2"}  # the probe answer's values are made valid


def test_program_uses_the_wire_constants():
    program = (P4DIR / "ina_aggregator.p4").read_text()
    assert f"const bit<16> INA_PORT        = {P.UDP_PORT};" in program
    for i, reason in enumerate(P.DROP_REASONS):
        assert f"= {i};   // {reason}" in program
    assert f"const bit<8>  INA_VERSION     = {P.PROTOCOL_VERSION};" in program
    header = re.search(r"header ina_t {(.*?)}", program, re.S).group(1)
    widths = [int(w) for w in re.findall(r"bit<(\d+)>", header)]
    assert sum(widths) == 8 * P.HEADER_BYTES
    pair = re.search(r"header pair_t {(.*?)}", program, re.S).group(1)
    assert sum(int(w) for w in re.findall(r"bit<(\d+)>", pair)) == 8 * P.PAIR_BYTES
    # The committed build: K 64, B 32, V 32.
    assert (S.DEFAULT_ELEMENTS, S.DEFAULT_BLOCK, S.DEFAULT_VALUE_BITS) == (64, 32, 32)
    assert "const bit<8>  BLOCK           = 32;" in program
    assert "const bit<8>  VALUE_BITS      = 32;" in program


def test_core_imports_without_the_p4_extra(run_python):
    """grpc, p4runtime, p4runtime-shell and protobuf are the p4 extra's: the package, the
    switch, the controller module and ina-run import without them."""
    code = """
import ina_collectives, ina_collectives.switch, ina_collectives.control
import ina_collectives.launch.cli, ina_collectives.control.schema, ina_collectives.switch.embedded
from ina_collectives.launch.cli import p4_extra_installed
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
    import pickle

    from tests.integration import mpirun, rank_cases
    params = {"cases": [("float32", "sum", 30_000, 1)],
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    rank = mpirun.rank_args(rank_cases.ina_cases, params, tmp_path)
    code = f"""
import sys
from ina_collectives.launch.cli import main
sys.exit(main(["-np", "2", "--verbose", "--", sys.executable, *{rank!r}]))
"""
    out = run_python(code, block=("grpc", "p4runtime_sh", "p4"), timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the p4 extra is not installed: the ranks join" in out.stderr
    for path in sorted(tmp_path.glob("rank*.pkl")):
        assert pickle.loads(path.read_bytes())["stats"]["engines"] == {"ina": 1}
    assert len(list(tmp_path.glob("rank*.pkl"))) == 2
