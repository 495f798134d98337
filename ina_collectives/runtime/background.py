"""The background runtime behind the Horovod-style API and the torch.distributed backend,
framework-neutral (NumPy arrays): callers ``submit`` a named operation and get a
``Handle`` (handles.py); one thread per runtime owns its communication and runs the
calls, one executor of calls (executor.py) fed by one of two controllers:

- negotiated (negotiated.py; the Horovod API): every ``cycle_time`` a negotiation
  thread agrees with the other ranks, on a communicator of its own and ahead of the
  calls, which operations are ready; the runtime's thread runs each round in that
  order, its allreduces cut, ordered and fused (docs/ordering.md). Quorum mode's running
  ahead of a late rank is its policy (running_ahead.py).
- program order (ordered.py; torch.distributed's groups, whose callers make every
  collective in the same order on every rank): no negotiation, each operation run as
  soon as it was submitted.

Either way each call is checked at its own gate, as the array API's calls are
(chooser.py): an allreduce by its identity in the switch (a predicted first window, an
opening) or the agreement; any other operation by ``Collectives.check_agreement``.
Every wait is bounded: a peer that stops negotiating fails every pending handle with
CollectiveTimeout, a tensor some ranks never submit fails after
``stall_shutdown_time`` naming them; in program order a rank that never makes a call
leaves the others waiting up to the timeout, which names the call they waited in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Iterator

from mpi4py import MPI

from ..collectives.chooser import Collectives
from ..collectives.peers import TorchPeers
from ..errors import InaError, OperationError
from ..ina.offload import ABSENT, offload_for
from ..ina.summary import summarize
from ..settings import Settings
from .executor import Executor
from .handles import Handle, Submissions
from .host_collectives import HostCollectives
from .negotiated import NegotiatedController
from .negotiation import OpRequest, ReadinessTable
from .ordered import OrderedController
from .running_ahead import RunAhead

__all__ = ["BackgroundRuntime", "Handle"]

log = logging.getLogger("ina_collectives")


class BackgroundRuntime:
    def __init__(self, comm: MPI.Intracomm | TorchPeers, settings: Settings, *,
                 ordered: bool = False):
        if isinstance(comm, MPI.Intracomm) and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("the Horovod API needs MPI_THREAD_MULTIPLE (its background "
                               "thread communicates while the caller's may too); MPI gave "
                               f"level {MPI.Query_thread()}: do not lower mpi4py.rc.thread_level")
        self.settings = settings
        self.ordered = ordered
        # Each call is checked at its own gate, as the array API's are: in program order
        # nothing else compares it, and the negotiation, which runs ahead of the calls on
        # a communicator of its own, is no gate (a vote-free call needs the next
        # collective to be one: collectives/recovery.py).
        # Negotiated, quorum mode runs ahead of late ranks here, in the negotiation (its
        # table's k), and the switch serves every call in sync among the ranks present:
        # a switch quorum's calls would each agree their exponents and vote over MPI
        # (docs/quorum.md, Running ahead). quorum_run_ahead 0 leaves k to the switch.
        self.run_ahead = not ordered and settings.quorum_run_ahead
        self.collectives = Collectives(
            comm, dataclasses.replace(
                settings, check_agreement=settings.check_agreement or not ordered,
                quorum=0 if self.run_ahead else settings.quorum),
            offload_for(settings), ABSENT)
        self.comm = self.collectives.comm
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.host = HostCollectives(self.collectives, settings.timeout)
        self.table = ReadinessTable(self.size, settings.quorum, settings.quorum_max_steps,
                                    self.run_ahead)
        self.fusion = {"fused calls": 0, "tensors fused": 0, "cycles": 0,
                       "tensors without some rank": 0, "tensors without this rank": 0,
                       "late inputs carried": 0}
        self._subs = Submissions()
        self._late = RunAhead(self._subs.lock, self.fusion, self.rank)
        executor = Executor(self.collectives, settings, self._subs, self._late,
                            keyed=not ordered)
        self._controller: NegotiatedController | OrderedController = (
            OrderedController(executor, self.host, self.table) if ordered else
            NegotiatedController(executor, self.host, self.table, settings, self.run_ahead))
        self._names_taken: dict[str, Handle] = {}
        self._latest: Handle | None = None
        self._sweep_at = 64
        self._stopped: str | None = None   # why the loop ended, once it has
        self._thread = threading.Thread(target=self._run, name="ina-background", daemon=True)
        self._thread.start()
        self._controller.start()

    # -- the caller's side ------------------------------------------------------------

    def submit(self, request: OpRequest, **data: Any) -> Handle:
        """Queue ``request`` with its arrays (send/recv/buf as its kind needs). An
        allreduce may also give ``landed(start, stop)``, called before elements
        [start, stop) of its input are read, and ``arrived(start, stop)``, called once
        they hold final results (a tensor staged a window at a time: torch/windows.py)."""
        handle = Handle(request, data)
        subs = self._subs
        with subs.lock:
            if self._stopped is not None or subs.shutdown:
                # A late rank's submissions of calls the others ran without it (and then
                # shut down: they ran ahead to the end) still take their results.
                if self._late.take(handle, finished_only=True):
                    return handle
            self._check_running()
            # Horovod frees a name when its operation finishes. Here a finished one
            # that was not synchronized stays taken until the next submission, so that
            # submitting it again at once fails alike however fast the first one ran.
            earlier = self._names_taken.get(request.name)
            if earlier is not None and (earlier is self._latest or not earlier.done()):
                raise ValueError(f"an operation named '{request.name}' is already in flight "
                                 f"on this rank; names of in-flight operations must differ")
            if len(self._names_taken) > self._sweep_at:  # amortized: names never synced
                for name in [n for n, h in self._names_taken.items() if h.done()]:
                    del self._names_taken[name]
                self._sweep_at = 2 * len(self._names_taken) + 64
            self._names_taken[request.name] = self._latest = handle
            handle.on_claim = lambda: self._release(handle)
            if not self._late.take(handle):
                subs.queue.append(handle)
                subs.wake.set()
        return handle

    def carry_late_inputs(self, names: Any) -> None:
        """Quorum mode running ahead (docs/quorum.md): this rank's inputs of these names
        that the others ran without (it submitted them late) are added to its next
        contribution of the same name instead of being dropped: a gradient, counted one
        or more steps late (Serene's rule). For names that always carry the same
        quantity, as DistributedOptimizer's gradients do; a name reused for a metric
        would add an old value to a new one."""
        self._late.carry(names)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Operations submitted inside reach this rank's negotiation in one round, so
        once every rank has submitted them they are ready, and fused, together (where
        the fusion threshold allows): Horovod's grouped allreduce."""
        with self._subs.lock:
            yield

    def _release(self, handle: Handle) -> None:
        with self._subs.lock:
            if self._names_taken.get(handle.request.name) is handle:
                del self._names_taken[handle.request.name]

    def join(self) -> Handle:
        """This rank has no more data: it contributes zeros to others' allreduces until
        every rank has joined; the handle's result is the last rank to join."""
        subs = self._subs
        with subs.lock:
            self._check_running()
            if self.ordered:
                raise ValueError("join() needs the negotiation (the Horovod API); this "
                                 "runtime runs calls in program order")
            if subs.join is not None:
                raise ValueError("join() is already in progress on this rank")
            subs.join = Handle(None, {})
            return subs.join

    def shutdown(self, timeout: float) -> None:
        """Stop the thread (every rank's thread stops in the same cycle), free the
        communicator. Pending handles fail. Idempotent."""
        with self._subs.lock:
            self._subs.shutdown = True
            self._subs.wake.set()
        started = time.monotonic()
        self._thread.join(timeout)
        stopped = self._controller.stop(max(0.0, timeout - (time.monotonic() - started)))
        if self._thread.is_alive() or not stopped:
            log.warning("the background threads did not stop within %g s", timeout)
        else:
            self._controller.free()
            self.collectives.free()

    def wait_seconds(self) -> float:
        """The longest a handle can take: a stall or a dead peer fails it before this."""
        return self.settings.stall_shutdown_time + 2 * self.settings.timeout

    def stats(self) -> dict[str, Any]:
        return {**self.collectives.stats.snapshot(), **self.fusion,
                "run-ahead quorum": self.table.quorum}  # (0: sync, or the switch's)

    def summary(self) -> str:
        """stats() in one paragraph (ina/summary.py), for a binding's summary()."""
        return summarize(self.stats())

    def _check_running(self) -> None:
        if self._stopped is not None:
            raise OperationError(f"the background runtime has stopped: {self._stopped}")
        if self._subs.shutdown:
            raise OperationError("the background runtime is shutting down")

    # -- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        reason = "shut down"
        fail = self._subs.fail_all
        try:
            while not self._controller.step():
                pass
        except BaseException as exc:  # noqa: BLE001 - every handle must hear of it
            reason = f"{type(exc).__name__}: {exc}"
            log.error("background thread stopped: %s", reason)
            fail(exc if isinstance(exc, InaError) else OperationError(reason),
                 self._late.late_handles)
        finally:
            self._stopped = reason
            self._controller.halt = True
            fail(OperationError(f"the background runtime has stopped: {reason}"),
                 self._late.late_handles)
