"""A runtime's handles and this rank's submissions: ``Handle`` (an operation in flight,
its result once done, its callbacks) and ``Submissions`` (what the caller submitted and
the runtime has not finished, in order, behind the runtime's one lock)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..errors import CollectiveTimeout
from .negotiation import OpRequest

log = logging.getLogger("ina_collectives")

_CALLBACKS = threading.Lock()  # orders a handle's finish against callbacks being added


def _run_callback(callback: Callable[[Handle], None], handle: Handle) -> None:
    try:
        callback(handle)
    except Exception:  # noqa: BLE001 - the runtime must go on; the caller hears of it
        log.exception("a completion callback of '%s' failed",
                      handle.request.name if handle.request else "join")


class Handle:
    """An operation in flight; ``result`` once ``done``."""

    __slots__ = ("request", "data", "_done", "result", "error", "on_claim", "_callbacks")

    def __init__(self, request: OpRequest | None, data: dict[str, Any]):
        self.request, self.data = request, data
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.on_claim: Any = None   # called once the caller has taken the outcome
        self._callbacks: list[Callable[[Handle], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.data = {}  # the runtime is done with the caller's buffers
        with _CALLBACKS:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run_callback(callback, self)

    def claim(self) -> None:
        """The caller has taken the outcome: the operation's name is free again."""
        if self.on_claim is not None:
            self.on_claim, claimed = None, self.on_claim
            claimed()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once it is done: at once if it is, else from the
        thread that finishes it (the background thread: keep it short)."""
        with _CALLBACKS:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        _run_callback(callback, self)

    def wait(self, seconds: float, what: str) -> Any:
        """The result, or the operation's error; CollectiveTimeout after ``seconds``.
        Waits in short slices so that Ctrl-C interrupts it."""
        deadline = time.monotonic() + seconds
        while not self._done.wait(0.1):
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"waited {seconds:g} s for {what}")
        self.claim()
        if self.error is not None:
            raise self.error
        return self.result


class Submissions:
    """This rank's submissions, in the order it made them: ``queue`` (not yet taken by a
    controller), ``inflight`` (taken, by name), the join in progress; ``lock`` guards
    them (re-entrant: submissions made ``together``), ``wake`` is set by a submission or
    a shutdown, ``shutdown`` once the runtime is asked to stop."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.queue: list[Handle] = []
        self.inflight: dict[str, Handle] = {}
        self.join: Handle | None = None
        self.join_sent = False
        self.shutdown = False

    def take(self, keep: Callable[[Handle], bool] = lambda handle: True) -> list[Handle]:
        """(Under the lock.) The queued submissions ``keep`` accepts, now in flight."""
        new, self.queue = self.queue, []
        new = [h for h in new if keep(h)]
        for handle in new:
            self.inflight[handle.request.name] = handle
        return new

    def finish(self, name: str, result: Any = None, error: BaseException | None = None
               ) -> None:
        """The operation ``name`` in flight ends with ``result`` or ``error``."""
        with self.lock:
            handle = self.inflight.pop(name, None)
        if handle is not None:
            handle.finish(result, error)

    def fail_all(self, error: BaseException, more: Callable[[], list[Handle]]) -> None:
        """Every submission not finished (and ``more()``'s, taken under the lock) fails
        with ``error``."""
        with self.lock:
            handles = list(self.inflight.values()) + self.queue
            self.inflight, self.queue = {}, []
            if self.join is not None:
                handles.append(self.join)
                self.join = None
            handles += more()
        for handle in handles:
            if not handle.done():
                handle.finish(error=error)
