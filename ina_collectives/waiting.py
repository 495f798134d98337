"""Bounded waits on MPI requests: every wait has a deadline and says what it waited for."""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

from mpi4py import MPI

from .errors import CollectiveTimeout


class Deadline:
    """The moment by which one collective call must finish."""

    __slots__ = ("seconds", "expires")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expires = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() >= self.expires


def wait(request: MPI.Request, deadline: Deadline, what: Callable[[], str]) -> None:
    """Complete ``request`` or raise CollectiveTimeout with ``what()`` in the message.

    Polls with Test (which drives MPI's progress engine, as Wait would) and yields the
    core between polls: ranks are often oversubscribed, and a spinning rank would starve
    the peer it waits for. The Python loop also lets Ctrl-C interrupt a wait.
    """
    if request.Test():
        return
    polls = 0
    while not request.Test():
        polls += 1
        if polls & 63 == 0 and deadline.expired():
            raise CollectiveTimeout(f"waited {deadline.seconds:g} s for {what()}")
        os.sched_yield()


def wait_all(requests: Iterable[MPI.Request], deadline: Deadline,
             what: Callable[[], str]) -> None:
    for request in requests:
        wait(request, deadline, what)
