"""runtime/handle_group.py: the handles of one call waited on as one (every result in
order, or the first failure in order; every finished handle claimed, so that its name
is free again; a bound on the wait), its callback once all have finished, and a group
of allreduces through the background runtime at 2 ranks in one process."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ina_collectives.errors import AgreementError, CollectiveTimeout
from ina_collectives.runtime.background import Handle
from ina_collectives.runtime.handle_group import HandleGroup
from tests.runtime.test_background import on_runtimes, submit


def handles(n: int) -> tuple[list[Handle], list[int]]:
    """n handles, and the indices of those claimed, in the order they were."""
    made, claimed = [], []
    for i in range(n):
        h = Handle(None, {})
        h.on_claim = lambda i=i: claimed.append(i)
        made.append(h)
    return made, claimed


def finish_later(handle: Handle, seconds: float, result=None, error=None) -> None:
    threading.Timer(seconds, handle.finish, (result, error)).start()


def test_wait_returns_every_result_in_order_and_claims_each():
    hs, claimed = handles(3)
    for i, h in enumerate(hs):
        finish_later(h, 0.02 * (3 - i), result=i * 10)  # the last finishes first
    assert HandleGroup(hs, "three").wait(5) == [0, 10, 20]
    assert claimed == [0, 1, 2]


def test_the_first_failure_in_order_is_raised_after_every_handle_was_waited_on():
    hs, claimed = handles(4)
    hs[0].finish(1)
    hs[3].finish(error=ValueError("the last failed"))
    finish_later(hs[2], 0.05, error=AgreementError("ranks differ"))
    finish_later(hs[1], 0.1, result=2)
    group = HandleGroup(hs, "four")
    with pytest.raises(AgreementError, match="ranks differ"):
        group.wait(5)
    assert claimed == [0, 1, 2, 3] and group.done()
    assert isinstance(group.error(), AgreementError)
    assert group.results() == [1, 2, None, None]


def test_a_handle_that_timed_out_by_itself_is_its_own_failure_not_the_waits():
    hs, _ = handles(2)
    hs[0].finish(error=CollectiveTimeout("waited 3 s for all 2 ranks to enter x"))
    hs[1].finish(7)
    with pytest.raises(CollectiveTimeout, match="^waited 3 s for all 2 ranks to enter x$"):
        HandleGroup(hs, "x").wait(5)


def test_a_late_call_fails_within_the_bound_naming_it_and_waits_for_no_more():
    hs, claimed = handles(4)
    hs[0].finish(0)
    hs[2].finish(2)  # finished after the late one: claimed without waiting
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"^waited 0.2 s for allreduce 'g'$"):
        HandleGroup(hs, "allreduce 'g'").wait(0.2)
    assert time.monotonic() - start < 1.0  # not once more for the fourth
    assert claimed == [0, 2]


def test_the_bound_is_checked():
    with pytest.raises(ValueError, match="the bound must be 0 or more"):
        HandleGroup(handles(1)[0], "x").wait(-1)


def test_the_callback_runs_once_after_the_last_with_every_handle_claimed():
    hs, claimed = handles(3)
    hs[1].finish(1)
    seen = []
    ran = threading.Event()

    def callback(group: HandleGroup) -> None:
        seen.append((list(claimed), group.results(), threading.current_thread().name))
        ran.set()

    group = HandleGroup(hs, "three")
    group.add_done_callback(callback)
    threads = [threading.Thread(target=h.finish, args=(i,), name=f"finisher-{i}")
               for i, h in [(0, hs[0]), (2, hs[2])]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert ran.wait(5)
    assert len(seen) == 1, seen
    assert seen[0][0] == [0, 1, 2] and seen[0][1] == [0, 1, 2]
    assert seen[0][2].startswith("finisher-")


def test_the_callback_of_a_finished_or_empty_group_runs_at_once():
    hs, _ = handles(2)
    for h in hs:
        h.finish(error=OSError("gone"))
    seen = []
    HandleGroup(hs, "two").add_done_callback(lambda g: seen.append(str(g.error())))
    HandleGroup([], "none").add_done_callback(lambda g: seen.append(g.results()))
    assert seen == ["gone", []]


def test_a_group_of_allreduces_through_the_runtime_frees_its_names():
    """At 2 ranks: three allreduces as one call; once the group's callback has run, the
    names are free, and the same names go again at once."""
    def body(runtime, r):
        def start():
            return HandleGroup([submit(runtime, f"g.{i}", np.full(3 + i, r + i, np.float32))
                                for i in range(3)], "allreduce group")
        called = threading.Event()
        first = start()
        first.add_done_callback(lambda g: called.set())
        assert called.wait(runtime.wait_seconds())
        again = start().wait(runtime.wait_seconds())
        return first.results(), again

    for first, again in on_runtimes(2, body):
        for got in (first, again):
            assert [g.tolist() for g in got] == [[float(2 * i + 1)] * (3 + i)
                                                 for i in range(3)]
