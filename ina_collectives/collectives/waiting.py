"""Bounded waits on MPI requests: every wait has a deadline and says what it waited for.

A rank also says what it waits for now, and its stacks, when asked: ``kill -USR2 PID``
(``dump_on_signal``, installed at init where SIGUSR2 has no handler yet). ina-run sends
it to ranks it is about to stop for time, and the test suite to a job it kills for time.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterable, Iterator

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


# What each thread of this process waits for now: thread id -> (what, since when).
_waiting: dict[int, tuple[Callable[[], str], float]] = {}
DUMP_SIGNAL = signal.SIGUSR2


@contextlib.contextmanager
def waiting_for(what: Callable[[], str]) -> Iterator[None]:
    """Say, while the block runs, what this thread waits for (``describe_waits``)."""
    me = threading.get_ident()
    outer = _waiting.get(me)
    _waiting[me] = (what, time.monotonic())
    try:
        yield
    finally:
        if outer is None:
            _waiting.pop(me, None)
        else:
            _waiting[me] = outer


def describe_waits() -> list[str]:
    """One line per thread of this process that waits in the library now: what for and
    for how long."""
    now, lines = time.monotonic(), []
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, (what, since) in list(_waiting.items()):
        try:
            text = what()
        except Exception as exc:  # (a description must not fail the dump)
            text = f"<undescribed: {exc!r}>"
        lines.append(f"thread {names.get(ident, ident)}: waiting {now - since:.1f} s for "
                     f"{text}")
    return lines


def _dump(signum: int, frame: object) -> None:
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK") or "?"
    waits = describe_waits() or ["not waiting in ina_collectives"]
    for line in waits:
        print(f"ina_collectives: rank {rank} (pid {os.getpid()}): {line}", file=sys.stderr,
              flush=True)


def dump_on_signal(run_dir: str = "") -> bool:
    """SIGUSR2 prints what each thread waits for (Python's handler: at the next poll of a
    wait, or within 20 ms in a stream) and every thread's stacks (faulthandler: at once,
    even inside MPI) on stderr. Installed only from the main thread and where SIGUSR2 has
    no handler of the program's; True if installed. Under ina-run (``run_dir``, settings'
    run_dir) it leaves ``rank<r>.stacks`` there: ina-run asks only such ranks (a program
    that never initialised the library would die of SIGUSR2)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, _dump):
            return False
        signal.signal(DUMP_SIGNAL, _dump)
        faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=True)
    except (ValueError, OSError, RuntimeError, AttributeError):
        return False  # (no signals here: an embedded interpreter, say)
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK") or ""
    if run_dir and rank.isdigit():
        try:
            with open(os.path.join(run_dir, f"rank{rank}.stacks"), "w"):
                pass
        except OSError:
            pass  # (another host's folder: ina-run does not ask it)
    return True


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
    with waiting_for(what):
        _wait(request, deadline, what, background)


def _wait(request: MPI.Request, deadline: Deadline, what: Callable[[], str],
          background: bool) -> None:
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
