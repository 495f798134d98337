"""ina/quorum.py: ``Quorum``, one job's mode on one rank. The k checked; each call's
number and stamp (sync where k is 0 or covers every rank, and for one call once a rank
was left out of every call of ``max_steps`` training steps); what a call's counted
workers tell (who was left out, who never counted, the counts); a mode the control
plane announced adopted at the next call; and, at 3 ranks in one process, every rank
changing mode at the same call when the mode comes through the outcome vote."""
from __future__ import annotations

import logging

import pytest

from ina_collectives._fast.transport import Result
from ina_collectives.ina.outcome import vote
from ina_collectives.ina.quorum import Quorum
from tests.threadcomm import run_ranks

ALL = -1  # every worker counted


@pytest.mark.parametrize("bad", [-1, 65, True, 2.0, "2", None])
def test_a_k_that_is_not_0_to_64_is_refused_naming_it(bad):
    with pytest.raises(ValueError) as refused:
        Quorum(4, 0, bad, 3)
    assert str(refused.value) == f"quorum must be an int 0 (sync) .. 64, got {bad!r}"
    q = Quorum(4, 0, 2, 3)
    with pytest.raises(ValueError, match=r"quorum must be an int 0 \(sync\) \.\. 64"):
        q.set(bad)
    assert q.k == 2  # unchanged


def test_calls_are_numbered_mod_65536_and_stamped_with_k_only_where_it_leaves_one_out():
    q = Quorum(4, 0, 3, 0)
    assert [q.next_call() for _ in range(2)] == [(1, 3), (2, 3)]
    q.calls = 65535
    assert q.next_call() == (0, 3)
    for k, stamp in ((0, 0), (4, 0), (5, 0), (1, 1)):
        q.set(k)
        assert q.next_call()[1] == stamp, k
    assert q.report()["mode"] == "quorum 1"
    q.set(4)
    assert (q.report()["mode"], q.report()["k"]) == ("sync", 4)  # k = n is sync


def test_a_call_some_ranks_are_absent_from_is_stamped_for_those_present():
    """The runtime ran ahead of rank 2 (present 0b011): in quorum mode the stamp is at
    most the ranks present; in sync mode, or with every rank named, it is 0 (an absent
    rank adds zeros); and an absent rank's left-outs are not counted toward the bound
    (the runtime bounds its absence)."""
    q = Quorum(3, 0, 2, 1)
    assert q.next_call(None, 0b011)[1] == 2
    q.after_call(0b011, 0b011, 0, 0, 0)
    assert q.steps.tolist() == [0, 0, 0]
    assert q.next_call(None, 0b111)[1] == 0
    q = Quorum(4, 0, 0, 1)                   # sync mode: every rank adds
    assert q.next_call(None, 0b0111)[1] == 0
    q = Quorum(4, 0, 2, 1)
    for key in "aa":                        # rank 3 left out twice while present
        q.next_call(key)
        q.after_call(0b0111, 0b0111, 0, 0, 0)
    assert q.next_call("a", 0b1011)[1] == 3  # at the bound: those present, all of them
    assert q.next_call("a")[1] == 0


def call(q: Quorum, key: object, left_out_rank_2: bool = True) -> int:
    """One call of ``key``: its stamp; rank 2 left out of it when it is a quorum call."""
    _, stamp = q.next_call(key)
    counted = 0b011 if stamp and left_out_rank_2 else 0b111
    q.after_call(counted, counted, 0, 4 if counted != 0b111 else 0, 0)
    return stamp


def test_a_rank_left_out_of_every_call_of_max_steps_steps_is_waited_for():
    """k 2 of 3, max_steps 2, three tensors a step (keys a, b, c): rank 2 is left out of
    every call. A step ends where a key repeats: the first step's calls count none, the
    second step's a ends the first (1), the third's a the second (2), so the call after
    it is sync; it counts every rank and quorum calls follow again."""
    q = Quorum(3, 2, 2, 2)
    stamps = [call(q, key) for key in "abcabcabcabcabc"]
    assert stamps == [2, 2, 2, 2, 2, 2, 2, 0, 2, 2, 2, 2, 2, 2, 2], stamps
    got = q.report()
    assert (got["quorum_calls"], got["waited_calls"], got["max_steps"]) == (14, 1, 2)
    assert q.steps.tolist() == [0, 0, 2]  # (the next call waits again)


def test_a_late_step_is_absorbed_and_a_counted_call_starts_the_count_again():
    """The default bound (3) absorbs a rank late for two steps: it is left out of every
    call of two steps and counted in the third; nothing waits for it."""
    q = Quorum(3, 0, 2, 3)
    stamps = [call(q, key) for key in "abab"]
    stamps += [call(q, key, left_out_rank_2=False) for key in "ab"]
    stamps += [call(q, key) for key in "abab"]
    assert stamps == [2] * 10 and q.waited_calls == 0
    assert q.steps.tolist() == [0, 0, 1]


