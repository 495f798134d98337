"""ina/rescue.py at 2-4 ranks in one process (tests/threadcomm.py): the rescue of a call
the switch served without a vote. Its outcomes by the ranks' roles (a window sent by the
lowest rank that kept it, every rank still in the call and so to the ring, only openings
failed and so a restart, a window nobody kept), and the faults: a rank that stops before
the rescue or after saying what it holds, a result lost on one rank (the whole path,
over the communicator's ErrorPath)."""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives.collectives.recovery import TROUBLE, ErrorPath
from ina_collectives.errors import CommunicatorBroken
from ina_collectives.ina.rescue import Holding, Kept, Rescue, Role, rescue, stand_by, take_part
from tests.threadcomm import RankFailed, run_ranks, timed_out

CLEAN, FAILED, NAN_OR_INF, OPENING = Role.CLEAN, Role.FAILED, Role.NAN_OR_INF, Role.OPENING
CALL, START = 7, 40


def window(call: int = CALL, aggregator: int = 0) -> Kept:
    """A kept last window of call ``call``: elements 40..47, 1.5 each."""
    return Kept(call, aggregator, START, np.full(8, 1.5, np.float32))


def rescued(roles: list[tuple], seconds: float = 5.0) -> list[Rescue]:
    """rescue() on each rank with its (role, call, kept[, opening[, seq]])."""
    def rank(comm):
        role, call, kept, *rest = roles[comm.Get_rank()]
        opening = rest[0] if rest else -1
        seq = rest[1] if len(rest) > 1 else 0
        return rescue(comm, Holding(role, call, kept, opening, seq), seconds, "switch call #7")
    return run_ranks(len(roles), rank)


def test_a_rank_that_lost_results_gets_the_window_of_the_lowest_rank_that_kept_it():
    """Rank 1's stream failed; ranks 0, 2 and 3 finished call 7. Rank 0 sends its window;
    rank 1 alone gets the values (in its output's dtype); nobody goes to the ring."""
    got = rescued([(CLEAN, -1, window()), (FAILED, CALL, None),
                   (CLEAN, -1, window()), (CLEAN, -1, window())])
    for r, res in enumerate(got):
        assert (res.to_ring, res.failed, res.holder, res.restart) == (False, [1], 0, False)
        assert res.start == START
        assert (res.values is None) == (r != 1), r
    assert got[1].values.dtype == np.float32 and got[1].values.tolist() == [1.5] * 8


def test_the_window_comes_from_a_rank_that_kept_this_call_not_an_earlier_one():
    """Rank 0 kept call 6's window (it is one call behind in its bookkeeping), rank 2 call
    7's: rank 2 sends, and every rank receives in the type of the window it sends (rank
    0 once received into float64, whatever the root sent: MPI's type signatures
    differed). Two ranks failed: both get the window."""
    got = rescued([(CLEAN, -1, window(6)), (FAILED, CALL, None),
                   (CLEAN, -1, window()), (FAILED, CALL, None)])
    assert {(r.holder, tuple(r.failed)) for r in got} == {(2, (1, 3))}
    for r in (1, 3):
        assert got[r].values.dtype == np.float32 and got[r].values.tolist() == [1.5] * 8


def test_every_rank_still_in_the_call_hands_it_to_the_ring():
    for roles, failed in (([FAILED] * 3, [0, 1, 2]), ([NAN_OR_INF] * 3, []),
                          ([FAILED, NAN_OR_INF, FAILED], [0, 2])):
        got = rescued([(role, CALL, None) for role in roles])
        for res in got:
            assert (res.to_ring, res.failed, res.values, res.holder, res.restart) == (
                True, failed, None, None, False), roles


def test_a_rank_that_was_opening_the_call_the_others_are_in_stands_in_for_one_still_in_it():
    """Ranks 0 and 1 failed call 7; rank 2 finished call 6 and could not open call 7 (its
    opening number): nobody returned from call 7, so it goes to the ring."""
    got = rescued([(FAILED, CALL, None),
                   (FAILED, CALL, None),
                   (OPENING, -1, window(6), CALL)])
    for res in got:
        assert (res.to_ring, res.failed, res.restart) == (True, [0, 1, 2], False)


def test_an_opening_rank_that_finished_the_call_sends_its_window_and_then_starts_again():
    """Rank 0 finished call 7, kept its window and could not open call 8; rank 1's call 7
    failed. Rank 0 sends, rank 1 completes call 7; rank 0 starts its call 8 again."""
    got = rescued([(OPENING, -1, window(), CALL + 1),
                   (FAILED, CALL, None)])
    assert [(r.holder, r.failed, r.to_ring) for r in got] == [(0, [0, 1], False)] * 2
    assert [r.restart for r in got] == [True, False]
    assert got[1].values.tolist() == [1.5] * 8 and got[0].values is None


def test_only_openings_failed_every_rank_starts_again_at_the_largest_call_number():
    got = rescued([(OPENING, -1, window(), 8, 11), (CLEAN, -1, window(), -1, 12),
                   (OPENING, -1, None, 8, 10)])
    for res in got:
        assert (res.restart, res.to_ring, res.failed, res.values, res.holder) == (
            True, False, [0, 2], None, None)
        assert res.seq == 12


