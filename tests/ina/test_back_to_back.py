"""Calls back to back on a link (docs/protocol.md, Calls back to back): the next call is
queued behind the running one (``then``) and adopted by the stream's own loop while the
running one's last window drains, each slot taking the next call's first chunk as soon
as its last result of the running call is back. Workers of a job joined by hand, their
streams in threads as the ranks run them in processes, through the software switch."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina.link import WorkerLink
from ina_collectives.ina.plan import StreamPlan
from tests.ina.test_link import joined, per_worker
from tests.ina.test_predicted import IDENT, TIMERS, G, K, N, S, own, window_max
from tests.switch.test_server import switch_thread


@pytest.fixture
def job():
    """N joined workers of a fresh job on a switch of its own, and the switch."""
    with switch_thread() as sw, joined(sw.address, 711, N, K, S, 12) as links:
        yield sw, links


def call_inputs(chunks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(N)]


class Call:
    """One worker's arguments of one predicted call (its first window predicted from the
    inputs' own maxima, as the engine's table would from the step before)."""

    def __init__(self, x: np.ndarray, first: np.ndarray, number: int):
        self.x, self.number = x, number
        self.local = own(x)
        self.agreed = np.full_like(self.local, P.PROPOSAL_NONE)
        self.agreed[:first.size] = first[:self.agreed.size]
        self.out = np.full_like(x, np.nan)
        self.learn = np.full(2 * S * G, P.PROPOSAL_NONE, np.int16)

    def stream(self, link: WorkerLink, then: Call | None = None, timers=TIMERS):
        return link.stream(self.plan(), timers, 30.0,
                           then=then.queued() if then is not None else None)

    def queued(self) -> tuple:
        return self.plan(), TIMERS, 30.0

    def plan(self) -> StreamPlan:
        return StreamPlan(self.x, self.out, self.local, self.agreed, call=self.number,
                          ident=IDENT + self.number, learn=self.learn)


def exact(xs: list[np.ndarray], out: np.ndarray) -> None:
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    np.testing.assert_allclose(out, total, rtol=0, atol=np.abs(total).max() * 1e-6)


@pytest.mark.parametrize("chunks", [(7, 5, 9, 4), (3, 7, 3, 4), (9, 4, 6, 5)])
def test_calls_adopted_in_each_drain_sum_alike_and_start_before_the_last_returns(
        job, chunks):
    """Four calls in a row, each queued behind the one before and adopted in its drain
    (one call of the second row is shorter than the window, so a slot is free at once;
    the third row's second call overflows its prediction on one worker). Every sum is
    exact on every worker, every call after the first says it was adopted, and each was
    adopted before the call before it returned, whose return found the adopted call's
    whole first window sent already (the switch counted those packets)."""
    sw, links = job
    overflow = chunks == (9, 4, 6, 5)
    xs = [call_inputs(c, seed) for seed, c in enumerate(chunks)]
    firsts = [window_max(x, c) for x, c in zip(xs, chunks)]
    if overflow:
        xs[1][2][K:2 * K] *= 64  # (worker 2's chunk 1 of call 2: over its prediction)
    calls = [[Call(xs[i][w], firsts[i], i + 1) for i in range(len(chunks))]
             for w in range(N)]
    adopted_on_return = np.zeros((N, len(chunks)), bool)
    results: list[list] = [[None] * len(chunks) for _ in range(N)]
    barrier = threading.Barrier(N)
    packets: list[int] = []

    def one(w: int) -> None:
        link, mine = links[w], calls[w]
        for i in range(len(chunks)):
            then = mine[i + 1].queued() if i + 1 < len(chunks) else None
            results[w][i] = (link.stream(mine[i].plan(), TIMERS, 30.0, then=then)
                             if i == 0 else link.resume(then))
            adopted_on_return[w, i] = link.adopted
            if i == 0 and barrier.wait(30) == 0:  # (all returned: the next call's first
                deadline = time.monotonic() + 5  # window out, not yet resumed)
                want = N * (chunks[0] + min(S, chunks[1]))
                while sw.stats()["packets_in"] < want and time.monotonic() < deadline:
                    time.sleep(0.01)
                packets.append(sw.stats()["packets_in"])
            if i == 0:
                barrier.wait(30)

    per_worker(N, one)
    assert packets and packets[0] >= N * (chunks[0] + min(S, chunks[1])), packets
    for w in range(N):
        for i in range(len(chunks)):
            result = results[w][i]
            assert result is not None and result.ok, (w, i, result)
            exact(xs[i], calls[w][i].out)
            assert result.counters.get("adopted", 0) == (i > 0), (w, i, result.counters)
            # (adopted in the drain of the call before, by the time that call returned)
            assert adopted_on_return[w, i] == (i + 1 < len(chunks)), (w, i)
        assert not links[w].adopted
    overflows = [results[w][1].counters["overflows"] for w in range(N)]
    assert overflows == ([1] * N if overflow else [0] * N)
    assert sw.stats()["openings"] == 0
    assert len({tuple(link.wire.versions) for link in links}) == 1  # moved on alike


def test_a_stream_paused_at_its_drain_goes_on_with_the_next_call_queued_then(job):
    """``pause``: the stream returns None once every chunk went once, its last window in
    flight; the caller learns the next call meanwhile and ``proceed`` queues it: it is
    adopted at once, the paused call ends with every sum exact, and the next one, resumed,
    too. A paused stream refuses another stream, and ``abandon`` drops it."""
    sw, links = job
    chunks = (9, 5)
    xs = [call_inputs(c, seed) for seed, c in enumerate(chunks)]
    firsts = [window_max(x, c) for x, c in zip(xs, chunks)]
    results: list = [None] * N

    def one(w: int) -> None:
        link = links[w]
        first, second = Call(xs[0][w], firsts[0], 1), Call(xs[1][w], firsts[1], 2)
        assert link.stream(first.plan(), TIMERS, 30.0, pause=True) is None
        assert link.paused
        with pytest.raises(RuntimeError, match="adopted or paused on this link"):
            second.stream(link)
        done = link.proceed(second.queued())
        assert not link.paused and link.adopted
        results[w] = (done, link.resume(), first, second)

    per_worker(N, one)
    for w, (done, then, first, second) in enumerate(results):
        assert done.ok and then.ok, (w, done, then)
        exact(xs[0], first.out)
        exact(xs[1], second.out)
        assert (done.counters.get("adopted", 0), then.counters.get("adopted", 0)) == (0, 1)
    x = call_inputs(2, 3)  # (within the window: it drains as its first window leaves)
    link = links[0]
    assert link.stream(Call(x[0], window_max(x, 2), 3).plan(), TIMERS, 1.0,
                       pause=True) is None
    assert link.paused and not link.abandon() and not link.paused
    with pytest.raises(RuntimeError, match="no stream is paused"):
        link.proceed()


def test_a_call_queued_behind_a_stream_that_ends_before_its_drain_is_not_started(job):
    """A stream that cannot drain (one worker of the job streams alone: no cell
    completes; more chunks than slots, so its later chunks never go) ends by its deadline
    (the switch holds its packets for the peers'); the call queued behind it is dropped
    unstarted."""
    sw, links = job
    xs = call_inputs(2 * S + 1, 0)
    first = window_max(xs, 2 * S + 1)
    result = links[0].stream(Call(xs[0], first, 1).plan(), TIMERS, 1.0,
                             then=Call(xs[0], first, 2).queued())
    assert not result.ok and "deadline passed" in result.reason, result.reason
    assert not links[0].adopted and not links[0].abandon()
    with pytest.raises(RuntimeError, match="no call is adopted"):
        links[0].resume()


def test_a_link_with_an_adopted_call_refuses_another_until_it_is_resumed_or_abandoned(
        job):
    _, links = job
    xs = call_inputs(3, 1)
    first = window_max(xs, 3)
    empty = np.zeros(0, np.float32)
    nothing = StreamPlan(empty, empty.copy(), np.zeros(0, np.int16), np.zeros(0, np.int16))
    for w in range(N):  # (the calls queued where they cannot be, refused before the stream)
        with pytest.raises(ValueError, match="an empty call is not queued"):
            links[w].stream(Call(xs[w], first, 1).plan(), TIMERS, 30.0,
                            then=(nothing, TIMERS, 1.0))
        quorum = Call(xs[w], first, 2).plan()
        with pytest.raises(ValueError, match="queued in sync only"):
            links[w].stream(Call(xs[w], first, 1).plan(), TIMERS, 30.0,
                            then=(StreamPlan(quorum.x, quorum.out, quorum.local,
                                             quorum.agreed, quorum=2), TIMERS, 1.0))
    results: list = [None] * N

    def one(w: int) -> None:
        results[w] = Call(xs[w], first, 1).stream(links[w], Call(xs[w], first, 2))

    per_worker(N, one)
    assert all(r.ok for r in results), results
    link = links[0]
    assert link.adopted
    with pytest.raises(RuntimeError, match="a call is adopted or paused on this link"):
        Call(xs[0], first, 3).stream(link)
    with pytest.raises(RuntimeError, match="or abandon it first"):
        link.opening(IDENT, np.zeros((S, G), np.int16), 1, TIMERS, 1.0)
    assert link.abandon() and not link.adopted and not link.abandon()
    with pytest.raises(RuntimeError, match="no call is adopted"):
        link.resume()


# -- through the chooser, ranks in threads (tests/threadcomm.py) -----------------------

def steps_of(rank: int, sizes: list[int], steps: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(100 + rank)
    return [[(rng.standard_normal(n) * 2.0 ** (i % 5)).astype(np.float32)
             for i, n in enumerate(sizes)] for _ in range(steps)]


def run_steps(coll, inputs: list[list[np.ndarray]], keys: list) -> list[np.ndarray]:
    """Each step's calls in order, each call's ``following`` the next one (the next
    step's first after a step's last), as a runtime's queue gives them; the results."""
    from ina_collectives.collectives.chooser import Following
    from ina_collectives.collectives.ops import Op

    calls = [(x.copy(), key) for step in inputs for x, key in zip(step, keys)]

    def following(i: int):
        return lambda: Following(None, calls[i][0], Op.SUM, key=calls[i][1])
    for i, (buf, key) in enumerate(calls):
        coll.allreduce_flat(None, buf, Op.SUM, key=key,
                            following=following(i + 1) if i + 1 < len(calls) else None)
    return [buf for buf, _ in calls]


@pytest.mark.parametrize("keyed", [True, False], ids=["named", "program-order"])
def test_calls_back_to_back_give_the_bits_of_calls_one_after_another(keyed):
    """Three ranks, four steps of five calls (three of one identity, told apart by
    their names or by their place in the run): with calls adopted in each drain, every
    rank's results are bit for bit those of the same calls made one after another, and
    most calls after the first step went adopted."""
    from ina_collectives.collectives.chooser import Collectives
    from tests.ina.test_engine_faults import mortal_switch, settings_for
    from tests.threadcomm import ThreadPeers, run_ranks

    sizes = [3000, 3000, 5000, 3000, 700]
    keys = [f"layer{i}" for i in range(len(sizes))] if keyed else [None] * len(sizes)
    got = {}
    for back_to_back in (False, True):
        with mortal_switch() as sw:
            def rank(comm, back_to_back=back_to_back):
                from ina_collectives.ina.engine import InaEngine
                coll = Collectives(comm, settings_for(
                    sw, switch_back_to_back=back_to_back, switch_silence=5.0), InaEngine)
                try:
                    out = run_steps(coll, steps_of(comm.Get_rank(), sizes, 4), keys)
                    return out, coll.offload.switch_state()
                finally:
                    coll.free()
            got[back_to_back] = run_ranks(3, rank, timeout=120, kind=ThreadPeers)
    for r in range(3):
        (plain, plain_state), (adopted, state) = got[False][r], got[True][r]
        assert [a.tobytes() for a in adopted] == [p.tobytes() for p in plain], r
        assert plain_state["adopted_calls"] == 0
        assert state["adopted_calls"] >= 10, state  # (of the 15 after the first step)
        assert state["mismatched_predictions"] == state["rescued_calls"] == 0, state
    exact = np.sum([np.concatenate([x for step in steps_of(r, sizes, 4) for x in step])
                    .astype(np.float64) for r in range(3)], axis=0)
    ours = np.concatenate(got[True][0][0])
    np.testing.assert_allclose(ours, exact, rtol=0, atol=np.abs(exact).max() * 1e-5)


def learned_pair(coll, r: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Calls B (``count`` values) and C (twice as many), both identities learned by two
    calls of each before (so both go predicted): B's and C's inputs on rank ``r``."""
    b = np.arange(count, dtype=np.float32) * (r + 1)
    c = np.arange(2 * count, dtype=np.float32) + r
    for _ in range(2):
        coll.allreduce(b)
        coll.allreduce(c)
    return b.copy(), c.copy()


def adoptions(coll) -> list[bool]:
    """Whether the offload queues the next call behind each call from now on
    (``_adopt``), call by call."""
    started: list[bool] = []
    plain = coll.offload._adopt

    def adopt(*args):
        queued = plain(*args)
        started.append(queued is not None)
        return queued
    coll.offload._adopt = adopt
    return started


def test_a_switch_that_dies_with_the_next_call_adopted_leaves_every_rank_the_same_bits():
    """Rank 1 hears no result of call B (it sends all of B, then adopts C in B's drain
    and sends C's first window); rank 0 finishes B, adopts C, returns B and kills the
    switch. Rank 1's B fails by the silence bound (its adopted C dropped), rank 0's C
    does: in the rescue rank 1 takes B's last window from rank 0, no rank finished C,
    and every rank starts C again, on the exact engine. Both return the same bits for
    B and C, the exact sums."""
    from ina_collectives.collectives.chooser import Collectives, Following
    from ina_collectives.collectives.ops import Op
    from tests.ina.test_engine_faults import (
        deaf_from_the_next_stream,
        mortal_switch,
        settings_for,
    )
    from tests.threadcomm import ThreadPeers, run_ranks

    count = 1000
    with mortal_switch() as sw:
        def rank(comm):
            from ina_collectives.ina.engine import InaEngine
            r = comm.Get_rank()
            coll = Collectives(comm, settings_for(sw), InaEngine)
            try:
                b, c = learned_pair(coll, r, count)
                if r == 1:
                    deaf_from_the_next_stream(coll.offload)
                started = adoptions(coll)
                comm.Barrier()
                coll.allreduce_flat(None, b, Op.SUM,
                                    following=lambda: Following(None, c, Op.SUM))
                engines = [coll.stats.snapshot()["last_call"]["engine"]]
                if r == 0:
                    sw.kill()
                coll.allreduce_flat(None, c, Op.SUM)
                engines.append(coll.stats.snapshot()["last_call"]["engine"])
                return b, c, engines, coll.offload.switch_state(), started
            finally:
                coll.free()

        (b0, c0, engines0, state0, started0), (b1, c1, engines1, state1, started1) = (
            run_ranks(2, rank, timeout=60, kind=ThreadPeers))
    assert started0 == started1 == [True]  # (both adopted C in B's drain)
    assert b0.tolist() == (np.arange(count, dtype=np.float32) * 3).tolist()
    assert b1.tobytes() == b0.tobytes()
    assert c0.tolist() == c1.tolist() == (np.arange(2 * count) * 2 + 1.0).tolist()
    assert engines0 == ["ina", "gloo"] and engines1 == ["ina", "gloo"], (engines0, engines1)
    assert (state0["rescued_calls"], state1["rescued_calls"]) == (0, 1)
    assert state0["adopted_calls"] == 1 and state1["adopted_calls"] == 0


@pytest.mark.parametrize("adopting", [(0, 1), (1,)], ids=["both", "one"])
def test_a_nan_in_a_call_with_the_next_adopted_takes_it_exact_and_the_next_through_the_switch(
        adopting):
    """Call B holds a NaN on rank 1: every rank hands B to the exact path when its
    results say so, after the ranks in ``adopting`` adopted C in B's drain (one alone:
    its packets of C wait in half-used cells). The adopted C is dropped, and the rescue
    starts a new epoch, so those packets meet nothing: C then opens through the switch
    (the rescue cleared the predictions) with no mismatch, and every sum is right on
    every rank."""
    from ina_collectives.collectives.chooser import Collectives, Following
    from ina_collectives.collectives.ops import Op
    from tests.ina.test_engine_faults import mortal_switch, settings_for
    from tests.threadcomm import ThreadPeers, run_ranks

    count = 1000
    with mortal_switch() as sw:
        def rank(comm):
            from ina_collectives.ina.engine import InaEngine
            r = comm.Get_rank()
            coll = Collectives(comm, settings_for(sw, switch_silence=5.0), InaEngine)
            try:
                b, c = learned_pair(coll, r, count)
                if r == 1:
                    b[5] = np.nan
                started = adoptions(coll)
                epoch = coll.offload.link.epoch
                coll.allreduce_flat(None, b, Op.SUM,
                                    following=(lambda: Following(None, c, Op.SUM))
                                    if r in adopting else None)
                engines = [coll.stats.snapshot()["last_call"]["engine"]]
                coll.allreduce_flat(None, c, Op.SUM)
                engines.append(coll.stats.snapshot()["last_call"]["engine"])
                return (b, c, engines, coll.offload.switch_state(), started,
                        coll.offload.link.epoch != epoch)
            finally:
                coll.free()

        ranks = run_ranks(2, rank, timeout=60, kind=ThreadPeers)
    want_b = np.arange(count, dtype=np.float32) * 3
    want_b[5] = np.nan
    for r, (b, c, engines, state, started, new_epoch) in enumerate(ranks):
        assert started == ([True] if r in adopting else []) and new_epoch
        np.testing.assert_array_equal(b, want_b)
        assert c.tolist() == (np.arange(2 * count) * 2 + 1.0).tolist()
        assert engines == ["gloo", "ina"], engines
        assert state["mismatched_predictions"] == 0 and state["adopted_calls"] == 0


def test_a_following_that_is_not_callable_or_gives_no_call_is_refused_naming_it():
    """``following`` not callable: TypeError before the call starts. One whose value is
    not a call's arguments, or which raises: the call is done as ever (its sum is
    right), nothing is started after it, and then the refusal is raised, on every rank
    alike; the communicator stays usable."""
    from ina_collectives.collectives.chooser import Collectives, Following
    from ina_collectives.collectives.ops import Op
    from tests.ina.test_engine_faults import mortal_switch, settings_for
    from tests.threadcomm import ThreadPeers, run_ranks

    count = 1000

    def broken() -> Following:
        raise LookupError("the next tensor is gone")

    with mortal_switch() as sw:
        def rank(comm):
            from ina_collectives.ina.engine import InaEngine
            r = comm.Get_rank()
            coll = Collectives(comm, settings_for(sw, switch_silence=5.0), InaEngine)
            try:
                b, c = learned_pair(coll, r, count)
                with pytest.raises(TypeError, match="following must be a callable"):
                    coll.allreduce_flat(None, b.copy(), Op.SUM, following=c)
                errors, sums = [], []
                for following in (lambda: (None, c, Op.SUM),
                                  lambda: Following(None, c[::2], Op.SUM),
                                  lambda: Following(None, c, Op.SUM, value_bits=8),
                                  broken):
                    out = b.copy()
                    try:
                        coll.allreduce_flat(None, out, Op.SUM, following=following)
                    except Exception as exc:  # noqa: BLE001 - compared below
                        errors.append(f"{type(exc).__name__}: {exc}")
                    sums.append(out)
                after = coll.allreduce(c)
                return errors, sums, after, coll.offload.adopted()
            finally:
                coll.free()

        ranks = run_ranks(2, rank, timeout=60, kind=ThreadPeers)
    for errors, sums, after, adopted in ranks:
        assert [e.split(":")[0] for e in errors] == ["TypeError", "TypeError", "ValueError",
                                                     "LookupError"], errors
        assert "not the next call's arguments (Following)" in errors[0]
        assert "not 1-D contiguous NumPy arrays" in errors[1]
        assert "value_bits must be 0 (the job's), 32 or 16, got 8" in errors[2]
        assert "the next tensor is gone" in errors[3]
        for out in sums:
            assert out.tolist() == (np.arange(count) * 3.0).tolist()
        assert after.tolist() == (np.arange(2 * count) * 2 + 1.0).tolist()
        assert adopted is None
