"""Loss recovery between the software switch and a worker, packet by packet
(docs/protocol-recovery.md, Loss): a NACK for packet numbers that never came, none for late or
retransmitted packets, and result requests answered only when the cell is done. Two
workers of a job joined by hand (WorkerLink), packets written here."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina.link import Timers, WorkerLink
from ina_collectives.ina.plan import StreamPlan
from ina_collectives.switch import parse_status
from ina_collectives.switch.embedded import embedded_switch

K, S, EPOCH = 4, 8, 77
QUIET = 0.3  # seconds a socket is watched to show that nothing arrives


@contextlib.contextmanager
def joined(address: tuple[str, int], job_id: int, n: int, k: int, slots: int,
           epoch: int) -> Iterator[list[WorkerLink]]:
    """The n workers of a job, joined at the switch at ``address``; left and closed
    after."""
    links = [WorkerLink(address, P.JobFormat(job_id, n, k), w, slots, epoch=epoch)
             for w in range(n)]
    try:
        for link in links:
            link.join(5.0)
        yield links
    finally:
        for link in links:
            link.leave()
            link.close()


def per_worker(count: int, one) -> None:
    """``one(w)`` for w in 0 .. count - 1, each in a thread of its own, as the ranks run
    in processes; returns when every one did (or after 60 s each)."""
    threads = [threading.Thread(target=one, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.fixture
def job():
    """Two joined workers of a fresh job on a switch of its own (its counters are the
    test's), and the switch."""
    with embedded_switch() as sw, joined((sw.host, sw.port), 900, 2, K, S, EPOCH) as links:
        yield sw, links


def packet(link: WorkerLink, chunk: int, seq: int, flags: int = 0, values=None) -> bytes:
    values = np.full(K, chunk + 1, ">i4") if values is None else values
    if not len(values):  # a result request: the header alone
        return P.pack_header(flags=flags, job=link.job, worker=link.worker, slot_version=0,
                             slot=chunk % S, offset=chunk * K, count=0, epoch=EPOCH,
                             seq=seq)
    return P.pack_data(values, flags=flags, job=link.job, worker=link.worker,
                       slot_version=0, slot=chunk % S, offset=chunk * K, epoch=EPOCH,
                       seq=seq)


def send(link: WorkerLink, data: bytes) -> None:
    link.sock.sendto(data, link.switch)


def receive(link: WorkerLink, timeout: float = 5.0) -> tuple[dict[str, int], bytes]:
    link.sock.settimeout(timeout)
    data = link.sock.recv(65536)
    return P.unpack_header(data), data


def silent(link: WorkerLink) -> bool:
    link.sock.settimeout(QUIET)
    try:
        link.sock.recv(65536)
    except socket.timeout:
        return True
    return False


def test_numbers_skipped_are_nacked_to_that_worker_alone(job):
    sw, (a, b) = job
    send(a, packet(a, 0, seq=10))
    send(a, packet(a, 3, seq=13))  # 11 and 12 never came
    head, data = receive(a)
    assert head["flags"] == P.FLAG_NACK and (head["seq"], head["count"]) == (11, 2)
    assert (head["job"], head["worker"], head["epoch"]) == (a.job, 0, EPOCH)
    assert len(data) == P.HEADER_BYTES
    assert silent(b)
    # Their retransmissions, a late copy and the next in order ask for nothing more.
    send(a, packet(a, 1, seq=11, flags=P.FLAG_RETRANSMIT))
    send(a, packet(a, 2, seq=12, flags=P.FLAG_RETRANSMIT))
    send(a, packet(a, 4, seq=14))
    send(a, packet(a, 0, seq=10))  # a late duplicate: behind the expectation
    # ... but it is a packet the switch holds while chunk 0 waits for b: "held" (a NACK
    # naming no packet), which keeps a's silence bound waiting for its late peer.
    head, data = receive(a)
    assert head["flags"] == P.FLAG_NACK and head["count"] == 0 and len(data) == P.HEADER_BYTES
    assert silent(a)
    # Numbers wrap at 256; a jump past the window is taken as lost track, not 200 losses.
    send(b, packet(b, 5, seq=254))  # chunks a never sent: no result comes
    send(b, packet(b, 6, seq=1))  # 255 and 0 missing
    head, _ = receive(b)
    assert head["flags"] == P.FLAG_NACK and (head["seq"], head["count"]) == (255, 2)
    send(b, packet(b, 7, seq=201))
    assert silent(b)
    assert sw.stop() == 0
    assert parse_status(sw.final_status)["nacks"] == 2, sw.final_status


def test_a_result_request_is_answered_only_by_a_done_cell(job):
    sw, (a, b) = job
    send(a, packet(a, 0, seq=0))
    send(b, packet(b, 0, seq=0))
    results = [receive(link)[1] for link in (a, b)]
    assert results[0] == results[1] and P.unpack_header(results[0])["flags"] == P.FLAG_RESULT
    request = packet(a, 0, seq=0, flags=P.FLAG_RETRANSMIT, values=np.zeros(0, ">i4"))
    assert len(request) == P.HEADER_BYTES
    send(a, request)
    assert receive(a)[1] == results[0]  # the same result again, to a alone
    assert silent(b)
    # Chunk 1 waits for b: a request from a gets no result and adds nothing; the switch
    # says it holds a's packet (a NACK naming no packet: a's peer is late).
    send(a, packet(a, 1, seq=1))
    send(a, packet(a, 1, seq=1, flags=P.FLAG_RETRANSMIT, values=np.zeros(0, ">i4")))
    held = P.unpack_header(receive(a)[1])
    assert held["flags"] == P.FLAG_NACK and held["count"] == 0 and held["offset"] == 0
    assert silent(a)
    send(b, packet(b, 1, seq=1))
    done = [P.unpack_header(receive(link)[1]) for link in (a, b)]
    assert all(d["flags"] == P.FLAG_RESULT and d["offset"] == K for d in done)
    # b never sent chunk 0 of another offset: a request naming it is not answered.
    send(b, P.pack_header(flags=P.FLAG_RETRANSMIT, job=b.job, worker=1, slot_version=0,
                          slot=0, offset=8 * K, count=0, epoch=EPOCH))
    assert silent(b)
    assert sw.stop() == 0
    status = parse_status(sw.final_status)
    assert status["result_requests"] == 3, sw.final_status
    assert status["retransmits_answered"] == 1, sw.final_status


def test_a_worker_resends_what_is_nacked_and_asks_for_lost_results(switch, faults):
    """One worker (a job of one) streams 400 chunks through 20% loss each way: it resends
    exactly the NACKed packets, asks for lost results with headers, and the output is the
    input (integers: exact)."""
    from ina_collectives.ina import kernels

    k, slots, chunks = 64, 8, 400
    faults(drop_in=0.2, drop_out=0.2)
    link = WorkerLink((switch.host, switch.port), P.JobFormat(901, 1, k), 0, slots, epoch=5)
    try:
        link.join(5.0)
        x = np.arange(k * chunks, dtype=np.float32) % 1000 - 500
        local, _ = kernels.load("fast").block_exponents(x, k, link.block)
        out = np.full_like(x, np.nan)
        result = link.stream(StreamPlan(x, out, local, local.copy()),
                             Timers(0.01, 0.005, 0.5, silence=10.0), deadline=60.0)
    finally:
        link.leave()
        link.close()
    assert result.ok, result.reason
    np.testing.assert_array_equal(out, x)
    counters = result.counters
    assert counters["nacks"] > 0 and counters["nack_resent"] > 0, counters
    assert counters["result_requests"] > 0, counters


def test_a_packet_overtaken_by_the_whole_window_asks_once_until_it_is_sent_again(job):
    """Worker b sent chunks 1-7 but never chunk 0: a's stream gets the results of all
    its later packets and none for chunk 0. Chunk 0 asks for its result once (after
    OVERTAKEN results), not again every OVERTAKEN: asks that arrive after a chunk
    completes each bring its whole result back. The timers (5 s) never fire here."""
    _, (a, b) = job
    for chunk in range(1, S):
        send(b, packet(b, chunk, seq=chunk))
    x = np.ones(S * K, np.float32)
    exps = np.zeros(S, np.int16)  # (G = 1 sub-block per chunk of K = 4)
    result = a.stream(StreamPlan(x, np.empty_like(x), exps, exps.copy()),
                      Timers(5.0, 5.0, 5.0, silence=1.0), deadline=1.5)
    assert not result.ok and result.missing.tolist() == [0], (result.reason, result.missing)
    assert result.counters["result_requests"] == 1, result.counters
    assert result.counters["retransmitted"] == 0, result.counters


def test_a_late_retransmission_is_stale_not_summed_into_a_later_call():
    """Worker a's retransmission of call 1, held up on the way, arrives after a's packet of
    call 2 (the slot's other version, which cleared a's bit in call 1's cell). Taken for
    new data, it would open call 1's cell again and be summed into call 3, which uses
    that cell with the same offset: older than a's latest packet to the slot, it is
    dropped as stale (found by bench/loopback/soak.py)."""
    with embedded_switch() as sw:
        links = [WorkerLink((sw.host, sw.port), P.JobFormat(902, 2, K), w, 1, epoch=EPOCH)
                 for w in range(2)]
        for link in links:
            link.join(5.0)
        a, b = links

        def send_use(link, version, seq, value, flags=0):
            send(link, P.pack_data(np.full(K, value), flags=flags, job=link.job,
                                   worker=link.worker, slot_version=version, slot=0,
                                   offset=0, epoch=EPOCH, seq=seq))

        def sums():
            return [np.frombuffer(receive(link)[1][P.HEADER_BYTES + P.PAIR_BYTES:], ">i4")[0]
                    for link in links]

        send_use(a, 0, 0, 1)
        send_use(b, 0, 0, 10)
        assert sums() == [11, 11]
        send_use(a, 1, 1, 100)
        send_use(a, 0, 0, 1, flags=P.FLAG_RETRANSMIT)  # late: a's call 1 again
        send_use(b, 1, 1, 1000)
        assert sums() == [1100, 1100]
        send_use(b, 0, 2, 100000)
        send_use(a, 0, 2, 10000)
        assert sums() == [110000, 110000]
        for link in links:
            link.leave()
            link.close()
        assert sw.stop() == 0
    assert parse_status(sw.final_status)["drops"].get("stale") == 1, sw.final_status


def test_the_software_switch_states_that_it_nacks(job):
    """Its join replies carry CAP_NACKS: the worker's first timeout of a packet then asks
    for the result with a header before it resends the whole packet (a P4 switch's
    two-value replies leave the flag clear)."""
    _, links = job
    assert [link.wire.nacking for link in links] == [True, True]


def test_the_stream_takes_floats_into_the_same_dtype(job):
    _, (a, _) = job
    exps = np.zeros(S, np.int16)
    for x, out in ((np.ones(S * K, np.int32), np.empty(S * K, np.int32)),
                   (np.ones(S * K, np.float32), np.empty(S * K, np.float64))):
        with pytest.raises(TypeError, match=f"float32 or float64 .* not {x.dtype} into "
                                            f"{out.dtype}"):
            a.stream(StreamPlan(x, out, exps, exps.copy()),
                     Timers(1.0, 1.0, 1.0, silence=1.0), deadline=1.0)


def test_the_timer_follows_a_slow_targets_round_trip():
    """Four workers stream through a switch that serves 4,000 packets a second (a slow
    target, as BMv2 is): the round trip is its queue of n x S packets, steady, so RTTVAR
    shrinks to nothing. Nothing is lost, so every timeout is needless: the RTO's margin
    over SRTT keeps them at about 1% of the packets on a quiet machine (without it, 13%
    asked again, and each request lengthened the queue; docs/reliability.md). The bound
    is 5%, plus what the machine's own stalls explain: a thread that sleeps 1 ms at a
    time measures them, and each stall longer than the RTO's margin over the queue's
    round trip (RTO_MARGIN x n x S packets at 4,000 a second: 4 ms) may fire every
    worker's S timers once (beside two busy loops, 57 of 1,152 with no stall of the
    whole round trip seen). The sums are exact."""
    from ina_collectives._fast.transport import RTO_MARGIN
    from ina_collectives.ina import kernels
    from tests.switch.test_server import switch_thread

    n, k, slots, chunks, pps = 4, 256, 8, 96, 4000
    x = np.arange(k * chunks, dtype=np.float32) % 1000 - 500
    local, _ = kernels.load("fast").block_exponents(x, k, P.DEFAULT_BLOCK)
    stalls, measuring = [0], threading.Event()

    def measure() -> None:  # the machine's stalls, as a thread of this process sees them
        while not measuring.is_set():
            before = time.monotonic()
            time.sleep(0.001)
            if time.monotonic() - before > RTO_MARGIN * n * slots / pps:
                stalls[0] += 1

    with switch_thread() as sw, joined(sw.address, 902, n, k, slots, 3) as links:
        sw.set_faults(service_pps=pps)
        outs = [[np.full_like(x, np.nan) for _ in links] for _ in range(3)]
        results: list = [None] * n

        def one(w: int, call: int) -> None:
            results[w] = links[w].stream(
                StreamPlan(x, outs[call][w], local, local.copy(), call=call + 1),
                Timers(0.02, 0.005, 0.5, silence=10.0), deadline=60.0)

        sent = needless = 0
        meter = threading.Thread(target=measure)
        meter.start()
        try:
            for call in range(3):  # the estimate carries over from call to call
                threads = [threading.Thread(target=one, args=(w, call)) for w in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(90)
                for w, result in enumerate(results):
                    assert result is not None and result.ok, (call, w, result)
                    np.testing.assert_array_equal(outs[call][w], n * x)
                    c = result.counters
                    sent += c["sent"]
                    needless += c["retransmitted"] + c["result_requests"]
        finally:
            measuring.set()
            meter.join()
    print(f"needless timeouts: {needless} of {sent} packets; {stalls[0]} stalls")
    bound = 0.05 * sent + stalls[0] * n * slots
    assert needless <= bound, (needless, sent, stalls[0], [r.counters for r in results])


def test_a_worker_absent_from_a_quorum_call_sends_nothing_new_and_takes_every_result():
    """Quorum 2 of 3, worker 2 absent (the Horovod runtime ran the call without its
    tensor, with the switch's quorum: docs/quorum.md, Running ahead): workers 0 and 1
    complete every chunk, worker 2 sends no values (and no request until a timeout
    would ask) and ends with the same sums; a worker may be absent from quorum calls
    only."""
    from ina_collectives.ina.kernels import load
    from tests.switch.test_server import switch_thread

    k, slots, n, chunks = 64, 4, 3, 11
    fast = load("fast")
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(chunks * k).astype(np.float32) for _ in range(n)]
    xs[2][:] = 0.0  # (what the runtime fills in for an absent rank)
    exps = [fast.block_exponents(x, k, P.DEFAULT_BLOCK)[0] for x in xs]
    agreed = np.max(exps, axis=0)
    got: list = [None] * n
    with switch_thread() as sw, joined(sw.address, 712, n, k, slots, 3) as links:
        def one(w: int) -> None:
            out = np.full_like(xs[w], np.nan)
            result = links[w].stream(
                StreamPlan(xs[w], out, exps[w], agreed.copy(), call=1, quorum=2,
                           absent=w == 2),
                Timers(0.02, 0.002, 0.5, 5.0), 30.0)
            got[w] = result, out
        per_worker(n, one)
        with pytest.raises(ValueError, match="absent from a quorum call only"):
            links[2].stream(StreamPlan(xs[2], np.empty_like(xs[2]), exps[2], agreed.copy(),
                                       call=2, absent=True),
                            Timers(0.02, 0.002, 0.5, 5.0), 30.0)
    total = xs[0].astype(np.float64) + xs[1]
    for w, (result, out) in enumerate(got):
        assert result.ok, (w, result.reason)
        np.testing.assert_allclose(out, total, rtol=0, atol=np.abs(total).max() * 1e-5)
        assert (out == got[0][1]).all()
    counters = got[2][0].counters
    assert counters["left_out"] == chunks and counters["retransmitted"] == 0, counters


@pytest.mark.parametrize("late", [0.0, 0.2])
def test_a_late_peer_is_waited_for_past_the_silence_bound_while_the_switch_holds_the_packets(
        late):
    """Worker 1 starts its stream 1.5 s after worker 0 (a stopped or descheduled rank),
    three times worker 0's silence bound of 0.5 s. The switch answers worker 0's resends
    (a result request, then the whole packet) with "held" (a NACK naming no packet): it
    is alive and waits for a peer. Worker 0 waits on and ends with the sums, as worker 1
    does: no rank gives up on a call a peer then finishes (which would leave the ranks
    apart, one in the error path, the other in the program's next MPI call). ``late``:
    worker 1's first packets come just before, or long after, worker 0's resends began."""
    from ina_collectives.ina import kernels
    from tests.switch.test_server import switch_thread

    n, k, slots, chunks = 2, 64, 4, 10
    x = np.arange(k * chunks, dtype=np.float32) % 100 - 50
    local, _ = kernels.load("fast").block_exponents(x, k, P.DEFAULT_BLOCK)
    results: list = [None] * n
    outs = [np.full_like(x, np.nan) for _ in range(n)]
    with switch_thread() as sw, joined(sw.address, 903, n, k, slots, 3) as links:
        def one(w: int) -> None:
            if w == 1:
                time.sleep(1.5 + late)
            results[w] = links[w].stream(StreamPlan(x, outs[w], local, local.copy(), call=1),
                                         Timers(0.02, 0.005, 0.2, silence=0.5),
                                         deadline=30.0)

        per_worker(n, one)
    for w in range(n):
        assert results[w] is not None and results[w].ok, (w, results[w])
        np.testing.assert_array_equal(outs[w], n * x)