def test_calls_that_never_repeat_still_end_a_step_every_step_calls():
    """A job whose calls never repeat: a step ends after STEP_CALLS calls, so a rank left
    out of all of them is still waited for once the bound is reached."""
    from ina_collectives.ina.quorum import STEP_CALLS

    q = Quorum(3, 0, 2, 1)
    stamps = [call(q, i) for i in range(STEP_CALLS + 2)]
    assert stamps[:STEP_CALLS + 1] == [2] * (STEP_CALLS + 1) and stamps[-1] == 0


def test_max_steps_0_never_waits():
    q = Quorum(3, 0, 2, 0)
    assert [call(q, "a") for _ in range(5)] == [2] * 5
    assert q.steps.tolist() == [0, 0, 4] and q.waited_calls == 0


def test_a_call_tells_who_was_left_out_and_who_never_counted():
    """Rank 1's view of a quorum call of 4: ranks 1 and 3 were left out of some chunk,
    rank 3 of every one (no result counted it)."""
    q = Quorum(4, 1, 2, 5)
    q.next_call()
    q.after_call(0b0101, 0b0111, 0, left_out=3, skipped=1)
    assert q.last == {"quorum": 2, "counted": False, "ranks_left_out": [1, 3],
                      "ranks_never_counted": [3], "chunks_left_out": 3,
                      "chunks_skipped": 1}
    assert q.steps.tolist() == [0, 0, 0, 0]  # (one step begun, none ended)
    report = q.report()
    assert (report["quorum_calls"], report["calls_left_out"]) == (1, 1)
    assert report["last_call"] == q.last and report["last_call"] is not q.last


def test_a_sync_call_leaves_nobody_out_whatever_its_bitmaps_say():
    """A sync call's failed share is the ring's (all count): even bitmaps lacking ranks
    name nobody, and every rank's count of calls left out starts again."""
    q = Quorum(3, 0, 0, 2)
    q.steps[:] = [1, 1, 1]
    q.next_call()
    q.after_call(0, 0, 0, 0, 0)
    assert q.last["ranks_left_out"] == [] and q.last["counted"]
    assert q.steps.tolist() == [0, 0, 0] and q.quorum_calls == 0


def test_a_mode_the_control_plane_announced_is_adopted_once_per_generation(caplog):
    caplog.set_level(logging.WARNING, logger="ina_collectives")
    q = Quorum(4, 0, 0, 3)
    q.next_call()
    q.after_call(ALL, ALL, 1 << 8 | 2, 0, 0)
    assert (q.k, q.generation, q.changes) == (2, 1, 1)
    assert q.next_call()[1] == 2  # in force from the next call
    q.after_call(ALL, ALL, 1 << 8 | 2, 0, 0)  # the same generation again: no change
    q.after_call(ALL, ALL, 0, 0, 0)  # results that announce nothing: no change
    assert (q.k, q.changes) == (2, 1)
    q.after_call(ALL, ALL, 2 << 8 | 0, 0, 0)
    q.after_call(ALL, ALL, 3 << 8 | 0, 0, 0)  # a new generation, the same k: said once
    q.after_call(ALL, ALL, 4 << 8 | 200, 0, 0)  # (past the workers a switch holds)
    assert (q.k, q.generation, q.changes) == (64, 4, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "the control plane asks for quorum 2 (mode generation 1): in force from the next call",
        "the control plane asks for sync (mode generation 2): in force from the next call",
        "the control plane asks for quorum 64 (mode generation 4): in force from the "
        "next call"]  # (200 announced: the most workers a switch holds is in force)
    assert q.report()["mode"] == "sync"  # 64 of 4


def test_every_rank_adopts_a_mode_one_rank_saw_at_the_same_call():
    """Three ranks in quorum 2; the second call's results announce quorum 1 of generation
    1 to rank 2 alone (the others' results predate it). The vote gives it to every rank:
    all three stamp the third call alike, and their reports agree but for the rank's own
    count (rank 2 is left out of every call)."""
    def rank(comm):
        r = comm.Get_rank()
        q = Quorum(3, r, 2, 0)
        stamps = []
        for call in range(3):
            number, stamp = q.next_call()
            stamps.append((number, stamp))
            mode = 1 << 8 | 1 if (call == 1 and r == 2) else 0
            outcome = vote(comm, 1, [0], [Result(0, {}, mode=mode)], 5.0, f"call {number}")
            q.after_call(0b011, 0b111, outcome.mode, 0, 0)
        return stamps, q.report()

    results = run_ranks(3, rank)
    for stamps, report in results:
        assert stamps == [(1, 2), (2, 2), (3, 1)]
        assert {k: report[k] for k in ("mode", "generation", "mode_changes", "quorum_calls")
                } == {"mode": "quorum 1", "generation": 1, "mode_changes": 1,
                      "quorum_calls": 3}
        assert report["last_call"]["ranks_left_out"] == [2]
        assert report["last_call"]["ranks_never_counted"] == []
    assert [r["calls_left_out"] for _, r in results] == [0, 0, 3]
