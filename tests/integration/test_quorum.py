"""Quorum mode (docs/quorum.md): a chunk completes when k workers contributed. The rule in
the switch, packet by packet (late packets get the result and are never added), and jobs
of ranks with one worker's packets held back by the switch (a straggler)."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina.reference import blockfp
from ina_collectives.switch import parse_status, send_faults
from ina_collectives.switch.embedded import embedded_switch
from tests.inputs import inputs_of_all_ranks
from tests.integration import mpirun, rank_cases
from tests.switch.test_server import _join, switch_thread

N, K, SLOTS, JOB = 3, 8, 2, 515


def _workers(sw, n=N, k=K, slots=SLOTS, job=JOB):
    socks = []
    for w in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        assert _join(s, sw, job, w, n, k, slots) == 0
        socks.append(s)
    return socks


def _packet(worker, values, *, offset=0, call=1, quorum=2, slot=0, version=0, seq=0,
            flags=0):
    return P.pack_data(values, flags=flags, job=JOB, worker=worker, slot_version=version,
                       slot=slot, offset=offset, epoch=7, seq=seq, call=call, quorum=quorum)


def _result(sock):
    data = sock.recv(65536)
    head = P.unpack_header(data)
    values = np.frombuffer(data[P.HEADER_BYTES + P.PAIR_BYTES:], ">i4")
    return head, values, data


def test_a_quorum_completes_without_the_late_worker_whose_packet_is_never_added():
    """Quorum 2 of 3: workers 0 and 1 complete the chunk; the result counts them
    (contributors 0b011) and goes to all three. Worker 2's packet then gets that result
    back, byte for byte, and changes nothing; the next chunk of the slot sums afresh, and
    a packet of the finished chunk arriving after it is dropped as late."""
    with switch_thread() as sw:
        workers = _workers(sw)
        try:
            workers[0].sendto(_packet(0, [1] * K), sw.address)
            workers[1].sendto(_packet(1, [2] * K), sw.address)
            results = [_result(w) for w in workers]  # multicast to every worker
            head, values, first = results[0]
            assert values.tolist() == [3] * K
            assert head["contributors"] == 0b011 and head["quorum"] == 2, head
            assert {r[2] for r in results} == {first}
            # The straggler's packet for the finished chunk: not added; it had the result
            # in the multicast. Its resend (the result was lost) gets the same bytes.
            workers[2].sendto(_packet(2, [1000] * K, seq=0), sw.address)
            workers[2].sendto(_packet(2, [1000] * K, seq=0, flags=P.FLAG_RETRANSMIT),
                              sw.address)
            assert _result(workers[2])[2] == first
            assert sw.aggregator.late_answered == 1
            assert sw.aggregator.drop_counts()["late"] == 1
            # The next call uses the slot's other version; the one after, this cell again,
            # where worker 2 still has its bit from call 1 (its late packet cleared
            # nothing): a new use all the same, a sum of its own.
            for call, version, senders in ((2, 1, (0, 2)), (3, 0, (2, 0))):
                for w in senders:
                    workers[w].sendto(_packet(w, [10 * (w + 1)] * K, call=call, seq=call - 1,
                                              version=version), sw.address)
                for w in range(N):
                    head, values, _ = _result(workers[w])
                    assert values.tolist() == [40] * K, (call, values)
                    assert head["contributors"] == 0b101 and head["call"] == call, head
            # Worker 1's packet of call 1 arrives now: its cell moved on, it is dropped.
            workers[1].sendto(_packet(1, [5] * K, seq=1), sw.address)
            deadline = time.monotonic() + 5
            while sw.aggregator.drop_counts().get("late", 0) < 2:
                assert time.monotonic() < deadline, sw.aggregator.drop_counts()
                time.sleep(0.01)
            assert sw.aggregator.get_cell(JOB, 0, 0) == 40  # unchanged
            # A worker that never sends (dead) does not stall the others: quorum 2 of 3.
            for slot in range(SLOTS):
                for w in (0, 1):
                    workers[w].sendto(_packet(w, [1] * K, offset=slot * K, call=4,
                                              slot=slot, version=1, seq=3 + slot),
                                      sw.address)
                assert _result(workers[0])[1].tolist() == [2] * K
        finally:
            for w in workers:
                w.close()


def test_a_sync_chunk_waits_for_every_worker_and_a_quorum_above_n_is_malformed():
    with switch_thread() as sw:
        workers = _workers(sw)
        try:
            for w in (0, 1):
                workers[w].sendto(_packet(w, [1] * K, quorum=0), sw.address)
            workers[0].settimeout(0.3)
            with pytest.raises(socket.timeout):
                workers[0].recv(65536)  # two of three: not complete
            workers[2].sendto(_packet(2, [1] * K, quorum=0), sw.address)
            workers[0].settimeout(5)
            head, values, _ = _result(workers[0])
            assert values.tolist() == [3] * K and head["contributors"] == 0b111
            before = sw.aggregator.drop_counts().get("malformed", 0)
            workers[0].sendto(_packet(0, [1] * K, quorum=N + 1, call=9), sw.address)
            deadline = time.monotonic() + 5
            while sw.aggregator.drop_counts().get("malformed", 0) == before:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            for w in workers:
                w.close()


def check_counted(result, dtype, op, count, seed, n, counted):
    """Within docs/quantization.md's bound of the SUM (or AVERAGE) over the ranks
    ``counted`` alone (the bound taken with every rank's exponents: at least as large)."""
    xs = inputs_of_all_ranks(dtype, op, count, seed, n)
    agreed = np.max([blockfp.block_exponents(x, P.MAX_ELEMENTS, P.DEFAULT_BLOCK)[0]
                     for x in xs], axis=0)
    exact = xs[counted].astype(np.longdouble).sum(axis=0)
    if op == "average":
        exact /= len(counted)
    exps = blockfp.element_exponents(agreed, count, P.MAX_ELEMENTS, P.DEFAULT_BLOCK)
    bound = blockfp.error_bound(n, exps, np.dtype(dtype), result, op == "average")
    error = np.abs(result.astype(np.longdouble) - exact).astype(np.float64)
    bad = np.flatnonzero(error > bound * (1 + 1e-9))
    assert bad.size == 0, (f"{op} over ranks {counted}: element {bad[0]} = {result[bad[0]]}, "
                           f"expected {exact[bad[0]]}, error {error[bad[0]]:.3g}")


@pytest.mark.mpi
def test_quorum_calls_do_not_wait_for_a_straggler_and_the_bound_waits_for_it():
    """Three ranks; the switch holds rank 2's packets back 150 ms (a slow path). In
    quorum 2 every chunk completes without it: the result is the sum (or average) over
    ranks 0 and 1 exactly as reported, on every rank, and rank 2 learns it was left out.
    With quorum_max_steps 1, a step ends where a call repeats one rank 2 was left out of
    (the third, which repeats the first): the fourth waits for it (sync: the sum of all
    three). Back in sync, the sum of all three."""
    count = 200_000
    steps = [(2, "float32", "sum", count, 1), (None, "float32", "average", count, 2),
             (None, "float32", "sum", count, 3), (None, "float64", "sum", count, 4),
             (0, "float32", "sum", count, 5)]
    with embedded_switch() as sw:
        send_faults((sw.host, sw.port), straggler_worker=2, straggler_delay_ms=150)
        results = mpirun.run(N, rank_cases.quorum_calls, {
            "steps": steps,
            "settings": {"switch_min_bytes": 0, "quorum_max_steps": 1}},
            env={"INA_SWITCH": sw.address_text}, timeout=180)
        sw.stop()
    stamps = [c["quorum"] for c in results[0]["calls"]]
    assert stamps == [2, 2, 2, 0, 0], results[0]["calls"]
    for i, (_, dtype, op, n_, seed) in enumerate(steps):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"call {i}: ranks differ"
        calls = [r["calls"][i] for r in results]
        assert len({str(sorted((k, str(v)) for k, v in c.items()
                               if k in ("quorum", "ranks_left_out", "ranks_never_counted")))
                    for c in calls}) == 1, calls
        if stamps[i]:
            assert calls[0]["ranks_left_out"] == calls[0]["ranks_never_counted"] == [2], calls
            assert [c["counted"] for c in calls] == [True, True, False], calls
            assert [c["counted_flag"] for c in calls] == [True, True, False], calls
            assert calls[2]["chunks_left_out"] > 0
            check_counted(per_rank[0], dtype, op, n_, seed, N, [0, 1])
        else:
            assert all(c["counted"] and not c["ranks_left_out"] for c in calls), calls
            check_counted(per_rank[0], dtype, op, n_, seed, N, [0, 1, 2])
    report = results[2]["stats"]["switch"]["quorum"]
    assert report["quorum_calls"] == 3 and report["waited_calls"] == 1, report
    assert report["calls_left_out"] == 3 and report["mode"] == "sync", report
    status = parse_status(sw.final_status)
    assert status["drops"].get("late") or status.get("late_answered"), sw.final_status


@pytest.mark.mpi
def test_a_lagging_rank_that_loses_results_takes_them_from_a_peer():
    """Quorum 2 of 3, rank 2's packets held back 30 ms, and 10% of the switch's packets
    lost on the way out: a rank whose result is lost after the others moved its cell on
    cannot get it from the switch any more. It takes the results of its slots' later
    chunks as they pass, and the lost ones from a peer (chunks_repaired): every call is
    served by the switch, and every rank gets the same bits."""
    count = 1_000_000
    steps = [(2, "float32", "sum", count, 11), (None, "float32", "sum", count, 12),
             (None, "float32", "average", count, 13)]
    with embedded_switch() as sw:
        send_faults((sw.host, sw.port), straggler_worker=2, straggler_delay_ms=30,
                    drop_out=0.1)
        results = mpirun.run(N, rank_cases.quorum_calls, {
            "steps": steps, "settings": {"switch_min_bytes": 0}},
            env={"INA_SWITCH": sw.address_text}, timeout=180)
        sw.stop()
    for i, (_, dtype, op, n_, seed) in enumerate(steps):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"call {i}: ranks differ"
        calls = [r["calls"][i] for r in results]
        if calls[0]["ranks_left_out"] == calls[0]["ranks_never_counted"]:
            counted = [r for r in range(N) if r not in calls[0]["ranks_left_out"]]
            check_counted(per_rank[0], dtype, op, n_, seed, N, counted)
    for r in results:
        assert not r["stats"]["fallback_reasons"], r["stats"]["fallback_reasons"]
        assert r["stats"]["engines"] == {"ina": len(steps)}, r["stats"]
    assert sum(r["stats"]["switch"]["quorum"]["chunks_repaired"] for r in results) > 0
