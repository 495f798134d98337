"""tests/integration/mpirun.py's ``several``, in one process: the rank function by which
one job runs several cases (each with its settings), and how a test reads a case's
result (a failed case is named)."""
from __future__ import annotations

import os

import pytest

from tests.integration import mpirun, rank_cases


def seen_setting(comm, params):
    return {"switch": os.environ.get("INA_SWITCH"), "rank": comm, **params}


def fails(comm, params):
    raise RuntimeError("on purpose")


def leaves_messages(comm, params):
    return {"abandoned": True}


def test_cases_run_in_turn_each_with_its_own_environment(monkeypatch):
    monkeypatch.delenv("INA_SWITCH", raising=False)
    params = mpirun.cases(("with", seen_setting, {"x": 1}, {"INA_SWITCH": "127.0.0.1:1"}),
                          ("without", seen_setting, None))
    out = mpirun.several(5, params)
    assert out == {"with": {"switch": "127.0.0.1:1", "rank": 5, "x": 1},
                   "without": {"switch": None, "rank": 5}}
    assert "INA_SWITCH" not in os.environ   # put back as it was
    assert mpirun.case_result(out, "with") == out["with"]


def test_a_case_that_raises_is_named_and_the_cases_after_it_are_not_run():
    out = mpirun.several(0, mpirun.cases(("first", seen_setting, None),
                                         ("broken", fails, None),
                                         ("after", seen_setting, None)))
    assert mpirun.case_result(out, "first", 0)["rank"] == 0
    with pytest.raises(AssertionError, match=r"case 'broken' on rank 3 failed: on purpose"):
        mpirun.case_result(out, "broken", 3)
    with pytest.raises(AssertionError, match=r"case 'after' .*case 'broken' of the same job"):
        mpirun.case_result(out, "after")


def test_an_abandoning_case_marks_the_job_and_names_are_unique():
    out = mpirun.several(0, mpirun.cases(("ok", seen_setting, None),
                                         ("last", leaves_messages, None)))
    assert out["abandoned"] is True
    with pytest.raises(ValueError, match="share a name"):
        mpirun.cases(("same", seen_setting, None), ("same", fails, None))
    with pytest.raises(ValueError, match="module-level function"):
        mpirun.cases(("lambda", lambda comm, p: None, None))


@pytest.mark.mpi
def test_a_job_killed_for_time_leaves_each_ranks_waits_and_stacks():
    """A job past its bound: before the kill, each rank is asked (SIGUSR2) and prints what
    it waits for, named, and every thread's Python stack, even one blocked inside MPI."""
    with pytest.raises(mpirun.JobFailed) as failed:
        mpirun.run(2, rank_cases.stuck_in_a_wait, {}, timeout=8)
    text = str(failed.value)
    assert "did not finish in 8 s" in text, text
    assert "rank 0 (pid" in text and "waiting" in text and "tag 99 (never sent)" in text, text
    assert text.count("most recent call first") >= 2, text  # faulthandler, both ranks
    assert "stuck_in_a_wait" in text, text
