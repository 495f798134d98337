"""Calls back to back on a link (docs/protocol.md, Calls back to back): the next call is
adopted while the running one's last window drains, each slot taking the next call's
first chunk as soon as its last result of the running call is back. Workers of a job
joined by hand, their streams in threads as the ranks run them in processes, through
the software switch."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina.link import WorkerLink
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

    def stream(self, link: WorkerLink, on_drain=None):
        return link.stream(self.x, self.out, self.local, self.agreed, False, TIMERS, 30.0,
                           call=self.number, ident=IDENT + self.number, learn=self.learn,
                           on_drain=on_drain)

    def adopt(self, link: WorkerLink) -> None:
        link.adopt(self.x, self.out, self.local, self.agreed, False, TIMERS, 30.0,
                   call=self.number, ident=IDENT + self.number, learn=self.learn)


def exact(xs: list[np.ndarray], out: np.ndarray) -> None:
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    np.testing.assert_allclose(out, total, rtol=0, atol=np.abs(total).max() * 1e-6)


@pytest.mark.parametrize("chunks", [(7, 5, 9, 4), (3, 7, 3, 4), (9, 4, 6, 5)])
def test_calls_adopted_in_each_drain_sum_alike_and_start_before_the_last_returns(
        job, chunks):
    """Four calls in a row, each adopted in the drain of the one before (one call of the
    second row is shorter than the window, so a slot is free at once; the third row's
    second call overflows its prediction on one worker). Every sum is exact on every
    worker, every call after the first says it was adopted, and each was adopted before
    the call before it returned, whose return found the adopted call's whole first window
    sent already (the switch counted those packets)."""
    sw, links = job
    overflow = chunks == (9, 4, 6, 5)
    xs = [call_inputs(c, seed) for seed, c in enumerate(chunks)]
    firsts = [window_max(x, c) for x, c in zip(xs, chunks)]
    if overflow:
        xs[1][2][K:2 * K] *= 64  # (worker 2's chunk 1 of call 2: over its prediction)
    calls = [[Call(xs[i][w], firsts[i], i + 1) for i in range(len(chunks))]
             for w in range(N)]
    adopted_at = np.zeros((N, len(chunks)))
    returned_at = np.zeros((N, len(chunks)))
    results: list[list] = [[None] * len(chunks) for _ in range(N)]
    barrier = threading.Barrier(N)
    packets: list[int] = []

    def one(w: int) -> None:
        link, mine = links[w], calls[w]

        def adopter(i: int):
            def on_drain() -> None:
                adopted_at[w, i] = time.monotonic()
                mine[i].adopt(link)
            return on_drain

        for i in range(len(chunks)):
            then = adopter(i + 1) if i + 1 < len(chunks) else None
            results[w][i] = (mine[i].stream(link, then) if i == 0
                             else link.resume(then))
            returned_at[w, i] = time.monotonic()
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
            if i:
                assert adopted_at[w, i] < returned_at[w, i - 1]
        assert not links[w].adopted
    overflows = [results[w][1].counters["overflows"] for w in range(N)]
    assert overflows == ([1] * N if overflow else [0] * N)
    assert sw.stats()["openings"] == 0
    assert len({tuple(link.wire.versions) for link in links}) == 1  # moved on alike


def test_a_drain_that_raises_ends_the_stream_with_its_error_and_adopts_nothing(job):
    """What ``on_drain`` raises (a bug, or Ctrl-C there) is raised by the stream, and
    the link holds no adopted call after."""
    _, links = job
    xs = call_inputs(6, 0)
    first = window_max(xs, 6)
    errors: list = [None] * N

    def one(w: int) -> None:
        def on_drain() -> None:
            Call(xs[w], first, 2).adopt(links[w])
            raise ValueError(f"worker {w}'s drain")
        try:
            Call(xs[w], first, 1).stream(links[w], on_drain)
        except ValueError as exc:
            errors[w] = str(exc)

    per_worker(N, one)
    assert errors == [f"worker {w}'s drain" for w in range(N)]
    assert [link.adopted for link in links] == [False] * N


def test_a_link_with_an_adopted_call_refuses_another_until_it_is_resumed_or_abandoned(
        job):
    _, links = job
    link = links[0]
    x = call_inputs(3, 1)[0]
    call = Call(x, window_max([x], 3), 1)
    call.adopt(link)  # (between calls: its first window goes at once)
    assert link.adopted
    with pytest.raises(RuntimeError, match="a call is adopted on this link"):
        call.stream(link)
    with pytest.raises(RuntimeError, match="adopted on this link already"):
        call.adopt(link)
    with pytest.raises(RuntimeError, match="resume or abandon it first"):
        link.opening(IDENT, np.zeros((S, G), np.int16), 1, TIMERS, 1.0)
    assert link.abandon() and not link.adopted and not link.abandon()
    with pytest.raises(RuntimeError, match="no call is adopted"):
        link.resume()
    empty = np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="an empty call is not adopted"):
        link.adopt(empty, empty.copy(), np.zeros(0, np.int16), np.zeros(0, np.int16),
                   False, TIMERS, 1.0)
