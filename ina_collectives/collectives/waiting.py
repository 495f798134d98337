"""Bounded waits on MPI requests: every wait has a deadline and says what it waited for."""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

from mpi4py import MPI

from ..errors import CollectiveTimeout

# Under ina-run, the mark it leaves in the rank's run folder when a rank failed
# (launch/ranks.py: RankWatch): a wait that finds it gives up at once, naming the rank,
# instead of at its deadline. Set at init (watch_run), from the settings' run_dir.
_run_failed: str | None = None
_next_look = 0.0


def watch_run(run_dir: str) -> None:
    """Look for ina-run's mark of a failed rank in ``run_dir`` (settings.run_dir: ina-run
    sets it for each rank; empty: none to look for). The process's ranks share one."""
    global _run_failed
    _run_failed = os.path.join(run_dir, "failed") if run_dir else None
    if run_dir:  # and an exception that ends this rank is recorded there as it is raised
        from ..launch.rank import record_raises
        record_raises(run_dir)


def peer_failure() -> str | None:
    """ina-run's word that a rank of this job failed, or None; looks at most every 0.1 s."""
    global _next_look
    if _run_failed is None:
        return None
    now = time.monotonic()
    if now < _next_look:
        return None
    _next_look = now + 0.1
    try:
        with open(_run_failed) as f:
            return f.read().strip() or "ina-run: a rank failed"
    except OSError:
        return None


class Deadline:
    """The moment by which one collective call must finish."""

    __slots__ = ("seconds", "expires")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expires = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() >= self.expires


def wait(request: MPI.Request, deadline: Deadline, what: Callable[[], str],
         background: bool = False) -> None:
    """Complete ``request`` or raise CollectiveTimeout with ``what()`` in the message.

    Polls with Test (which drives MPI's progress engine, as Wait would) and yields the
    core between polls: ranks are often oversubscribed, and a spinning rank would starve
    the peer it waits for. The Python loop also lets Ctrl-C interrupt a wait.
    ``background``: sleep between polls (backing off to 0.5 ms) instead, so that a
    background thread holds neither the GIL nor a core the caller's thread needs.
    """
    if request.Test():
        return
    polls, pause = 0, 0.0
    while not request.Test():
        polls += 1
        if background or polls & 63 == 0:
            if deadline.expired():
                raise CollectiveTimeout(f"waited {deadline.seconds:g} s for {what()}")
            failed = peer_failure()
            if failed is not None:
                waited = deadline.seconds - (deadline.expires - time.monotonic())
                raise CollectiveTimeout(f"gave up after {waited:.1f} s waiting for {what()}: "
                                        f"{failed}")
        if background and pause:
            time.sleep(pause)
        else:
            os.sched_yield()
        if background:
            pause = min(5e-4, pause * 2 or 2e-5)


def wait_all(requests: Iterable[MPI.Request], deadline: Deadline,
             what: Callable[[], str]) -> None:
    for request in requests:
        wait(request, deadline, what)
