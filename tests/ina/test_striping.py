"""ina/striping.py without sockets: ``Shares`` (a call's chunks split in proportion to
each aggregator's measured throughput, with a floor; estimates smoothed, forgotten when
an aggregator leaves, and alike on every rank when they come from the vote), and
``Streams`` over links that stand in for WorkerLink.stream (each share its slices of the
call, the first in the calling thread and the others at once in threads of their own,
an error or a stream past its bound cancelling the others)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ina_collectives._fast.transport import Result
from ina_collectives.collectives.waiting import Deadline
from ina_collectives.errors import CollectiveTimeout
from ina_collectives.ina.outcome import vote
from ina_collectives.ina.plan import CallPlan
from ina_collectives.ina.preparing import Prepared, Share
from ina_collectives.ina.striping import Shares, Streams
from ina_collectives.settings import Settings
from tests.threadcomm import run_ranks

# -- Shares ------------------------------------------------------------------------------


def test_one_serving_aggregator_takes_the_whole_call_whatever_was_measured():
    shares = Shares(3)
    shares.capacity[:] = [0, 5e8, 1e3]
    assert shares.split([2], 17).tolist() == [0, 17]


def test_shares_are_equal_until_measured_then_follow_the_throughput():
    shares = Shares(3)
    serving = [0, 1]  # the third aggregator is not serving
    assert shares.split(serving, 10).tolist() == [0, 5, 10]
    shares.capacity[:] = [3e8, 1e8, 5e8]
    assert shares.split(serving, 100).tolist() == [0, 75, 100]  # 3:1, the third ignored
    assert shares.split([0, 1, 2], 90).tolist() == [0, 30, 40, 90]  # 3:1:5


def test_a_slow_aggregator_keeps_a_floor_share_so_it_keeps_being_measured():
    """MIN_SHARE of an equal share (0.125 of 1000 chunks at two aggregators) before the
    shares are scaled back to the whole: 1000 * 0.125 / 1.125 = 111 chunks."""
    shares = Shares(2)
    shares.capacity[:] = [1e9, 1e6]
    edges = shares.split([0, 1], 1000)
    assert edges.tolist() == [0, 889, 1000]


def test_an_aggregator_not_measured_yet_gets_the_mean_of_the_measured_ones():
    """Aggregator 1 came back (forgotten when it left): it is given the mean of the
    others' estimates, not nothing, until a call measures it."""
    shares = Shares(3)
    shares.capacity[:] = [2e8, 7e8, 4e8]
    shares.forget(1)
    assert shares.capacity.tolist() == [2e8, 0.0, 4e8]
    assert shares.split([0, 1, 2], 90).tolist() == [0, 20, 50, 90]  # 2:3:4


def test_the_topologys_rates_split_a_call_until_the_trees_are_measured():
    """Trees rooted at 300 and 100 Mbit/s (the file's mbit): 3:1 before any call measured
    them; once one is measured, the other is given its rate scaled by the measured one's
    (the units differ); measured, the measurements alone."""
    shares = Shares(2, (300.0, 100.0))
    assert shares.split([0, 1], 100).tolist() == [0, 75, 100]
    shares.capacity[:] = [6e8, 0.0]           # tree 0 measured: tree 1 gets 6e8 / 3
    assert shares.split([0, 1], 100).tolist() == [0, 75, 100]
    shares.capacity[:] = [6e8, 6e8]           # both measured alike: halves
    assert shares.split([0, 1], 100).tolist() == [0, 50, 100]
    shares.forget(1)                           # tree 1 left and came back: its prior again
    assert shares.split([0, 1], 100).tolist() == [0, 75, 100]
    with pytest.raises(ValueError, match="2 prior rates for 3 aggregators"):
        Shares(3, (1.0, 2.0))


def test_the_edges_cover_the_call_in_order_even_with_fewer_chunks_than_aggregators():
    shares = Shares(4)
    shares.capacity[:] = [1e9, 1e7, 3e8, 2e9]
    for chunks in (0, 1, 2, 3, 7, 1001):
        edges = shares.split([0, 1, 2, 3], chunks)
        assert edges[0] == 0 and edges[-1] == chunks, edges
        assert (np.diff(edges) >= 0).all(), edges


