"""The controller (ina_collectives.control, on p4runtime-shell) against the software
switch's P4Runtime server: pipeline push, entries read back, duplicates and bad entries
rejected by name, deletes; the data path obeys what was installed (admission, replica
fan-out, drops counted, other jobs' slots untouched); an allreduce whose job was
configured only through P4Runtime."""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.control import ControlError, Controller, JobSpec, Parent, Worker
from ina_collectives.control import schema as S
from ina_collectives.switch import parse_status
from ina_collectives.switch.embedded import embedded_switch
from ina_collectives.testing import tofino
from tests.conftest import ROOT, needs_p4_extra
from tests.inputs import check_within_bound
from tests.integration import mpirun, rank_cases

pytestmark = needs_p4_extra
# A small build: K values per packet, S slots, B values per sub-block (G = 2 pairs a
# packet), int32 values. With INA_TEST_CONTROLLER_BUILD=tna (or t2na), the Tofino build
# the compiler made instead, its P4Info and device config pushed to the same target
# (tests/p4/test_tofino.py runs this module so, where the compiler is installed).
TOFINO_ARCH = os.environ.get("INA_TEST_CONTROLLER_BUILD", "")
if TOFINO_ARCH:
    _FIT = S.TOFINO[tofino.TARGETS[TOFINO_ARCH]]
    K, SLOTS, B, BITS = _FIT.k, _FIT.slots, _FIT.block, _FIT.value_bits
else:
    K, SLOTS, B, BITS = 8, 32, 4, 32
G = -(-K // B)
# What the Tofino builds do not have as the v1model program has it (p4/README.md, Tofino):
# the tests of those skip, saying why, when this module runs with a Tofino build.
V1MODEL_REGISTERS = pytest.mark.skipif(
    bool(TOFINO_ARCH), reason="reads the v1model program's per-cell registers "
    "(IngressImpl.slot_bitmap ...), which a Tofino build splits and packs into registers "
    "of its own (p4/README.md, Tofino)")
V1MODEL_QUORUM = pytest.mark.skipif(
    bool(TOFINO_ARCH), reason="a Tofino build keeps no quorum cells (its capabilities are "
    "0): the ranks run quorum in the runtime, and the switch never switches mode")
OTHER_B = 2 * B if 2 * B <= 64 else B // 2  # (a sub-block size the build does not have)
# What the ranks of a job on that build are told (ina-run and the CLI say the same).
BUILD_ENV = {"INA_SWITCH_ELEMENTS": str(K), "INA_SWITCH_BLOCK": str(B),
             "INA_SWITCH_VALUE_BITS": str(BITS)}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    if TOFINO_ARCH:
        build = tofino.compile_tofino(TOFINO_ARCH)
        return build.p4info, build.out
    d = tmp_path_factory.mktemp("pipeline")
    (d / "ina.p4info.txt").write_text(S.p4info_text(K, SLOTS, B, BITS))
    (d / "ina.json").write_bytes(b"software switch: no device config needed")
    return d / "ina.p4info.txt", d / "ina.json"


@pytest.fixture(scope="module")
def switch(p4runtime_switch):
    return p4runtime_switch  # every test here reaches the switch through P4Runtime


@pytest.fixture
def controller(switch, pipeline):
    with Controller(switch.p4runtime_address, *pipeline, timeout=5) as c:
        yield c


def free_udp_sockets(n, host="127.0.0.1"):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host, 0))
        s.settimeout(5)
        socks.append(s)
    return socks


def free_ports(n):
    """n UDP ports free a moment ago, for ranks to bind."""
    socks = free_udp_sockets(n, "0.0.0.0")
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def job_env(switch, job):
    """What the ranks of an installed job are told (ina-run and the CLI say the same),
    with the bounds for a dead switch raised from 3 s to 20 s: these tests assert that
    the switch served every call, and 4 ranks and the switch on 2 busy cores can go 3 s
    without a result (CI once saw a call of two jobs at once fall back). A test of an
    outage sets its own switch_silence in the ranks' settings, which take precedence."""
    return {"INA_SWITCH": f"{switch.host}:{switch.port}", "INA_JOB": str(job.job_id),
            "INA_WORKER_PORTS": ",".join(str(w.udp_port) for w in job.workers),
            **BUILD_ENV, "INA_SWITCH_SLOTS": str(job.slots),
            "INA_SWITCH_JOIN_TIMEOUT": "20", "INA_SWITCH_SILENCE": "20"}


@V1MODEL_REGISTERS
def test_pipeline_push_and_entries_read_back(controller):
    build = controller.build
    assert (build.k, build.slots, build.block, build.value_bits) == (K, SLOTS, B, BITS)
    job = JobSpec(11, [Worker("127.0.0.1", 41000 + i, mac=f"02:00:00:00:00:0{i}",
                              switch_port=i + 1) for i in range(3)], slots=4, slot_base=5)
    controller.configure(job)
    workers = controller.read_workers(11)
    assert [(w["worker_id"], w["ip"], w["udp_port"]) for w in workers] == [
        (0, "127.0.0.1", 41000), (1, "127.0.0.1", 41001), (2, "127.0.0.1", 41002)]
    assert {(w["worker_bit"], w["num_workers"], w["mcast_grp"], w["slot_base"],
             w["slot_count"]) for w in workers} == {(1, 3, 11, 5, 4), (2, 3, 11, 5, 4),
                                                     (4, 3, 11, 5, 4)}
    assert controller.read_groups()[11] == [(1, 0), (2, 1), (3, 2)]
    assert [(r["rid"], r["udp_port"]) for r in controller.read_rewrites()
            if r["mcast_grp"] == 11] == [(0, 41000), (1, 41001), (2, 41002)]
    # The job's cells, both versions, read back as zeros after the reset.
    cells = [S.cell(v, 5, s, SLOTS) for v in (0, 1) for s in range(4)]
    assert controller.read_register(S.BITMAP.name, cells) == [0] * 8
    for g in range(G):
        assert controller.read_register(S.exponent_register(g).name, cells) == [0] * 8
        assert controller.read_register(S.proposal_register(g).name, cells) == [0] * 8

    with pytest.raises(ControlError, match="ALREADY_EXISTS") as raised:
        controller.configure(job)
    assert raised.value.codes == ["ALREADY_EXISTS"] * 3
    assert len(controller.read_workers(11)) == 3  # the failed install removed nothing

    controller.teardown(job)
    assert controller.read_workers(11) == []
    assert 11 not in controller.read_groups()
    assert [r for r in controller.read_rewrites() if r["mcast_grp"] == 11] == []
    controller.teardown(job)  # already gone: not an error