def test_a_nan_or_inf_beside_ranks_that_finished_is_a_broken_communicator_naming_the_roles():
    """A rank that finished the call saw every result, so none can have seen a NaN that
    another saw: the protocol does not allow it, and every rank says so alike."""
    with pytest.raises(RankFailed) as broken:
        rescued([(CLEAN, -1, window()), (NAN_OR_INF, CALL, None)])
    assert isinstance(broken.value.__cause__, CommunicatorBroken)
    assert str(broken.value.__cause__) == (
        "ranks [1] could not finish switch call #7 and no rank keeps its last window "
        "(roles [0, 2], calls [7, 7])")


def test_a_failed_rank_whose_call_no_rank_kept_is_a_broken_communicator():
    with pytest.raises(RankFailed) as broken:
        rescued([(CLEAN, -1, window(6)), (FAILED, CALL, None),
                 (CLEAN, -1, None)])
    assert str(broken.value.__cause__) == (
        "ranks [1] could not finish switch call #7 and no rank keeps its last window "
        "(roles [0, 1, 0], calls [6, 7, -1])")


def test_a_rank_that_never_takes_up_the_rescue_is_named_by_the_others_wait():
    def rank(comm):
        if comm.Get_rank() == 0:
            return None  # stopped
        return rescue(comm, Holding(FAILED, CALL), 0.3, "switch call #7")

    assert timed_out(3, rank) == (
        "waited 0.3 s for every rank to say what it holds of switch call #7, which a rank "
        "could not finish alone (this rank: its stream failed)")


def test_a_holder_that_stops_after_saying_what_it_holds_is_named_with_the_window_awaited():
    """Rank 0 said it keeps call 7's window (8 values), then stopped before sending it:
    rank 1, which lost its results, names the window it waited for."""
    def rank(comm):
        if comm.Get_rank() == 0:
            row = np.array([CLEAN, CALL, START, 8, -1, 0, ord("f"), 0], np.int64)
            comm.Iallgather(row, np.empty((2, 8), np.int64)).Wait()
            return None  # stopped before the broadcast
        return rescue(comm, Holding(FAILED, CALL), 0.3, "switch call #7")

    assert timed_out(2, rank) == (
        "waited 0.3 s for rank 0's last window of switch call #7 (8 values)")



def test_a_result_lost_on_one_rank_is_completed_from_a_peers_kept_window():
    """The whole path at 3 ranks: each rank finished call 7 but rank 2, whose last
    results were lost (the switch died after the others returned). Ranks 0 and 1 keep
    their window; at the next gate (4 columns) rank 2 reports TROUBLE, ranks 0 and 1 see
    it and help; rank 2 completes its output from rank 0's window. Every rank forgets its
    kept window, and rank 0 and 1 return theirs with what every rank learned."""
    size = 48

    def rank(comm):
        r = comm.Get_rank()
        path = ErrorPath(comm, 5.0)
        path.set_gate(lambda: 4)
        out = np.arange(size, dtype=np.float32)
        if r == 2:
            out[START + 3:] = 0  # lost
            path.report("switch call #7")
            got = take_part(path, FAILED, CALL, "switch call #7", seq=9)
            out[got.start:] = got.values
            return out, got, path.kept
        path.keep(Kept(CALL, 0, START, out[START:].copy()))
        rows = np.empty((3, 4), np.int64)
        comm.Iallgather(np.array([1, size * 4, 0, 0], np.int64), rows).Wait()
        assert (rows[:, 0] == TROUBLE).tolist() == [False, False, True]
        got, kept = stand_by(path, "switch call #7", seq=9 + r)
        assert kept.call == CALL and kept.values.tolist() == out[START:].tolist()
        return out, got, path.kept

    results = run_ranks(3, rank)
    whole = np.arange(size, dtype=np.float32).tolist()
    for r, (out, got, kept) in enumerate(results):
        assert out.tolist() == whole, r
        assert kept is None, r
        assert (got.holder, got.failed, got.to_ring, got.seq) == (0, [2], False, 10)


def test_a_role_that_is_none_is_refused_before_any_rank_waits():
    def rank(comm):
        with pytest.raises(ValueError, match="7 is not a valid Role"):
            rescue(comm, Holding(7, CALL), 1.0, "switch call #7")
        return True

    assert run_ranks(1, rank) == [True]


def test_every_rank_numbers_the_next_switch_call_from_the_largest_count_of_theirs():
    """Rank 0's opening of a call failed (it numbered one switch call fewer); rank 1's
    opening of it succeeded and its stream then failed. Both learn the larger count, so
    that the next switch call has the same number on both (the switch compares numbers:
    unequal ones read as ranks that called differently, a false AgreementError that a
    chaos soak found after a stopped rank)."""
    def rank(comm):
        if comm.Get_rank() == 0:
            return rescue(comm, Holding(OPENING, -1, None, CALL, 3, switch_calls=CALL - 1),
                          5.0, "switch call #7")
        return rescue(comm, Holding(FAILED, CALL, None, CALL, 3, switch_calls=CALL), 5.0,
                      "switch call #7")
    for res in run_ranks(2, rank):
        assert res.switch_calls == CALL and res.to_ring
