"""collectives/recovery.py at 1-3 ranks in one process (tests/threadcomm.py): the neutral
part of the error path of a call that ended without a host collective. TROUBLE seen in
a gate, a gate nobody takes up, and ErrorPath: its gate and what a rank keeps (the
rescue itself is the offload's: tests/ina/test_rescue.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives.collectives.recovery import TROUBLE, ErrorPath, trouble
from ina_collectives.errors import CommunicatorBroken
from tests.threadcomm import run_ranks, timed_out


def test_trouble_is_a_gate_row_the_others_read_as_such():
    """Rank 1 could not finish its call: its row of the next gate (3 columns, as the
    others') says TROUBLE; the others' gate rows are theirs."""
    def rank(comm):
        if comm.Get_rank() == 1:
            trouble(comm, 3, 5.0, "switch call #7")
            return None
        rows = np.empty((3, 3), np.int64)
        comm.Iallgather(np.array([1, 4096, comm.Get_rank()], np.int64), rows).Wait()
        return rows[:, 0].tolist()

    got = run_ranks(3, rank)
    assert got[0] == got[2] == [1, TROUBLE, 1]


def test_trouble_that_nobody_takes_up_names_the_ranks_awaited():
    def rank(comm):
        if comm.Get_rank() == 0:
            trouble(comm, 2, 0.2, "switch call #7", background=True)

    assert timed_out(2, rank) == (
        "waited 0.2 s for all 2 ranks to take up the error path of switch call #7")


def test_the_error_path_refuses_trouble_where_the_next_collective_is_no_gate():
    def rank(comm):
        path = ErrorPath(comm, 1.0)
        assert not path.gated
        with pytest.raises(CommunicatorBroken) as refused:
            path.report("switch call #3")
        path.set_gate(lambda: 4)
        path.set_gate(None)
        assert not path.gated
        return str(refused.value)

    assert run_ranks(1, rank) == [
        "switch call #3 needs the error path, and the next collective is not a gate"]


def test_the_error_path_keeps_what_it_is_given_until_a_gate_passes():
    def rank(comm):
        path = ErrorPath(comm, 1.0)
        assert (path.kept, path.comm, path.seconds) == (None, comm, 1.0)
        path.keep(("call", 7))
        held = path.kept
        path.forget()
        return held, path.kept

    assert run_ranks(2, rank) == [(("call", 7), None)] * 2


def test_the_error_path_says_which_call_it_kept_and_which_it_reports(monkeypatch):
    """What the runtime's negotiation reads (runtime/negotiated.py: _meet_trouble): the
    offload's number of the call kept, and of the call whose TROUBLE this rank posts,
    set only while it waits in the gate."""
    from ina_collectives.collectives import recovery

    seen = []
    path = ErrorPath(comm=None, seconds=1.0)
    monkeypatch.setattr(recovery, "trouble",
                        lambda *args, **kwargs: seen.append(path.reporting))
    path.keep("window", 4)
    assert (path.kept, path.kept_call, path.reporting) == ("window", 4, None)
    path.forget()
    assert (path.kept, path.kept_call) == (None, None)
    path.set_gate(lambda: 3)
    path.report("switch call #5", 5)
    path.report("an opening")
    assert seen == [5, None] and path.reporting is None

    def failing(*args, **kwargs):
        raise TimeoutError("nobody came")
    monkeypatch.setattr(recovery, "trouble", failing)
    with pytest.raises(TimeoutError):
        path.report("switch call #6", 6)
    assert path.reporting is None
