"""The software switch serving as a Tofino build of the P4 program would (``ina-switch
--like tofino``; p4/README.md, Tofino): it announces the build's capabilities (none) and
drops what they leave out, and the library, told only that, serves every call through it:
no openings, no predicted windows, no result requests, no quorum stamps (quorum k is
asked; the switch sees sync calls), each build's K values of 32 bits per packet (Tofino 1:
20, Tofino 2: 48)."""
from __future__ import annotations

import socket

import pytest

from ina_collectives import protocol as P
from ina_collectives.control import schema as S
from ina_collectives.settings import Settings
from tests.inputs import check_within_bound, make_input
from tests.switch.test_server import switch_thread
from tests.threadcomm import ThreadPeers, run_ranks


def _control(sw, job: int, worker: int, body: list[int]) -> list[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(P.control_packet(job, worker, body), sw.address)
        reply, _ = sock.recvfrom(65536)
    return [int.from_bytes(reply[P.HEADER_BYTES + 4 * i:P.HEADER_BYTES + 4 * i + 4], "big",
                           signed=True)
            for i in range((len(reply) - P.HEADER_BYTES) // 4)]


@pytest.mark.parametrize("chip", sorted(S.TOFINO))
def test_it_announces_the_builds_capabilities_and_takes_only_jobs_the_build_takes(chip):
    build = S.TOFINO[chip]
    with switch_thread(like=chip) as sw:
        op, status, caps, *_ = _control(sw, 0, 0, [P.CTRL_PROBE])
        assert (op, status, caps) == (P.CTRL_PROBE, 0, build.capabilities)
        # [JOIN, n, K, S, B, value bits]
        refused = [
            [P.CTRL_JOIN, 2, build.k, 8, build.block // 2, 32],     # another B
            [P.CTRL_JOIN, 2, build.k, 8, build.block, 16],          # 16-bit values
            [P.CTRL_JOIN, build.max_workers + 1, build.k, 8, build.block, 32],  # n
        ]
        for job, body in enumerate(refused, 1):
            assert _control(sw, job, 0, body)[1] != 0, body
        assert _control(sw, 9, 0, [P.CTRL_JOIN, 2, build.k, 8, build.block, 32])[1] == 0
        assert sw.stats()["jobs"][9]["workers"] == 2


@pytest.mark.parametrize("chip", sorted(S.TOFINO))
def test_the_library_serves_every_call_through_a_switch_like_the_tofino_build(chip):
    from ina_collectives.collectives.chooser import Collectives
    from ina_collectives.collectives.ops import Op
    from ina_collectives.ina.engine import InaEngine

    build = S.TOFINO[chip]
    calls = [("float32", "sum", 1), ("float32", "sum", build.k), ("float64", "average", 33),
             ("float32", "sum", 1000), ("float32", "average", 20_001)] * 2
    with switch_thread(like=chip) as sw:
        def rank(comm):
            r = comm.Get_rank()
            settings = Settings(switch="%s:%d" % sw.address, switch_min_bytes=0, timeout=20,
                                switch_elements=build.k, switch_block=build.block,
                                quorum=1)
            coll = Collectives(comm, settings, InaEngine)
            try:
                out = []
                for i, (dtype, op, count) in enumerate(calls):
                    x = make_input(dtype, op, count, i, r)
                    coll.allreduce_flat(None, x, Op.AVERAGE if op == "average" else Op.SUM)
                    out.append((x, coll.stats.snapshot()["last_call"]["engine"]))
                return out, coll.offload.switch_state()
            finally:
                coll.free()

        ranks = run_ranks(2, rank, timeout=120, kind=ThreadPeers)
        stats = sw.stats()
    for i, (dtype, op, count) in enumerate(calls):
        (x0, engine0), (x1, engine1) = ranks[0][0][i], ranks[1][0][i]
        assert (engine0, engine1) == ("ina", "ina"), (i, engine0, engine1)
        assert x0.tobytes() == x1.tobytes()
        check_within_bound(x0, dtype, op, count, i, 2, k=build.k, block=build.block)
    for _, state in ranks:
        assert (state["opened_calls"], state["predicted_calls"]) == (0, 0), state
        assert state["elements"] == build.k and state["block"] == build.block, state
        assert state["quorum"]["quorum_calls"] == 0, state["quorum"]  # (sync stamps)
    # Nothing the build leaves out reached the switch, and it answered as the build does.
    assert stats["drops"].get("malformed", 0) == 0, stats["drops"]
    assert (stats["nacks"], stats["openings"], stats["result_requests"]) == (0, 0, 0), stats
    assert stats["results"] > 0