def test_a_pipeline_push_deletes_the_multicast_groups_first(switch, pipeline, monkeypatch):
    """BMv2 keeps its replication groups across a push while P4Runtime forgets them: the
    controller deletes every group it reads before it pushes, so none is left behind."""
    job = JobSpec(12, [Worker("127.0.0.1", 42000 + i, switch_port=i + 1) for i in range(2)],
                  slots=2)
    with Controller(switch.p4runtime_address, *pipeline, timeout=5) as first:
        first.configure(job)
        assert 12 in first.read_groups()
    order = []
    real_write, real_rpc = Controller._write, Controller._rpc
    monkeypatch.setattr(Controller, "_write", lambda self, what, updates, names: (
        order.append(what), real_write(self, what, updates, names))[1])
    monkeypatch.setattr(Controller, "_rpc", lambda self, what, fn, *args: (
        order.append(what), real_rpc(self, what, fn, *args))[1])
    with Controller(switch.p4runtime_address, *pipeline, timeout=5, push="always") as second:
        assert second.read_groups() == {}
        assert second.read_workers() == []
    assert order.index("deleting multicast group 12 before the pipeline push") < \
        order.index("SetForwardingPipelineConfig")


def test_a_p4info_file_is_parsed_once_per_version_and_a_malformed_one_is_named(tmp_path):
    """parsed_p4info: the same message for the same file, a new one once the file
    changes (write_p4info keeps the message it wrote); a file that is not a P4Info in
    text format is a ControlError naming it and where the parse stopped."""
    from ina_collectives.control import write_p4info
    from ina_collectives.control.controller import parsed_p4info

    path = tmp_path / "a.p4info.txt"
    first = S.p4info(K, SLOTS, B, BITS)
    write_p4info(path, first)
    assert parsed_p4info(path) is first
    path.write_text(path.read_text() + "\n")  # another version of the file: parsed again
    again = parsed_p4info(path)
    assert again is not first and again == first and parsed_p4info(path) is again
    bad = tmp_path / "bad.p4info.txt"
    bad.write_text("tables {\n  preamble { id: 1 \n")
    with pytest.raises(ControlError, match=r"bad\.p4info\.txt is not a P4Info in text "
                                           r"format: 2:18 "):
        parsed_p4info(bad)


@V1MODEL_REGISTERS
def test_only_the_first_job_after_a_push_skips_the_register_reset(controller, switch,
                                                                     monkeypatch):
    """The first job after this session's pipeline push needs no reset of its cells (the
    push left every cell zero: the RPC it saves costs about 0.7 s at K = 4096); a job
    configured later, on cells a packet may have touched, gets the reset, and its cells
    read back zero. (The software switch also zeroes a job's cells when it is installed
    again; a hardware target keeps them.)"""
    reset = []
    real = controller.reset_registers
    monkeypatch.setattr(controller, "reset_registers", lambda job: (reset.append(job.job_id),
                                                                   real(job))[1])
    workers = free_udp_sockets(2)
    job = JobSpec(13, [Worker("127.0.0.1", s.getsockname()[1]) for s in workers], slots=2,
                  slot_base=6)
    cells = [S.cell(v, 6, s, SLOTS) for v in (0, 1) for s in range(2)]
    controller.configure(job)
    try:
        assert reset == []
        # Worker 0's packet for slot 0 (6 on the switch); worker 1's never sent.
        workers[0].sendto(ina_packet(13, 0, 0, range(K), exponents=2),
                          (switch.host, switch.port))
        deadline = time.monotonic() + 10
        while controller.read_register(S.BITMAP.name, cells[:1]) == [0]:
            assert time.monotonic() < deadline, "worker 0's packet never reached its cell"
            time.sleep(0.05)
        controller.teardown(job)
        controller.configure(job)
        assert reset == [13]
        for reg in (S.BITMAP, S.COUNT, *S.pair_registers(G)):
            assert controller.read_register(reg.name, cells) == [0] * 4, reg.name
    finally:
        controller.teardown(job)
        for w in workers:
            w.close()


@pytest.mark.parametrize("change, message", [
    (dict(slots=SLOTS), "exceed the target's"),
    (dict(elements=K + 1), f"K {K + 1}, but the target's build has K {K}"),
    (dict(value_bits=16), "16-bit values, but the target's build has 32-bit values"),
    (dict(block=OTHER_B), f"sub-blocks of B {OTHER_B}, but the target's build has B {B}"),
    (dict(block=B, value_bits=BITS, elements=K, slots=2), None),  # the build's: installed
])
def test_controller_checks_the_job_against_the_build(controller, change, message):
    job = JobSpec(12, [Worker("127.0.0.1", 41100)], **{"slots": 1, "slot_base": 1, **change})
    if message is None:
        controller.configure(job)
        controller.teardown(job)
        return
    with pytest.raises(ControlError, match=message):
        controller.configure(job)
    assert controller.read_workers(12) == []  # refused before anything was written


def test_target_errors_are_reported_by_name(controller, switch):
    # Two jobs on overlapping slots: the switch refuses the second with INVALID_ARGUMENT.
    a = JobSpec(21, [Worker("127.0.0.1", 41200), Worker("127.0.0.1", 41201)], slots=4)
    b = JobSpec(22, [Worker("127.0.0.1", 41202)], slots=4, slot_base=2)
    controller.configure(a)
    try:
        with pytest.raises(ControlError, match=r"worker 0 \(127.0.0.1:41202\): "
                                               r"INVALID_ARGUMENT .*overlap job 21"):
            controller.configure(b)
        assert controller.read_workers(22) == []
        # Deleting what does not exist: NOT_FOUND, by name.
        entity = controller._sh.TableEntry(S.WORKERS.name)
        entity.match["job_id"] = "99"
        entity.match["src_addr"] = "127.0.0.1"
        entity.match["src_port"] = "1"
        with pytest.raises(ControlError, match="NOT_FOUND"):
            controller._write("deleting", [controller._update("DELETE", entity)], ["x"])
    finally:
        controller.teardown(a)


