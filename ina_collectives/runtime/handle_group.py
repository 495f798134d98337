"""The handles that make one call of an API, waited on as one (framework-neutral).

A Horovod handle of a grouped allreduce, a torch.distributed Work over several tensors
and a sparse tensor's gathers each submit several operations to the runtime and finish
when all of them have: ``HandleGroup`` is that call. Its outcome is every result in the
handles' order, or the first failure in that order; whatever became of the others, each
handle is claimed once it is done, so that every operation's name is free again. How
the first failure reaches the caller (Horovod's HorovodInternalError, torch's
DistBackendError) is the API's to say.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ..errors import CollectiveTimeout
from .handles import Handle


class HandleGroup:
    """The handles of one call (``what``: the call, as a wait that times out names it)."""

    __slots__ = ("handles", "what")

    def __init__(self, handles: Sequence[Handle], what: str):
        self.handles = list(handles)
        self.what = what

    def done(self) -> bool:
        """Whether every handle has finished."""
        return all(h.done() for h in self.handles)

    def error(self) -> BaseException | None:
        """The first failure among the finished handles, in their order; None if none
        failed."""
        for h in self.handles:
            if h.done() and h.error is not None:
                return h.error
        return None

    def results(self) -> list[Any]:
        """Every handle's result, in order (None where one has not finished or failed)."""
        return [h.result for h in self.handles]

    def wait(self, seconds: float) -> list[Any]:
        """Every handle's result, in order, once all have finished. Waits on each in turn,
        at most ``seconds`` for each after the one before it (the runtime runs them one
        after another), and on every one whatever became of those before, so that each
        finished handle is claimed; once one is late, on none any longer. Raises the
        first failure in the handles' order: an operation's error, or CollectiveTimeout
        naming the call for one still running."""
        if seconds < 0:
            raise ValueError(f"a wait of {seconds:g} s: the bound must be 0 or more")
        results: list[Any] = []
        first: BaseException | None = None
        late = False
        for h in self.handles:
            if late and not h.done():  # the call is late: claim what has finished, no more
                results.append(None)
                continue
            try:
                results.append(h.wait(seconds, self.what))
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                failure: BaseException = exc
                if not h.done():  # (the handle's own error may be a timeout too)
                    failure = CollectiveTimeout(f"waited {seconds:g} s for {self.what}")
                    late = True
                first = failure if first is None else first
                results.append(None)
        if first is not None:
            raise first
        return results

    def add_done_callback(self, callback: Callable[[HandleGroup], None]) -> None:
        """Call ``callback(group)`` once every handle has finished, each claimed first: at
        once if they have, else from the thread that finished the last one (the runtime's
        thread: keep it short; what it raises there is logged)."""
        if not self.handles:
            callback(self)
            return
        left = [len(self.handles)]
        lock = threading.Lock()  # the last may finish while another's callback is added

        def one_done(_: Handle) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            for h in self.handles:
                h.claim()  # the names are free again
            callback(self)

        for h in self.handles:
            h.add_done_callback(one_done)