def test_measurements_are_smoothed_and_a_lost_aggregator_is_measured_anew():
    shares = Shares(2)
    shares.measured(0, 1_000_000, 0.01)  # the first measurement is taken as it is
    assert shares.capacity[0] == 1e8
    shares.measured(0, 1_000_000, 0.005)  # then half the new, half the old
    assert shares.capacity[0] == pytest.approx(1.5e8)
    shares.forget(0)
    shares.measured(0, 1_000_000, 0.02)
    assert shares.capacity.tolist() == [5e7, 0.0]


def test_every_rank_splits_alike_when_its_estimates_come_from_the_vote():
    """Three ranks time their two shares differently; the vote gives each the slowest
    rank's times, so after two calls every rank holds the same estimates and the same
    split (the split is local: ranks that split differently would stream different
    chunks through each aggregator)."""
    def rank(comm):
        r, shares = comm.Get_rank(), Shares(2)
        for call in range(2):
            times = [0.01 * (r + 1) * (call + 1), 0.03 + 0.001 * r]
            results = [Result(0, {"seconds": t}) for t in times]
            outcome = vote(comm, 2, [0, 1], results, 5.0, f"call {call}")
            for i in (0, 1):
                shares.measured(i, 1_000_000, float(outcome.seconds[i]))
        return shares.capacity.tolist(), shares.split([0, 1], 1000).tolist()

    results = run_ranks(3, rank)
    assert all(got == results[0] for got in results), results
    capacity, edges = results[0]
    # the slowest rank's times: 0.03 then 0.06 at aggregator 0, 0.032 twice at 1
    assert capacity == pytest.approx([0.5 * 1e6 / 0.06 + 0.5 * 1e6 / 0.03, 1e6 / 0.032])
    assert edges == [0, 444, 1000]  # 25e6 : 31.25e6 elements/s


# -- Streams -----------------------------------------------------------------------------

K, G = 4, 1


class FakeLink:
    """WorkerLink.stream's arguments and effect: writes its slice of x times ``times``
    into its slice of out and returns a Result; ``wait`` seconds first (ending early,
    cancelled, when the cancel flag is set), or raise ``error``."""

    def __init__(self, times: float = 2.0, wait: float = 0.0, error: Exception | None = None,
                 heed_cancel: bool = True):
        self.times, self.wait, self.error, self.heed = times, wait, error, heed_cancel
        self.calls: list[dict] = []

    def stream(self, plan, timers, deadline, cancel=None, then=None, pause=False):
        x, into = plan.x, plan.out
        self.calls.append({"thread": threading.current_thread().name, "size": x.size,
                           "deadline": deadline, "bits": plan.value_bits, "call": plan.call,
                           "quorum": plan.quorum, "ready": plan.ready,
                           "average": plan.average,
                           "exponents": (plan.local.size, plan.agreed.size)})
        end = time.monotonic() + self.wait
        while time.monotonic() < end:
            if self.heed and cancel[0]:
                return said(Result(4, {}), "cancelled")
            time.sleep(0.005)
        if self.error is not None:
            raise self.error
        into[:] = x * self.times
        return said(Result(0, {"seconds": self.wait}), "done")


def said(result: Result, reason: str) -> Result:
    """``result`` with the words WorkerLink would fill in."""
    result.reason = reason
    return result


