"""ina/outcome.py at 2-4 ranks in one process (tests/threadcomm.py): the ranks' vote on a
switch-served call's outcome gives every rank the same Outcome, whatever each one saw of
its streams: a share failed anywhere is failed everywhere, the longest time and the
newest mode win, chunks lost in an ok share are repaired (a failed share is the ring's
instead), a NaN or an Inf met by any stream is everyone's; a rank that never votes ends
the others' waits naming the call and what this rank saw."""
from __future__ import annotations

import numpy as np

from ina_collectives._fast.transport import STATUS, Result
from ina_collectives.ina.outcome import Outcome, vote
from tests.threadcomm import run_ranks, timed_out

DONE, SILENT, TIMEOUT, LOST = 0, 1, 2, 5


def result(status=DONE, seconds=0.0, mode=0, missing=(), nonfinite=0, reason=""):
    made = Result(status, {"seconds": seconds, "nonfinite": nonfinite},
                  np.array(missing, np.int64), mode=mode)
    made.reason = reason or STATUS[status]
    return made


def voted(aggregators: int, served: list[int], results_by_rank: list[list[Result]],
          seconds: float = 5.0) -> list[Outcome]:
    return run_ranks(len(results_by_rank), lambda comm: vote(
        comm, aggregators, served, results_by_rank[comm.Get_rank()], seconds, "the call"))


def alike(outcomes: list[Outcome]) -> Outcome:
    """The one Outcome every rank got (compared field by field)."""
    first = outcomes[0]
    for other in outcomes[1:]:
        assert (other.failed, other.seconds.tolist(), other.mode, other.lost,
                other.nonfinite) == (first.failed, first.seconds.tolist(), first.mode,
                                     first.lost, first.nonfinite)
    return first


def test_a_clean_call_gives_every_rank_the_slowest_time_and_nothing_to_do():
    got = alike(voted(1, [0], [[result(seconds=0.25)], [result(seconds=0.5)],
                               [result(seconds=0.125)]]))
    assert (got.failed, got.lost, got.mode, got.nonfinite) == ([], [], 0, False)
    assert got.seconds.tolist() == [0.5]


def test_a_share_that_failed_on_one_rank_fails_on_every_rank_and_its_losses_are_the_rings():
    """Three aggregators, two serving (0 and 2): rank 1's share at 2 went silent, rank 0's
    share at 2 ended LOST with chunks missing. Aggregator 2 is failed everywhere and not
    among the lost (the ring takes its whole share); aggregator 1 served nothing: time 0."""
    rank0 = [result(seconds=1.0), result(LOST, seconds=2.0, missing=[3, 4])]
    rank1 = [result(seconds=1.5), result(SILENT, seconds=3.0, missing=[0, 1, 2, 3, 4])]
    got = alike(voted(3, [0, 2], [rank0, rank1]))
    assert got.failed == [2] and got.lost == []
    assert got.seconds.tolist() == [1.5, 0.0, 3.0]


def test_chunks_one_rank_lost_in_an_ok_share_are_to_be_repaired_by_every_rank():
    """A quorum call: rank 2 finished aggregator 1's share LOST (the others had moved two
    cells on); rank 0 and 1 finished it whole. Every rank learns aggregator 1's share has
    chunks to repair, and aggregator 0's none."""
    clean = [result(seconds=0.1), result(seconds=0.1)]
    lagging = [result(seconds=0.1), result(LOST, seconds=0.2, missing=[7, 9])]
    got = alike(voted(2, [0, 1], [clean, clean, lagging]))
    assert (got.failed, got.lost) == ([], [1])


def test_the_newest_mode_and_a_nonfinite_value_met_by_one_stream_reach_every_rank():
    """Rank 3's second share announced a mode of generation 2 (quorum 3); rank 1's first
    met a NaN past the first window. Modes are compared across ranks and aggregators."""
    by_rank = [[result(mode=1 << 8 | 2), result(mode=1 << 8 | 2)] for _ in range(4)]
    by_rank[3][1] = result(mode=2 << 8 | 3)
    by_rank[1][0] = result(nonfinite=1, mode=1 << 8 | 2)
    got = alike(voted(2, [0, 1], by_rank))
    assert got.mode == 2 << 8 | 3 and got.nonfinite
    assert (got.failed, got.lost) == ([], [])


def test_a_failed_status_of_any_kind_fails_the_share_and_a_lost_one_does_not():
    for status, failed in ((TIMEOUT, [0]), (3, [0]), (4, [0]), (LOST, [])):
        got = alike(voted(1, [0], [[result()], [result(status, missing=[0])]]))
        assert got.failed == failed, STATUS[status]
        assert got.lost == ([] if failed else [0]), STATUS[status]


def test_an_empty_call_votes_nothing_failed():
    got = alike(voted(2, [], [[], []]))
    assert (got.failed, got.lost, got.mode, got.nonfinite) == ([], [], 0, False)
    assert got.seconds.tolist() == [0.0, 0.0]


def test_a_rank_that_never_votes_ends_the_others_wait_naming_the_call_and_their_streams():
    def rank(comm):
        if comm.Get_rank() == 2:
            return None  # stopped before the vote
        mine = [result(reason="done here")] if comm.Get_rank() == 0 else []
        return vote(comm, 1, [0] if mine else [], mine, 0.3, "a 4096-byte allreduce")

    assert timed_out(3, rank) == (
        "waited 0.3 s for all ranks to report the outcome of a 4096-byte allreduce "
        "(this rank: done here)")


def test_a_rank_with_nothing_streamed_says_so_when_it_waits_in_vain():
    def rank(comm):
        if comm.Get_rank() == 1:
            return None
        return vote(comm, 1, [], [], 0.2, "call #3")

    assert timed_out(2, rank) == (
        "waited 0.2 s for all ranks to report the outcome of call #3 "
        "(this rank: nothing to stream)")
