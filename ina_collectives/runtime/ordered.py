"""The program-order controller (torch.distributed's groups, whose callers make every
collective in the same order on every rank, as NCCL and gloo require): no negotiation;
the runtime's thread hands the executor each operation as it was submitted, as soon as
it was. Each is checked at its own gate, as the array API's calls are (chooser.py): an
allreduce by its switch identity (a predicted first window, an opening) or the
agreement; any other operation by the executor's gate, then one allgather of every
rank's request (the ReadinessTable compares what the gate does not: shapes, roots, scale
factors). An idle runtime makes no collective at all. A rank that never makes a call
leaves the others waiting up to the timeout, which names the call they waited in."""
from __future__ import annotations

import time
from typing import Any

from ..collectives.waiting import Deadline
from ..errors import CollectiveTimeout, InaError, OperationError
from .executor import Executor
from .handles import Handle
from .host_collectives import HostCollectives
from .negotiation import Message, ReadinessTable, Ready, exchange
from .scheduling import Piece

# An operation taken in program order, and its calls (an allreduce's pieces, one each).
Work = tuple[Handle, list[list[Piece]]]


class OrderedController:
    # Seconds an idle thread waits for a submission before it looks again (a submission
    # or a shutdown wakes it at once).
    IDLE_WAIT = 0.05

    def __init__(self, executor: Executor, host: HostCollectives, table: ReadinessTable):
        self.ex, self.host, self.table = executor, host, table
        self.subs, self.rank = executor.subs, executor.rank
        self.halt = False

    def start(self) -> None:
        pass  # (no thread of its own)

    def stop(self, timeout: float) -> bool:
        return True

    def free(self) -> None:
        pass

    def step(self) -> bool:
        """Run what this rank submitted, in its order; True when the runtime must stop
        (shut down with nothing left to run)."""
        subs = self.subs
        with subs.lock:
            new = subs.take()
            stop = subs.shutdown
            if not new:
                subs.wake.clear()  # (under the lock: a submission after this sets it)
        if not new:
            if stop:
                return True
            subs.wake.wait(self.IDLE_WAIT)
            return False
        work = [self._cut(handle) for handle in new]
        i = 0
        while i < len(work):  # (it may grow: _next)
            handle, calls = work[i]
            self.ex.counters["cycles"] += 1
            request = handle.request
            if request.kind != "allreduce":
                self._host(handle)
                i += 1
                continue
            # What comes next may start in each call's drain: the next piece, the next
            # allreduce taken, or one submitted since (_next).
            upcoming: list[Any] = calls[1:] + (
                work[i + 1][1][:1] if i + 1 < len(work)
                else [lambda: self._next(work)])
            for j, call in enumerate(calls):
                if request.name in subs.inflight:  # (no piece failed)
                    self.ex.run(call, upcoming[j] if j < len(upcoming) else None)
            i += 1
        return False

    def _cut(self, handle: Handle) -> Work:
        """An operation taken in program order, and its calls: an allreduce cut as the
        negotiated path cuts, each piece one call; nothing is fused, since what is queued
        together differs from rank to rank."""
        request = handle.request
        if request.kind != "allreduce":
            return handle, []
        pieces = self.ex.cut([Ready(request.name, {self.rank: request})])
        return handle, [[piece] for piece in pieces]

    def _next(self, work: list[Work]) -> list[Piece] | None:
        """The first call of the next submission, taken now (appended to ``work``) if it
        is an allreduce; None otherwise (it waits for its turn)."""
        subs = self.subs
        with subs.lock:
            queued = subs.queue
            if not queued or queued[0].request.kind != "allreduce":
                return None
            handle = queued.pop(0)
            subs.inflight[handle.request.name] = handle
        work.append(self._cut(handle))
        return work[-1][1][0] if work[-1][1] else None

    def _host(self, handle: Handle) -> None:
        """An operation other than allreduce, in program order: its gate (the call
        checked as the array API checks a call it hands to MPI), every rank's request
        (one allgather, compared by the table), then the operation."""
        request = handle.request
        deadline = Deadline(self.ex.settings.timeout)
        subs = self.subs
        try:
            self.ex.gate(request)
            messages = exchange(self.ex.collectives.comm, Message([request]), deadline,
                                self.table.cycle + 1)
            outcome = self.table.absorb(messages, time.monotonic())
            for failed in outcome.failed:
                subs.finish(failed.name, error=OperationError(failed.message))
            # Every rank saw the same messages: an operation left pending is one that
            # other ranks did not make at this point of the program's order.
            for name, entry in list(self.table.pending.items()):
                del self.table.pending[name]
                subs.finish(name, error=OperationError(
                    self.table.out_of_order(name, entry, messages)))
            for ready in outcome.ready:
                subs.finish(ready.name, self.host.run(ready.any_request().kind,
                                                      ready.requests, handle.data))
        except InaError as exc:
            subs.finish(request.name, error=exc)
            if isinstance(exc, CollectiveTimeout):
                raise