def prepared(edges: list[int], size: int) -> Prepared:
    x = np.arange(size, dtype=np.float32)
    chunks = -(-size // K)
    shares = [Share(i, a, b, ready=1) for i, (a, b) in enumerate(zip(edges, edges[1:]))
              if b > a]
    return Prepared(x, np.float32, K, G, shares, np.zeros(chunks * G, np.int16),
                    np.zeros(1, np.int16), False)


@pytest.fixture
def streams():
    made = Streams(3, Settings(switch_silence=0.1), lambda i: f"10.0.0.{i + 1}:5000")
    yield made
    made.close()


def test_each_share_streams_its_own_slices_the_first_in_the_calling_thread(streams):
    links = [FakeLink(2.0), FakeLink(3.0), FakeLink(4.0)]
    call = prepared([0, 2, 3, 5], 5 * K - 1)  # the last chunk short
    out = np.zeros(call.x.size, np.float32)
    results = streams.run(links, CallPlan(call, out, call.agreed(np.zeros(1, np.int16)),
                                          Deadline(5.0), True, 16, 7, 2))
    assert [r.reason for r in results] == ["done"] * 3
    want = np.concatenate([call.x[:8] * 2, call.x[8:12] * 3, call.x[12:] * 4])
    assert out.tolist() == want.tolist()
    assert [c["size"] for link in links for c in link.calls] == [8, 4, 7]
    assert [c["exponents"] for link in links for c in link.calls] == [(2, 2), (1, 1), (2, 2)]
    assert links[0].calls[0]["thread"] == threading.current_thread().name
    assert all(link.calls[0]["thread"].startswith("ina-stripe") for link in links[1:])
    for link in links:
        c = link.calls[0]
        assert (c["bits"], c["call"], c["quorum"], c["ready"], c["average"]) == (
            16, 7, 2, 1, True)
        assert 4.0 < c["deadline"] <= 5.0


def test_the_shares_stream_at_once(streams):
    links = [FakeLink(wait=0.3), FakeLink(wait=0.3), FakeLink(wait=0.3)]
    call = prepared([0, 1, 2, 3], 3 * K)
    start = time.monotonic()
    streams.run(links, CallPlan(call, np.zeros(3 * K, np.float32), np.zeros(3, np.int16),
                                Deadline(5.0), value_bits=32))
    assert time.monotonic() - start < 0.75  # not 0.9 s: one after another


def test_a_call_with_no_share_streams_nothing_and_one_share_starts_no_thread(streams):
    assert streams.run([], CallPlan(prepared([0], 0), np.zeros(0, np.float32),
                                    np.zeros(0, np.int16), Deadline(1.0))) == []
    link = FakeLink()
    call = prepared([0, 3], 3 * K)
    (result,) = streams.run([link], CallPlan(call, np.zeros(3 * K, np.float32),
                                             np.zeros(3, np.int16), Deadline(1.0)))
    assert result.ok and streams._threads is None


def test_an_error_in_one_stream_cancels_the_others_and_propagates(streams):
    slow = [FakeLink(wait=10.0), FakeLink(wait=10.0)]
    links = [FakeLink(wait=0.1, error=KeyboardInterrupt()), *slow]
    call = prepared([0, 1, 2, 3], 3 * K)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        streams.run(links, CallPlan(call, np.zeros(3 * K, np.float32),
                                    np.zeros(3, np.int16), Deadline(20.0)))
    assert time.monotonic() - start < 2.0  # the others ended when cancelled
    assert all(len(link.calls) == 1 for link in slow)


def test_a_stream_past_its_bound_is_a_timeout_naming_its_aggregator(streams, monkeypatch,
                                                                    caplog):
    """The streams' own bounds failed (a stream that ignores them and its cancel flag):
    the call gives up after its deadline, the silence bound and CANCEL_BOUND, naming the
    aggregator, and says that a stream did not end when cancelled."""
    monkeypatch.setattr(Streams, "CANCEL_BOUND", 0.2)
    links = [FakeLink(), FakeLink(), FakeLink(wait=1.0, heed_cancel=False)]
    call = prepared([0, 1, 2, 3], 3 * K)
    with pytest.raises(CollectiveTimeout) as timed_out:
        streams.run(links, CallPlan(call, np.zeros(3 * K, np.float32),
                                    np.zeros(3, np.int16), Deadline(0.2)))
    bound = str(timed_out.value).split()[1]
    assert 0.45 < float(bound) <= 0.5, timed_out.value
    assert str(timed_out.value) == (f"waited {bound} s for the stream of a share through "
                                    f"the aggregator at 10.0.0.3:5000")
    assert ["1 stream(s) of a striped call did not end within 0.2 s of being cancelled"] == [
        r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
