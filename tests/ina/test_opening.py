"""A call's opening through the software switch, worker by worker (docs/protocol.md, A
call's opening): the max of the proposals, the MISMATCH mark when identities differ,
loss recovered, and the packets the switch refuses. Workers of a job joined by hand
(WorkerLink), their openings run in threads as the ranks run them in processes."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina import kernels
from ina_collectives.ina.link import Timers, WorkerLink
from ina_collectives.ina.plan import StreamPlan
from ina_collectives.switch.faults import send_faults
from tests.ina.test_link import joined, per_worker
from tests.switch.test_server import switch_thread

K, S, N = 64, 4, 3
G = P.sub_blocks(K, P.DEFAULT_BLOCK)


@pytest.fixture
def job():
    """N joined workers of a fresh job on a switch of its own, and the switch."""
    with switch_thread() as sw, joined(sw.address, 700, N, K, S, 9) as links:
        yield sw, links


def open_all(links, identities, proposals, call=1, silence=5.0, deadline=30.0):
    """Every worker's opening at once; [(outcome, counters)] by worker. The retransmit
    timeout backs off to 0.2 s at most, so a silence bound of 5 s holds 25 tries or more:
    through a third lost each way a try comes back with 0.49, and 25 all lost (0.51**25,
    5e-8) is what a lossy case's bound costs, whatever the machine's load (at 1 s, the 9
    tries' 0.51**9 = 0.002 per worker and call failed a CI run)."""
    out: list = [None] * len(links)

    def one(w: int) -> None:
        result = links[w].opening(identities[w], proposals[w], call,
                                  Timers(0.02, 0.001, 0.2, silence), deadline)
        out[w] = result.reason, result.counters
    per_worker(len(links), one)
    return out


def proposals_of(w: int) -> np.ndarray:
    """Worker w's proposals: slot 0 all w, slot 1's first -w, the rest none."""
    p = np.full((S, G), P.PROPOSAL_NONE, np.int16)
    p[0] = w
    p[1, 0] = -w
    return p


def test_an_opening_agrees_on_the_max_proposals_and_uses_every_slot_once(job):
    sw, links = job
    assert all(link.opens for link in links)
    ident = (1 << 47) | 12345
    for call in (1, 2, 3):  # each opening uses every slot's next version
        props = [proposals_of(w) for w in range(N)]
        got = open_all(links, [ident] * N, props, call)
        assert [g[0] for g in got] == ["done"] * N, got
        for p in props:
            assert (p[0] == N - 1).all() and p[1, 0] == 0
            assert (p[1, 1:] == P.PROPOSAL_NONE).all() and (p[2:] == P.PROPOSAL_NONE).all()
        assert all(g[1]["open_sent"] == S for g in got)
        for link in links:
            np.testing.assert_array_equal(link.wire.versions, [call % 2] * S)
    stats = sw.stats()
    assert stats["openings"] == 3 * S and stats["results"] == 0, stats


@pytest.mark.parametrize("which", ["identity", "call"])
def test_an_opening_whose_identities_differ_tells_every_worker(job, which):
    """One worker's identity (or call number) differs: every cell is marked, every
    worker sees MISMATCH (none waits for a bound), and the next opening agrees."""
    sw, links = job
    identities = [77] * N
    if which == "identity":
        identities[-1] = 78
    out: list = [None] * N

    def one(w: int) -> None:
        call = 5 if which == "call" and w == N - 1 else 4
        result = links[w].opening(identities[w], proposals_of(w), call,
                                  Timers(0.02, 0.001, 1.0, 5.0), 30.0)
        out[w] = result.reason, result.counters
    threads = [threading.Thread(target=one, args=(w,)) for w in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [o[0] for o in out] == ["mismatch"] * N, out
    assert [o[1]["retransmitted"] for o in out] == [0] * N, out
    again = open_all(links, [77] * N, [proposals_of(w) for w in range(N)], 6)
    assert [g[0] for g in again] == ["done"] * N, again


def test_an_opening_recovers_lost_packets(job):
    """A third of the packets on the way in and out are lost: the timers and NACKs
    recover, every worker gets the same max proposals."""
    sw, links = job
    send_faults(sw.address, drop_in=0.3, drop_out=0.3)
    try:
        for call in range(1, 6):
            props = [proposals_of(w) for w in range(N)]
            got = open_all(links, [9] * N, props, call)
            assert [g[0] for g in got] == ["done"] * N, got
            assert all((p == props[0]).all() for p in props)
    finally:
        send_faults(sw.address)
    assert sum(sw.stats()["drops"].values()) > 0


def test_an_opening_the_third_worker_never_joins_fails_by_the_silence_bound(job):
    """Two of three workers open: the switch waits for the third. Its "held" answers do
    not keep an opening waiting (a peer that could not finish its last call waits at the
    error path's gate, which a failed opening reaches): their openings end by the
    silence bound and say so."""
    sw, links = job
    got = open_all(links[:2], [1, 1], [proposals_of(w) for w in range(2)], 1, silence=0.3,
                   deadline=10.0)
    assert all(g[0].startswith("no result within the silence bound") for g in got), got
    assert [list(link.wire.versions) for link in links[:2]] == [[0] * S] * 2  # nothing moved


def test_an_opening_that_no_switch_answers_fails_by_the_silence_bound(closed_udp_port):
    """No switch at the address: nothing answers the openings, which end by the silence
    bound and say so."""
    links = [WorkerLink(("127.0.0.1", closed_udp_port), P.JobFormat(700, N, K), w, S, epoch=9)
             for w in range(2)]
    got = open_all(links[:2], [1, 1], [proposals_of(w) for w in range(2)], 1, silence=0.3,
                   deadline=10.0)
    assert all(g[0].startswith("no result within the silence bound") for g in got), got
    assert [list(link.wire.versions) for link in links] == [[0] * S] * 2  # nothing moved
    for link in links:
        link.close()


def test_the_switch_refuses_malformed_openings_and_mixed_cells(job):
    sw, links = job
    a, b = links[0], links[1]

    def opening(link, count=0, blocks=G, flags=P.FLAG_OPEN, slot=0, quorum=0):
        head = P.pack_header(flags=flags, job=link.job, worker=link.worker, slot_version=0,
                             slot=slot, offset=5, count=count, blocks=blocks, epoch=9,
                             call=1, quorum=quorum, block=P.DEFAULT_BLOCK)
        return head + np.zeros(2 * blocks, ">i2").tobytes()

    before = sw.stats()["drops"]
    for bad in (opening(a, count=1), opening(a, blocks=G - 1), opening(a, quorum=2)):
        a.sock.sendto(bad, a.switch)
    # Slot 1: a's data packet starts a chunk, b's opening finds it: mismatched.
    a.sock.sendto(P.pack_data(np.ones(K, ">i4"), flags=0, job=a.job, worker=0,
                              slot_version=0, slot=1, offset=0, epoch=9), a.switch)
    b.sock.sendto(opening(b, slot=1), b.switch)
    # Slot 2: a's opening starts the cell, b's data packet of the same call finds it:
    # mismatched. (One of an earlier call would be stale.)
    a.sock.sendto(opening(a, slot=2), a.switch)
    b.sock.sendto(P.pack_data(np.ones(K, ">i4"), flags=0, job=b.job, worker=1,
                              slot_version=0, slot=2, offset=0, epoch=9, call=1), b.switch)
    deadline = 50
    while deadline:
        drops = sw.stats()["drops"]
        grown = {k: drops.get(k, 0) - before.get(k, 0) for k in drops}
        if grown.get("malformed") == 3 and grown.get("mismatched chunk") == 2:
            break
        deadline -= 1
        threading.Event().wait(0.1)
    assert grown.get("malformed") == 3 and grown.get("mismatched chunk") == 2, grown


def test_workers_that_open_different_slots_all_learn_the_mismatch_at_slot_0(job):
    """Ranks whose calls differ in length open different numbers of slots (one for a
    call of one chunk, S for a longer one): slot 0's marked result ends every opening at
    once; the half-used cells are left to an epoch the ranks no longer use, and the next
    opening, in a new epoch from version 0, agrees."""
    sw, links = job
    props = [proposals_of(w)[:1] for w in range(N - 1)] + [proposals_of(N - 1)]
    got = open_all(links, [5] * (N - 1) + [6], props, 1)
    assert [g[0] for g in got] == ["mismatch"] * N, got
    for link in links:  # what Aggregators.new_epoch does on every rank
        link.new_epoch(10)
    props = [proposals_of(w) for w in range(N)]
    got = open_all(links, [5] * N, props, 2)
    assert [g[0] for g in got] == ["done"] * N, got
    assert all((p[0] == N - 1).all() for p in props)


def test_a_gate_alone_leaves_its_call_number_to_a_quorum_call_after_it(job):
    """An opening used as a gate alone (its call then served off the switch, or a host
    operation's gate) carries the number of the next switch call and does not take it:
    that call, in quorum, meets the opened cells at its own number. Its chunks' offsets
    are below the opening's identity (which an opening holds where a chunk's offset is),
    yet they are not late: only an earlier call is older than an opened cell. (They were
    dropped as late, and the call stalled.)"""
    sw, links = job
    ident = 0x7FFF0000  # as the cell's offset: above every chunk's
    got = open_all(links, [ident] * N, [proposals_of(w) for w in range(N)], call=1)
    assert [g[0] for g in got] == ["done"] * N, got
    chunks = 3 * S  # every slot's both cells, the opened ones included
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(N)]
    fast = kernels.load("fast")
    local = [fast.block_exponents(x, K, P.DEFAULT_BLOCK)[0] for x in xs]
    agreed = np.max(local, axis=0)  # a quorum call agrees every chunk's exponents
    outs: list = [None] * N

    def one(w: int) -> None:
        out = np.full_like(xs[w], np.nan)
        result = links[w].stream(StreamPlan(xs[w], out, local[w], agreed.copy(), call=1,
                                            quorum=N),
                                 Timers(0.02, 0.001, 0.5, 3.0), 30.0)
        outs[w] = result, out
    per_worker(N, one)
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert sw.stats()["drops"].get("late", 0) == 0, sw.stats()["drops"]
    for result, out in outs:
        assert result.reason == "done", result.reason  # (not LOST: no chunk missing)
        np.testing.assert_allclose(out, total, rtol=0, atol=np.abs(total).max() * 1e-6)