def test_a_pipeline_that_is_not_the_aggregator_is_refused(switch, tmp_path, pipeline):
    from google.protobuf import text_format
    info = S.p4info()
    del info.tables[0]  # no ina_workers
    (tmp_path / "other.txt").write_text(text_format.MessageToString(info))
    with pytest.raises(ControlError, match="INVALID_ARGUMENT.*no table IngressImpl.ina_workers"):
        Controller(switch.p4runtime_address, tmp_path / "other.txt", pipeline[1],
                   timeout=5).connect()
    # The session was released: the next controller connects.
    with Controller(switch.p4runtime_address, *pipeline, timeout=5) as c:
        assert c.build.k == K


def test_unreachable_target_fails_within_the_bound_and_never_exits(pipeline, closed_tcp_port,
                                                                 run_python):
    port = closed_tcp_port
    code = f"""
import sys
from ina_collectives.control import Controller, TargetUnavailable
try:
    Controller("127.0.0.1:{port}", {str(pipeline[0])!r}, {str(pipeline[1])!r},
               timeout=1).connect()
except TargetUnavailable as exc:
    print("refused:", exc)
print("still running")
"""
    # In a child: a hang on the shell's non-daemon stream thread would show as a timeout.
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert f"refused: no P4Runtime target answers at 127.0.0.1:{port}" in out.stdout
    assert "still running" in out.stdout


def test_a_silent_target_fails_the_handshake_without_hanging(pipeline, run_python):
    """A TCP listener that never speaks gRPC: connect must fail, bounded, and the child
    must exit (the shell's stream thread is not a daemon)."""
    code = f"""
import socket, threading
from ina_collectives.control import Controller, ControlError
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
port = listener.getsockname()[1]
conns = []
threading.Thread(target=lambda: conns.append(listener.accept()), daemon=True).start()
try:
    Controller(f"127.0.0.1:{{port}}", {str(pipeline[0])!r}, {str(pipeline[1])!r},
               timeout=1).connect()
except ControlError as exc:
    print("refused:", type(exc).__name__)
print("done")
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "refused: TargetUnavailable" in out.stdout and "done" in out.stdout


def ina_packet(job, worker, slot, values, version=0, offset=0, exponents=0, proposals=0,
               block=B, bits=BITS):
    """A data packet crafted with scapy: one (exponent, proposal) pair per sub-block of
    ``block`` values (an int: the same for every sub-block), then the values."""
    from ina_collectives.protocol.scapy_layer import INA, INAPair
    values = [int(v) for v in values]
    blocks = P.sub_blocks(len(values), block)
    exponents = [exponents] * blocks if isinstance(exponents, int) else list(exponents)
    proposals = [proposals] * blocks if isinstance(proposals, int) else list(proposals)
    return bytes(INA(job=job, worker=worker, slot=slot, slot_version=version, offset=offset,
                     value_bits=bits, block=block,
                     pairs=[INAPair(exponent=e, proposal=q)
                            for e, q in zip(exponents, proposals)], values=values))


def parse_result(data, bits=BITS):
    """A received packet: (header fields, [(exponent, proposal)] per sub-block, values)."""
    head = P.unpack_header(data)
    end = P.HEADER_BYTES + P.PAIR_BYTES * head["blocks"]
    pairs = np.frombuffer(data[P.HEADER_BYTES:end], ">i2").reshape(-1, 2)
    values = np.frombuffer(data[end:], ">i4" if bits == 32 else ">i2")
    assert len(data) == P.packet_bytes(head["count"], head["block"] or 1, bits)
    return head, [tuple(map(int, p)) for p in pairs], values.tolist()


@V1MODEL_REGISTERS
def test_only_installed_workers_aggregate(controller, switch):
    """Packets (crafted with scapy) from addresses not installed, or posing as another
    worker, are dropped and counted and leave every cell of the job untouched; the
    installed workers' packets aggregate and the result reaches each of them through
    the multicast group's rewrites."""
    workers = free_udp_sockets(2)
    others = free_udp_sockets(1)
    intruder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    intruder.bind(("127.0.0.2", workers[0].getsockname()[1]))  # same port, other address
    target = (switch.host, switch.port)
    job = JobSpec(31, [Worker("127.0.0.1", s.getsockname()[1]) for s in workers], slots=4)
    other = JobSpec(32, [Worker("127.0.0.1", others[0].getsockname()[1])], slots=4,
                    slot_base=4)
    controller.configure(job)
    controller.configure(other)
    try:
        before = controller.read_drops()
        intruder.sendto(ina_packet(31, 0, 0, range(K)), target)     # not installed
        workers[1].sendto(ina_packet(31, 0, 1, range(K)), target)   # worker 1 posing as 0
        workers[0].sendto(ina_packet(32, 0, 0, range(K)), target)   # job 31's, into job 32
        intruder.sendto(ina_packet(999, 0, 0, range(K)), target)    # no such job
        cells = [S.cell(v, 0, s, SLOTS) for v in (0, 1) for s in range(8)]  # both jobs
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = controller.read_drops()
            if after["unknown worker"] - before["unknown worker"] >= 3:
                break
            time.sleep(0.05)
        assert after["unknown worker"] - before["unknown worker"] == 3
        assert after["unknown job"] - before["unknown job"] == 1
        registers = (S.BITMAP, S.COUNT, S.CHUNK, *S.pair_registers(G))
        for reg in registers:
            assert controller.read_register(reg.name, cells) == [0] * 16, reg.name
        assert controller.read_register(f"{S.VALUE_PREFIX}0", cells) == [0] * 16
        # Job 32's own worker still aggregates alone (n = 1): its result comes back.
        others[0].sendto(ina_packet(32, 0, 1, range(K), exponents=[4, -3],
                                    proposals=[7, P.PROPOSAL_NONE]), target)
        head, pairs, values = parse_result(others[0].recv(65536))
        assert (head["blocks"], head["block"], head["value_bits"]) == (G, B, BITS)
        assert pairs == [(4, 7), (-3, P.PROPOSAL_NONE)] and values == list(range(K))

        # The installed workers: one chunk each, the sum comes back to both, with the
        # chunk's exponents and, per sub-block, the max of the proposals (signed).
        a, b = np.arange(K), 1000 * np.arange(K)
        cell = S.cell(0, 0, 2, SLOTS)
        workers[0].sendto(ina_packet(31, 0, 2, a, exponents=[2, -5], proposals=[3, -2]),
                          target)
        deadline = time.monotonic() + 10
        while (controller.read_register(S.COUNT.name, [cell]) != [1]
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert controller.read_register(S.COUNT.name, [cell]) == [1]
        assert controller.read_register(S.CHUNK.name, [cell]) == [K << 16 | G]
        assert [controller.read_register(S.exponent_register(g).name, [cell])[0]
                for g in range(G)] == [2, -5 & 0xffff]
        assert [controller.read_register(S.proposal_register(g).name, [cell])[0]
                for g in range(G)] == [3, -2 & 0xffff]
        # Another exponent in one sub-block: another chunk, dropped, the cell untouched.
        before = controller.read_drops()
        workers[1].sendto(ina_packet(31, 1, 2, b, exponents=[2, -4], proposals=[5, -9]),
                          target)
        while time.monotonic() < deadline:
            after = controller.read_drops()
            if after["mismatched chunk"] > before["mismatched chunk"]:
                break
            time.sleep(0.02)
        assert after["mismatched chunk"] - before["mismatched chunk"] == 1
        assert controller.read_register(S.COUNT.name, [cell]) == [1]
        workers[1].sendto(ina_packet(31, 1, 2, b, exponents=[2, -5], proposals=[5, -9]),
                          target)
        for s in workers:
            head, pairs, values = parse_result(s.recv(65536))
            assert head["flags"] == P.FLAG_RESULT and head["job"] == 31
            assert head["slot"] == 2 and pairs == [(2, 5), (-5, -2)]
            assert values == (a + b).tolist()
        # A worker that missed the result gets it alone on retransmission.
        workers[0].sendto(ina_packet(31, 0, 2, a, exponents=[2, -5], proposals=[3, -2]),
                          target)
        head, pairs, values = parse_result(workers[0].recv(65536))
        assert pairs == [(2, 5), (-5, -2)] and values == (a + b).tolist()
        workers[1].settimeout(0.3)
        with pytest.raises(socket.timeout):
            workers[1].recv(65536)
        assert controller.read_register(S.BITMAP.name, [S.cell(0, 0, 2, SLOTS)]) == [3]
        assert controller.read_register(S.COUNT.name, [S.cell(0, 0, 2, SLOTS)]) == [0]
    finally:
        controller.teardown(job)
        controller.teardown(other)
        for s in workers + others + [intruder]:
            s.close()


def test_a_16_bit_build_sums_with_16_bit_wraparound(switch, pipeline, tmp_path):
    """A build with V = 16 (and B = 8 of K = 16): the controller refuses a job of another
    width, the switch takes the build's width and B for the job, sums int16 values with
    16-bit wraparound, keeps the max proposal per sub-block, and reads its value
    registers back as 16-bit patterns."""
    (tmp_path / "ina16.p4info.txt").write_text(S.p4info_text(16, 8, 8, 16))
    workers = free_udp_sockets(2)
    target = (switch.host, switch.port)
    try:
        with Controller(switch.p4runtime_address, tmp_path / "ina16.p4info.txt",
                        pipeline[1], timeout=5) as c:
            build = c.build
            assert (build.k, build.slots, build.block, build.value_bits) == (16, 8, 8, 16)
            spec = dict(workers=[Worker("127.0.0.1", s.getsockname()[1]) for s in workers],
                        slots=2)
            with pytest.raises(ControlError, match="job 81: 32-bit values, but the target's "
                                                   "build has 16-bit values"):
                c.configure(JobSpec(81, value_bits=32, **spec))
            with pytest.raises(ControlError, match="sub-blocks of B 32, but the target's "
                                                   "build has B 8"):
                c.configure(JobSpec(81, block=32, **spec))
            job = JobSpec(81, value_bits=16, block=8, **spec)
            c.configure(job)
            try:
                a = np.full(16, 30000)
                b = np.arange(16) - 8
                workers[0].sendto(ina_packet(81, 0, 1, a, exponents=[1, 2],
                                             proposals=[-3, 4], block=8, bits=16), target)
                workers[1].sendto(ina_packet(81, 1, 1, b + 10000, exponents=[1, 2],
                                             proposals=[6, -4], block=8, bits=16), target)
                want = ((a + b + 10000 + 2 ** 15) % 2 ** 16 - 2 ** 15).tolist()
                for s in workers:
                    head, pairs, values = parse_result(s.recv(65536), bits=16)
                    assert (head["value_bits"], head["block"], head["blocks"]) == (16, 8, 2)
                    assert pairs == [(1, 6), (2, 4)]
                    assert values == want
                cell = S.cell(0, 0, 1, build.slots)
                assert c.read_register(f"{S.VALUE_PREFIX}0", [cell]) == [want[0] & 0xffff]
            finally:
                c.teardown(job)
    finally:
        for s in workers:
            s.close()


def test_join_cannot_take_a_controllers_job(controller, switch):
    from ina_collectives.ina.link import AggregatorUnavailable, WorkerLink
    job = JobSpec(41, [Worker("127.0.0.1", 41400), Worker("127.0.0.1", 41401)], slots=2)
    controller.configure(job)
    try:
        link = WorkerLink((switch.host, switch.port), P.JobFormat(41, 2, K, B, BITS), 0, 2)
        with pytest.raises(AggregatorUnavailable, match="configured by a controller"):
            link.join(2.0)
        with pytest.raises(AggregatorUnavailable, match="not installed"):
            link.probe(2.0)  # its ephemeral port is not the installed one
        link.close()
        installed = WorkerLink((switch.host, switch.port), P.JobFormat(41, 2, K, B, BITS), 1, 2,
                               port=41401)
        installed.probe(2.0)
        installed.close()
    finally:
        controller.teardown(job)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_of_a_job_configured_only_through_p4runtime(controller, switch, n):
    """ina-run's path without ina-run: the controller installs the job, the ranks get
    its id and their ports, probe their entries (no join) and aggregate through it."""
    ports = free_ports(n)  # the ranks bind them
    job = JobSpec(50 + n, [Worker("127.0.0.1", p) for p in ports], slots=6, slot_base=3)
    controller.configure(job)
    try:
        before = controller.read_drops()
        cases = [("float32", "sum", 5 * K + 3, 1), ("float64", "average", 3000, 2),
                 ("float32", "sum", 20_000, 3)]
        env = job_env(switch, job)
        results = mpirun.run(n, rank_cases.ina_cases, {
            "cases": cases, "rounds": 2,
            "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}, env=env, timeout=180)
        for i, case in enumerate(cases * 2):
            per_rank = [r["results"][i] for r in results]
            assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
            check_within_bound(per_rank[0], *case, n, k=K, block=B, bits=BITS)
        for r in results:  # every call through the switch: the probe found the entries
            assert r["stats"]["engines"] == {"ina": 2 * len(cases)}, r["stats"]
        after = controller.read_drops()
        assert after["unknown worker"] == before["unknown worker"]
        assert after["unknown job"] == before["unknown job"]
    finally:
        controller.teardown(job)


@pytest.mark.mpi
def test_ranks_of_an_installed_job_return_to_a_switch_that_answers_only_its_workers(
        controller, switch, faults, tmp_path):
    """The controller removes the job mid-run (its packets are dropped): that call
    finishes on the ring, the next ones take it. The controller installs it again, on a
    switch that answers no PROBE of job 0 (as the P4 program, which answers only its
    installed workers' probes): rank 0's return probes come as worker 0 of the job from
    its installed port, so the ranks return to it (issue 31: against BMv2 they never
    did)."""
    import threading
    ports = free_ports(2)
    job = JobSpec(61, [Worker("127.0.0.1", p) for p in ports], slots=6, slot_base=12)
    controller.configure(job)
    case = ("float32", "sum", 3000)
    outage = 4
    params = {"case": case, "after": 6, "outage": outage, "pause": 0.02,
              "dir": str(tmp_path),
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0,
                           "switch_silence": 0.5}}
    outcome: dict = {}

    def run_job() -> None:
        try:
            outcome["results"] = mpirun.run(2, rank_cases.ina_switch_restarts, params,
                                            env=job_env(switch, job), timeout=120)
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / name).exists():
            assert ranks.is_alive() and time.monotonic() < deadline, f"no {name}: {outcome}"
            time.sleep(0.05)

    faults(probes_from_installed_only=1)
    ranks = threading.Thread(target=run_job)
    try:
        ranks.start()
        wait_for("served")
        controller.teardown(job)  # its packets are dropped, its probes answered "no"
        (tmp_path / "killed").touch()
        wait_for("failed")
        controller.configure(job)
        (tmp_path / "restarted").touch()
        ranks.join(120)
    finally:
        controller.teardown(job)
    assert "error" not in outcome, outcome["error"]
    for r in outcome["results"]:
        engines = r["engines"]
        assert engines[0] == "ina" and "ina" not in engines[1:2 + outage], engines
        back = engines.index("ina", 2)
        assert back <= 2 + outage + 1 and set(engines[back:]) == {"ina"}, engines
        state = r["stats"]["switch"]
        assert (state["outages"], state["returns"]) == (1, 1), state


@pytest.mark.mpi
def test_two_jobs_installed_side_by_side_run_at_once(controller, switch):
    """Two jobs in disjoint slot ranges of one target, both running at the same time:
    each gets the sums of its own ranks' inputs, and its own count of results in the
    per-job counter that the controller reads over P4Runtime."""
    from concurrent.futures import ThreadPoolExecutor

    ports = free_ports(4)
    jobs = [JobSpec(70 + j, [Worker("127.0.0.1", p) for p in ports[2 * j:2 * j + 2]],
                    slots=4, slot_base=4 * j) for j in range(2)]
    for job in jobs:
        controller.configure(job)
    try:
        def run(j: int) -> list:
            job = jobs[j]
            env = job_env(switch, job)
            return mpirun.run(2, rank_cases.ina_cases, {
                "cases": [("float32", "sum", 20 * K + 1, 80 + j)], "rounds": 3,
                "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}, env=env,
                timeout=180)

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(run, range(2)))
        for j, results in enumerate(outcomes):
            for i in range(3):
                per_rank = [r["results"][i] for r in results]
                assert len({x.tobytes() for x in per_rank}) == 1
                check_within_bound(per_rank[0], "float32", "sum", 20 * K + 1, 80 + j, 2,
                                   k=K, block=B, bits=BITS)
            for r in results:
                assert r["stats"]["engines"] == {"ina": 3}, (
                    r["stats"]["engines"], r["stats"]["fallback_reasons"])
            # the per-job counter over P4Runtime: one result per chunk, each job its own
            assert controller.read_job_results(jobs[j].job_id) == 3 * -(-(20 * K + 1) // K)
    finally:
        for job in jobs:
            controller.teardown(job)


@pytest.mark.mpi
def test_runs_after_runs_of_one_installed_job_get_their_own_results(controller, switch):
    """Each run of the ranks starts its slots at version 0, so a cell's state from the
    previous run (every worker's bit set) would answer the new run's first packets with
    the old sums. The run's epoch makes that state idle: three runs against one job,
    configured once and never reset, each exact for its own inputs."""
    n = 2
    ports = free_ports(n)
    job = JobSpec(60, [Worker("127.0.0.1", p) for p in ports], slots=4)
    controller.configure(job)
    try:
        env = job_env(switch, job)
        for run in range(3):  # another seed each run: a stale answer is another sum
            case = ("float32", "sum", 1, 10 + run)
            results = mpirun.run(n, rank_cases.ina_cases, {
                "cases": [case], "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}},
                env=env, timeout=120)
            assert [r["stats"]["engines"] for r in results] == [{"ina": 1}] * n
            assert len({r["results"][0].tobytes() for r in results}) == 1
            check_within_bound(results[0]["results"][0], *case, n, k=K, block=B,
                               bits=BITS)
    finally:
        controller.teardown(job)


@pytest.fixture
def ina_run_cases(ina_run):
    """``ina_run_cases(args, outdir, cases)``: ina-run ARGS -- rank_cases.ina_cases on
    each rank (tests/integration/mpirun.py); (exit code, output, per-rank results)."""
    def run(args, outdir, cases, timeout=240):
        params = {"cases": cases, "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
        proc = ina_run(*args, "--", sys.executable,
                       *mpirun.rank_args(rank_cases.ina_cases, params, outdir),
                       timeout=timeout)
        results = [pickle.loads(p.read_bytes())
                   for p in sorted(Path(outdir).glob("rank*.pkl"))]
        return proc.returncode, proc.stdout + proc.stderr, results
    return run


@pytest.mark.mpi
def test_ina_run_configures_the_embedded_switch_through_p4runtime(tmp_path, ina_run_cases):
    cases = [("float32", "sum", 300_000, 1), ("float64", "average", 5000, 2)]
    code, output, results = ina_run_cases(["-np", "3", "--elements", "512", "--slots", "6"],
                                          tmp_path, cases)
    assert code == 0, output
    assert "configured on 127.0.0.1:" in output and "(K 512, S 6, 3 workers)" in output
    assert len(results) == 3, output
    for i, case in enumerate(cases):
        assert len({r["results"][i].tobytes() for r in results}) == 1
        check_within_bound(results[0]["results"][i], *case, 3, k=512)
    for r in results:
        assert r["stats"]["engines"] == {"ina": len(cases)}, (r["stats"], output)


@pytest.mark.mpi
def test_ina_run_stripes_a_job_across_two_configured_switches(tmp_path, ina_run_cases):
    """--aggregators 2: two embedded switches, the job installed on each over P4Runtime
    (one job id, the ranks' ports of each), the calls striped across both."""
    cases = [("float32", "sum", 300_000, 1), ("float32", "average", 70_000, 2)]
    code, output, results = ina_run_cases(["-np", "2", "--aggregators", "2", "--elements",
                                           "1024"], tmp_path, cases)
    assert code == 0, output
    assert output.count("configured on 127.0.0.1:") == 2, output
    for i, case in enumerate(cases):
        assert len({r["results"][i].tobytes() for r in results}) == 1
        check_within_bound(results[0]["results"][i], *case, 2, k=1024)
    for r in results:
        switch = r["stats"]["switch"]
        assert r["stats"]["engines"] == {"ina": 2}, (r["stats"], output)
        assert [a["serving"] for a in switch["aggregators"]] == [True, True], switch
        assert switch["striped_calls"] == 2, switch


@pytest.mark.mpi
def test_ina_run_with_two_running_switches_lets_the_ranks_stripe(tmp_path, ina_run_cases):
    cases = [("float32", "sum", 200_000, 5)]
    with embedded_switch() as a, embedded_switch() as b:
        code, output, results = ina_run_cases(
            ["-np", "2", "--switch", f"{a.address_text},{b.address_text}"], tmp_path, cases)
        assert code == 0, output
        for r in results:
            assert r["stats"]["switch"]["striped_calls"] == 1, (r["stats"], output)
    with pytest.raises(SystemExit):  # --aggregators is for the embedded switches
        from ina_collectives.launch.cli import parse_args
        parse_args(["-np", "2", "--switch", "127.0.0.1:1", "--aggregators", "2", "true"])


@pytest.mark.mpi
@pytest.mark.parametrize("config", ["opaque", "bmv2"])
def test_ina_run_on_a_p4runtime_target_with_the_committed_p4info(tmp_path, ina_run_cases,
                                                                  config):
    """--p4runtime with p4/ina_aggregator.p4info.txt (K 64, S 4096): here the target is
    a software switch serving P4Runtime; a BMv2 takes the same arguments. Given BMv2's
    device config (the JSON p4c-bm2-ss writes), the ranks send no segmented batches: a
    software target on veths takes one as a single frame and drops it (issue 31)."""
    p4info = ROOT / "p4" / "ina_aggregator.p4info.txt"
    (tmp_path / "dev").write_text(
        json.dumps({"__meta__": {"version": [2, 23]}, "header_types": [], "parsers": [],
                    "pipelines": [{"name": "ingress"}, {"name": "egress"}]})
        if config == "bmv2" else "no device config needed")
    cases = [("float32", "sum", 10_000, 3)]
    with embedded_switch(p4runtime=True) as sw:
        out = tmp_path / "out"
        out.mkdir()
        code, output, results = ina_run_cases(
            ["-np", "2", "--p4runtime", sw.p4runtime_address, "--p4info", str(p4info),
             "--device-config", str(tmp_path / "dev"), "--switch", sw.address_text,
             "--slot-base", "4000", "--slots", "16"], out, cases)
        assert code == 0, output
        assert "(K 64, S 16, 2 workers)" in output
        for r in results:
            assert r["stats"]["engines"] == {"ina": 1}, (r["stats"], output)
            if config == "bmv2":  # (otherwise whatever the kernel takes)
                assert r["stats"]["switch"]["send_path"] == "sendmmsg", r["stats"]["switch"]
        assert ("INA_INTERNAL_SWITCH_GSO=0" in output) == (config == "bmv2"), output
        check_within_bound(results[0]["results"][0], *cases[0], 2, k=64)
        # ina-run removed the job: nothing is installed any more.
        with Controller(sw.p4runtime_address, push="never", timeout=5) as c:
            assert c.read_workers() == [] and c.read_groups() == {}


@pytest.mark.mpi  # ina-run finds its launcher before it tries the target
def test_ina_run_names_a_missing_target(tmp_path, pipeline, closed_tcp_port, ina_run_cases):
    port = closed_tcp_port
    code, output, _ = ina_run_cases(["-np", "2", "--p4runtime", f"127.0.0.1:{port}",
                                     "--p4info", str(pipeline[0]), "--device-config",
                                     str(pipeline[1]), "--control-timeout", "1"], tmp_path, [],
                                    timeout=120)
    assert code == 2
    assert (f"ina-run: error: no P4Runtime target answers at 127.0.0.1:{port} within 1 s"
            in output)


def test_ina_run_names_a_missing_launcher(monkeypatch, tmp_path):
    from ina_collectives.launch import cli as launch
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(launch.LaunchError, match="no mpiexec beside the interpreter"):
        launch.find_mpiexec()
    assert launch.main(["-np", "2", "--", "true"]) == 2


def test_server_follows_p4runtime_conventions(pipeline):
    """Raw gRPC: no pipeline yet, another device id, a non-primary writer, a backup
    stream, and a Write whose failed update comes back as UNKNOWN with one p4.v1.Error
    per update in grpc-status-details-bin."""
    import queue

    import grpc
    from google.rpc import code_pb2, status_pb2
    from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

    with embedded_switch(p4runtime=True) as sw:
        channel = grpc.insecure_channel(sw.p4runtime_address)
        stub = p4runtime_pb2_grpc.P4RuntimeStub(channel)
        get = p4runtime_pb2.GetForwardingPipelineConfigRequest(device_id=1)
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetForwardingPipelineConfig(get, timeout=5)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        get.device_id = 2
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetForwardingPipelineConfig(get, timeout=5)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND

        def arbitrate(low):
            requests: queue.Queue = queue.Queue()
            m = p4runtime_pb2.StreamMessageRequest()
            m.arbitration.device_id = 1
            m.arbitration.election_id.low = low
            requests.put(m)
            stream = stub.StreamChannel(iter(requests.get, None), timeout=30)
            return requests, stream, next(stream).arbitration.status.code

        primary = arbitrate(5)
        backup = arbitrate(3)
        assert (primary[2], backup[2]) == (code_pb2.OK, code_pb2.ALREADY_EXISTS)

        request = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=1, action=p4runtime_pb2.SetForwardingPipelineConfigRequest
            .VERIFY_AND_COMMIT)
        request.config.p4info.CopyFrom(S.p4info(K, SLOTS))
        request.election_id.low = 3  # the backup
        with pytest.raises(grpc.RpcError) as raised:
            stub.SetForwardingPipelineConfig(request, timeout=5)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        request.election_id.low = 5
        stub.SetForwardingPipelineConfig(request, timeout=5)

        # One good update and one bad (group 0) in one Write.
        write = p4runtime_pb2.WriteRequest(device_id=1)
        write.election_id.low = 5
        for gid in (9, 0):
            u = write.updates.add(type=p4runtime_pb2.Update.INSERT)
            group = u.entity.packet_replication_engine_entry.multicast_group_entry
            group.multicast_group_id = gid
            group.replicas.add(egress_port=1, instance=0)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Write(write, timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNKNOWN
        details = dict(raised.value.trailing_metadata())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        errors = []
        for any_error in status.details:
            e = p4runtime_pb2.Error()
            assert any_error.Unpack(e)
            errors.append(e.canonical_code)
        assert errors == [code_pb2.OK, code_pb2.INVALID_ARGUMENT]
        read = p4runtime_pb2.ReadRequest(device_id=1)
        read.entities.add().packet_replication_engine_entry.multicast_group_entry \
            .multicast_group_id = 0
        groups = [e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
                  for r in stub.Read(read, timeout=5) for e in r.entities]
        assert groups == [9]  # the good update was applied (CONTINUE_ON_ERROR)

        for requests, stream, _ in (primary, backup):
            requests.put(None)  # the client ends its stream; the server's ends with it
            assert list(stream) == []
        channel.close()


@pytest.mark.mpi
def test_ina_run_names_a_missing_switch(tmp_path, closed_udp_port, ina_run_cases):
    port = closed_udp_port
    code, output, _ = ina_run_cases(["-np", "2", "--switch", f"127.0.0.1:{port}",
                                     "--control-timeout", "1", "--require-switch"], tmp_path,
                                    [], timeout=120)
    assert code == 2
    assert f"ina-run: error: no aggregator listens at 127.0.0.1:{port}" in output or \
        f"ina-run: error: the aggregator at 127.0.0.1:{port} did not answer" in output, output
    # Without --require-switch: a warning, and the job runs (on the ring).
    code, output, results = ina_run_cases(["-np", "2", "--switch", f"127.0.0.1:{port}",
                                           "--control-timeout", "1"], tmp_path,
                                          [("float32", "sum", 1000, 1)], timeout=120)
    assert code == 0, output
    assert "ina-run: warning: " in output and "the ranks will take the ring" in output
    assert all(r["stats"]["engines"] == {"ring": 1} for r in results) and len(results) == 2


@pytest.mark.mpi
def test_ina_run_with_a_running_switch_lets_the_ranks_join(tmp_path, ina_run_cases):
    """--switch HOST:PORT without --p4runtime: the plain path, ranks join themselves."""
    cases = [("float32", "sum", 50_000, 4)]
    with embedded_switch() as sw:
        code, output, results = ina_run_cases(["-np", "2", "--switch", sw.address_text],
                                              tmp_path, cases)
        assert code == 0, output
        assert "configured" not in output
        for r in results:
            assert r["stats"]["engines"] == {"ina": 1}, (r["stats"], output)
        sw.stop()
        # Nothing refused or malformed. A retransmission that reached the switch while
        # its cell was still filling is dropped and counted (duplicate_in_progress): on a
        # loaded machine a rank's timer fires before the others' packets are in.
        drops = parse_status(sw.final_status)["drops"]
        assert set(drops) <= {"duplicate_in_progress"}, sw.lines


@V1MODEL_QUORUM
@pytest.mark.mpi
def test_a_mode_asked_while_the_job_runs_takes_effect_at_one_call_boundary(controller,
                                                                           switch):
    """The controller asks a running job of three ranks for quorum 2 (a P4Runtime write
    of its ina_modes entry). The results announce it, and every rank switches at the
    same call: the calls before ran in sync (the sum of all three), the calls after in
    quorum 2 (no staleness bound here: it would run some in sync), and every call gave
    every rank the same bits."""
    from concurrent.futures import ThreadPoolExecutor

    n, count = 3, 2000
    ports = free_ports(n)
    job = JobSpec(90, [Worker("127.0.0.1", p) for p in ports], slots=4)
    controller.configure(job)
    try:
        env = job_env(switch, job)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(mpirun.run, n, rank_cases.quorum_calls, {
                "steps": [(None, "float32", "sum", count, 1)], "until_quorum": 5,
                "max_calls": 400, "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0,
                                               "quorum_max_steps": 0}},
                env=env, timeout=180)
            deadline = time.monotonic() + 60
            while controller.read_job_results(job.job_id) < 10 * -(-count // K):
                assert time.monotonic() < deadline and not running.done(), "no results"
                time.sleep(0.05)
            generation = controller.set_mode(job.job_id, 2)
            results = running.result()
        assert controller.read_mode(job.job_id) == (2, generation)
    finally:
        controller.teardown(job)
    stamps = [[c["quorum"] for c in r["calls"]] for r in results]
    assert all(s == stamps[0] for s in stamps), stamps
    first = stamps[0].index(2)
    assert first >= 10 and set(stamps[0][:first]) == {0} and set(stamps[0][first:]) == {2}
    for i, stamp in enumerate(stamps[0]):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"call {i}: ranks differ"
        calls = [r["calls"][i] for r in results]
        assert all(c["ranks_left_out"] == calls[0]["ranks_left_out"] for c in calls), calls
        if not calls[0]["ranks_left_out"]:  # every rank counted in every chunk
            check_within_bound(per_rank[0], "float32", "sum", count, 1, n, k=K, block=B,
                               bits=BITS)
    for r in results:
        report = r["stats"]["switch"]["quorum"]
        assert report["generation"] == generation and report["mode_changes"] == 1, report
        assert report["mode"] == "quorum 2", report


def test_control_command_line(switch, pipeline, tmp_path):
    (tmp_path / "workers.json").write_text(json.dumps(
        [{"ip": "127.0.0.1", "udp_port": 41600 + i} for i in range(2)]))
    base = [sys.executable, "-m", "ina_collectives.control"]
    where = ["--target", switch.p4runtime_address, "--timeout", "5"]
    job = ["--job-id", "61", "--workers", str(tmp_path / "workers.json"), "--slots", "2"]

    def run(*args):
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)

    out = run("configure", *where, *job, "--p4info", str(pipeline[0]), "--device-config",
              str(pipeline[1]), "--push", "if-needed")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"INA_JOB=61 INA_WORKER_PORTS=41600,41601 "
                                  f"INA_SWITCH_ELEMENTS={K} INA_SWITCH_BLOCK={B} "
                                  f"INA_SWITCH_VALUE_BITS={BITS} INA_SWITCH_SLOTS=2")
    shown = run("show", *where)
    assert f"K {K}, S {SLOTS}, B {B}, {BITS}-bit values" in shown.stdout
    assert "job 61 worker 1/2 at 127.0.0.1:41601, group 61, slots 0+2" in shown.stdout
    again = run("configure", *where, *job)
    assert again.returncode == 2 and "ALREADY_EXISTS" in again.stderr
    # A running job's mode: asked, shown, asked again (the generation counts up).
    assert run("mode", *where, "--job-id", "61").stdout.strip() == "job 61: sync (generation 0)"
    asked = run("mode", *where, "--job-id", "61", "--quorum", "1")
    assert asked.stdout.strip() == "job 61: quorum 1 (generation 1)", asked.stderr
    assert "job 61: quorum 1 (generation 1)" in run("show", *where).stdout
    back = run("mode", *where, "--job-id", "61", "--quorum", "0")
    assert back.stdout.strip() == "job 61: sync (generation 2)", back.stderr
    too_many = run("mode", *where, "--job-id", "61", "--quorum", "3")
    assert too_many.returncode == 2 and "quorum 3 is not 0 (sync) .. 2" in too_many.stderr
    assert run("mode", *where, "--job-id", "99", "--quorum", "1").returncode == 2
    assert run("teardown", *where, *job).returncode == 0
    assert "job 61" not in run("show", *where).stdout
    # Each action has its own help and required options; a bad one is a usage error.
    missing = run("teardown", *where)
    assert missing.returncode == 2 and "required: --job-id, --workers" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert "--quorum K" in run("mode", "--help").stdout
    assert run("--version").stdout.startswith("python -m ina_collectives.control ")


@pytest.mark.mpi
def test_ranks_at_ports_not_installed_take_the_ring_and_say_why(controller, switch):
    installed = [41700, 41701]
    job = JobSpec(71, [Worker("127.0.0.1", p) for p in installed], slots=2)
    controller.configure(job)
    try:
        socks = free_udp_sockets(2, "0.0.0.0")
        elsewhere = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        env = {"INA_SWITCH": f"{switch.host}:{switch.port}", "INA_JOB": "71",
               "INA_WORKER_PORTS": ",".join(map(str, elsewhere)),
               **BUILD_ENV, "INA_SWITCH_SLOTS": "2",
               "INA_SWITCH_JOIN_TIMEOUT": "1"}
        results = mpirun.run(2, rank_cases.ina_cases, {
            "cases": [("float32", "sum", 1000, 1)],
            "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}, env=env, timeout=120)
        for r in results:
            assert r["stats"]["engines"] == {"ring": 1}, r["stats"]
            reasons = " ".join(r["stats"]["fallback_reasons"])
            assert "no entry for worker" in reasons and "job 71" in reasons, reasons
    finally:
        controller.teardown(job)


@pytest.mark.parametrize("make, message", [
    (lambda: Worker("127.0.0.1", 41100, "02:00:00:00:00:zz"),
     "worker MAC '02:00:00:00:00:zz' is not aa:bb:cc:dd:ee:ff"),
    (lambda: Parent("10.0.0.300", 47474), "10.0.0.300"),
    (lambda: Parent("10.0.0.1", 0), "parent UDP port 0 is out of range"),
    (lambda: Parent("10.0.0.1", 47474, 64), "worker id at its parent must be 0..63, got 64"),
    (lambda: Parent("10.0.0.1", 47474, 0, "02:00"), "parent MAC '02:00' is not"),
    (lambda: Parent("10.0.0.1", 47474, 0, switch_port=512), "does not fit 9 bits"),
])
def test_a_worker_or_parent_that_cannot_be_one_is_named(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_the_cli_names_a_malformed_parent(tmp_path, capsys):
    """configure --parent: a malformed address is refused before any target is reached,
    naming the option."""
    from ina_collectives.control import cli

    workers = tmp_path / "w.json"
    workers.write_text(json.dumps([{"ip": "127.0.0.1", "udp_port": 41000}]))
    code = cli.main(["configure", "--target", "127.0.0.1:1", "--job-id", "3", "--workers",
                     str(workers), "--parent", "10.0.0.1:port"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("ina_collectives.control: error: --parent "
                                        "10.0.0.1:port: "), err
    assert "the port 'port' is not a number" in err, err


def test_a_parent_on_a_build_without_the_leaf_table_is_refused(tmp_path):
    """A P4Info with no ina_parents (a Tofino build's, or one older than trees): the job
    with a parent is refused before anything is written, naming the table. (A switch of
    its own: the module's keeps its pipeline.)"""
    from google.protobuf import text_format

    info = S.p4info(8, 32, 4, 32)
    keep = [t for t in info.tables if t.preamble.name != S.PARENTS.name]
    del info.tables[:]
    info.tables.extend(keep)
    p4info = tmp_path / "old.p4info.txt"
    p4info.write_text(text_format.MessageToString(info))
    job = JobSpec(14, [Worker("127.0.0.1", 41100)], 1,
                  parent=Parent("127.0.0.1", 47474))
    with embedded_switch("--max-elements", "64", p4runtime=True) as switch, \
            Controller(switch.p4runtime_address, p4info, p4info, push="always",
                       timeout=10) as c:
        with pytest.raises(ControlError, match="has no IngressImpl.ina_parents: it cannot "
                                               "be a tree's leaf"):
            c.configure(job)
        assert c.read_workers(14) == []
