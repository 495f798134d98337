"""The background runtime behind the Horovod-style API, framework-neutral (NumPy arrays):
the thread's cycle and the handles.

Two threads per process own all communication of the runtime: callers ``submit`` a
named operation and get a ``Handle``; every ``cycle_time`` the negotiation thread agrees
with the other ranks, on a communicator of its own, which operations are ready
(negotiation.py) and hands each cycle's outcome, the same on every rank, to the runtime's
thread, which runs them in that order: the ready allreduces as ``scheduling`` orders, cuts
and fuses them (docs/ordering.md), each fusion buffer reduced with one call through
``Collectives`` (so INA serves them when it applies) with Horovod's ``scaling``; the other
kinds by ``HostCollectives``. The negotiation runs ahead of the data: while one round's
calls stream, the next rounds are agreed, so that a call the switch serves waits for no
host collective at all. Each call is therefore checked at its own gate, as the array
API's calls are (chooser.py): an allreduce by its identity in the switch (a predicted
first window, an opening) or the agreement; any other operation by
``Collectives.check_agreement``.
Every wait is bounded: a peer that stops negotiating fails every pending handle with
CollectiveTimeout, a tensor some ranks never submit fails after
``stall_shutdown_time`` naming them.

In program order (``ordered``: torch.distributed's backend, whose callers make every
collective in the same order on every rank, as NCCL and gloo require) there is no
negotiation: the thread runs each operation as it was submitted, as soon as it was, and
each one is checked at its own gate, as the array API's calls are (chooser.py): an
allreduce by its switch identity (a predicted first window, an opening) or the
agreement; any other operation by ``Collectives.check_agreement``, then one allgather of
every rank's request (the ReadinessTable compares what the gate does not: shapes, roots,
scale factors). An idle runtime makes no collective at all. A rank that never makes a
call leaves the others waiting up to the timeout, which names the call they waited in.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
from mpi4py import MPI

from ..collectives.agreement import CallSignature
from ..collectives.chooser import Collectives, Following
from ..collectives.peers import TorchPeers
from ..collectives.waiting import Deadline
from ..errors import CollectiveTimeout, InaError, OperationError
from ..ina.offload import ABSENT, offload_for
from ..ina.summary import summarize
from ..settings import Settings
from . import scaling, scheduling
from .host_collectives import HostCollectives
from .negotiation import Message, OpRequest, Outcome, ReadinessTable, Ready, exchange
from .scheduling import Piece

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


@dataclass
class _Local:
    """This rank's submissions, in the order it made them."""

    queue: list[Handle] = field(default_factory=list)
    inflight: dict[str, Handle] = field(default_factory=dict)
    join: Handle | None = None
    join_sent: bool = False


class _Owed:
    """An allreduce the ranks ran without this rank (quorum mode: docs/quorum.md, Running
    ahead): its result, once every part has run, for this rank's submission of it, which
    came later (``handle``: bound once it has)."""

    __slots__ = ("result", "parts", "error", "handle")

    def __init__(self, request: OpRequest):
        self.result = np.empty(int(np.prod(request.shape)), request.wire)
        self.parts = -1  # parts still to run (-1: not cut yet)
        self.error: BaseException | None = None
        self.handle: Handle | None = None

    @property
    def done(self) -> bool:
        return self.parts == 0 or self.error is not None


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
        # Quorum mode: allreduces the others ran without this rank, by name, in order; and
        # the submissions that took one whose result must be handed over by this thread.
        self._owed: dict[str, collections.deque[_Owed]] = {}
        self._deliveries: list[_Owed] = []
        # Names whose late inputs are carried into the rank's next contribution of the
        # name, not dropped (carry_late_inputs), what is carried, and what a call adds.
        self._carries: set[str] = set()
        self._residual: dict[str, np.ndarray] = {}
        self._carried_count: dict[str, int] = {}
        self._adding: dict[str, np.ndarray] = {}
        self._fusion_buffer = np.empty(0, np.uint8)
        # The next call, made ready in this one's drain (``_ready_ahead``): its group,
        # buffer, offsets and length; a fused one fills the spare fusion buffer.
        self._ahead: tuple[list[Piece], np.ndarray, list[int], int] | None = None
        # The next round, taken from the negotiation in this round's last call (its
        # outcome, and its schedule: None where it is not to be run ahead).
        self._planned: tuple[Outcome | BaseException,
                             tuple[list[list[Piece]], list[Ready]] | None] | None = None
        self._fusion_spare = np.empty(0, np.uint8)
        self._lock = threading.RLock()  # (re-entrant: submissions made ``together``)
        self._local = _Local()
        self._names_taken: dict[str, Handle] = {}
        self._latest: Handle | None = None
        self._sweep_at = 64
        # Ready partitions a round left for the next (the same on every rank), the
        # partitions of each tensor not reduced yet, and the number of the next ready one.
        self._carry: list[Piece] = []
        self._parts_left: dict[str, int] = {}
        self._ready_count = 0
        self._join_done: int | None = None  # every rank joined: finished once carried ran
        self._shutdown = False
        self._stopped: str | None = None   # why the loop ended, once it has
        self._stalled: tuple[str, ...] = ()
        self._due: tuple[str, ...] = ()  # rank 0: what may run without some ranks
        self._wake = threading.Event()  # (program order: set by a submission, a shutdown)
        # The negotiation's outcomes, in cycle order, for the runtime's thread (or the
        # exception that ended the negotiation); ``_halt``: the runtime's thread ended.
        self._outcomes: queue.SimpleQueue[Outcome | BaseException] = queue.SimpleQueue()
        self._taken = threading.Event()  # the runtime's thread took the last outcome
        self._halt = False
        self._negotiation_comm = None if ordered else self.comm.Dup()
        self._negotiator = None if ordered else threading.Thread(
            target=self._negotiate, name="ina-negotiation", daemon=True)
        self._thread = threading.Thread(target=self._run, name="ina-background", daemon=True)
        self._thread.start()
        if self._negotiator is not None:
            self._negotiator.start()

    # -- the caller's side ------------------------------------------------------------

    def submit(self, request: OpRequest, **data: Any) -> Handle:
        """Queue ``request`` with its arrays (send/recv/buf as its kind needs). An
        allreduce may also give ``landed(start, stop)``, called before elements
        [start, stop) of its input are read, and ``arrived(start, stop)``, called once
        they hold final results (a tensor staged a window at a time: torch/windows.py)."""
        handle = Handle(request, data)
        with self._lock:
            if self._stopped is not None or self._shutdown:
                # A late rank's submissions of calls the others ran without it (and then
                # shut down: they ran ahead to the end) still take their results.
                if self._took_owed(handle, finished_only=True):
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
            if not self._took_owed(handle):
                self._local.queue.append(handle)
                self._wake.set()
        return handle

    def _took_owed(self, handle: Handle, finished_only: bool = False) -> bool:
        """(Under the lock.) Whether ``handle`` is this rank's late submission of an
        allreduce the others already ran without it: it then takes that call's result
        (at once if it is in, else when it is) and is not negotiated."""
        request = handle.request
        owed = next((o for o in self._owed.get(request.name, ()) if o.handle is None),
                    None)
        if (owed is None or request.kind != "allreduce"
                or (finished_only and not (owed.done and "landed" not in handle.data))):
            return False
        if int(np.prod(request.shape)) != owed.result.size or request.wire != owed.result.dtype:
            handle.finish(error=OperationError(
                f"{request.describe()} was run without this rank as the others submitted "
                f"it ({owed.result.size} x {owed.result.dtype}); this rank's submission "
                f"differs"))
            self._drop_owed(request.name, owed)
            return True
        owed.handle = handle
        if owed.done:
            if "landed" in handle.data:  # (a staged tensor: handed over by the thread)
                self._deliveries.append(owed)
            else:
                self._deliver(owed)
        return True

    def carry_late_inputs(self, names: Any) -> None:
        """Quorum mode running ahead (docs/quorum.md): this rank's inputs of these names
        that the others ran without (it submitted them late) are added to its next
        contribution of the same name instead of being dropped: a gradient, counted one
        or more steps late (Serene's rule). For names that always carry the same
        quantity, as DistributedOptimizer's gradients do; a name reused for a metric
        would add an old value to a new one."""
        with self._lock:
            self._carries.update(names)

    def _drop_owed(self, name: str, owed: _Owed) -> None:
        waiting = self._owed[name]
        waiting.remove(owed)
        if not waiting:
            del self._owed[name]

    def _deliver(self, owed: _Owed) -> None:
        """A late submission's result: the call the others ran without this rank."""
        handle = owed.handle
        with self._lock:
            self._drop_owed(handle.request.name, owed)
        if owed.error is not None:
            handle.finish(error=owed.error)
            return
        recv = handle.data["recv"]
        if "landed" in handle.data:  # (its input lands in recv: not over it)
            handle.data["landed"](0, recv.size)
        name = handle.request.name
        if name in self._carries:  # (its input, for its next contribution of the name)
            source = handle.data["send"] if handle.data["send"] is not None else recv
            with self._lock:  # (the mean of those carried: one step's weight, stale)
                kept = self._residual.get(name)
                count = self._carried_count[name] = self._carried_count.get(name, 0) + 1
                if kept is None:
                    self._residual[name] = np.array(source, copy=True).reshape(-1)
                else:
                    kept += (source.reshape(-1) - kept) / kept.dtype.type(count)
                self.fusion["late inputs carried"] += 1
        np.copyto(recv, owed.result.reshape(recv.shape))
        if "arrived" in handle.data:
            handle.data["arrived"](0, recv.size)
        handle.finish(recv)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Operations submitted inside reach this rank's negotiation in one round, so
        once every rank has submitted them they are ready, and fused, together (where
        the fusion threshold allows): Horovod's grouped allreduce."""
        with self._lock:
            yield

    def _release(self, handle: Handle) -> None:
        with self._lock:
            if self._names_taken.get(handle.request.name) is handle:
                del self._names_taken[handle.request.name]

    def join(self) -> Handle:
        """This rank has no more data: it contributes zeros to others' allreduces until
        every rank has joined; the handle's result is the last rank to join."""
        with self._lock:
            self._check_running()
            if self.ordered:
                raise ValueError("join() needs the negotiation (the Horovod API); this "
                                 "runtime runs calls in program order")
            if self._local.join is not None:
                raise ValueError("join() is already in progress on this rank")
            self._local.join = Handle(None, {})
            return self._local.join

    def shutdown(self, timeout: float) -> None:
        """Stop the thread (every rank's thread stops in the same cycle), free the
        communicator. Pending handles fail. Idempotent."""
        with self._lock:
            self._shutdown = True
            self._wake.set()
        started = time.monotonic()
        self._thread.join(timeout)
        if self._negotiator is not None:
            self._negotiator.join(max(0.0, timeout - (time.monotonic() - started)))
        if self._thread.is_alive() or (self._negotiator and self._negotiator.is_alive()):
            log.warning("the background threads did not stop within %g s", timeout)
        else:
            if self._negotiation_comm is not None:
                self._negotiation_comm.Free()
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
        if self._shutdown:
            raise OperationError("the background runtime is shutting down")

    # -- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        reason = "shut down"
        try:
            while True:
                if self._in_order() if self.ordered else self._cycle():
                    break
        except BaseException as exc:  # noqa: BLE001 - every handle must hear of it
            reason = f"{type(exc).__name__}: {exc}"
            log.error("background thread stopped: %s", reason)
            self._fail_all(exc if isinstance(exc, InaError) else OperationError(reason))
        finally:
            self._stopped = reason
            self._halt = True
            self._fail_all(OperationError(f"the background runtime has stopped: {reason}"))

    def _meet_trouble(self, trouble: dict[int, int]) -> None:
        """Ranks wait in the gate of a switch call they could not finish alone (their
        number of it in ``trouble``): a call that ended with no vote waits for the next
        collective to be a gate, and the next call's gate comes only once every rank has
        submitted it, which those ranks cannot. A rank that kept that call and has made
        no gate since makes one now, as every such rank does at the same outcome, and
        takes part in the rescue (collectives/recovery.py); one that made a gate since
        met them there."""
        errors = self.collectives.errors
        calls = {call for rank, call in trouble.items() if rank != self.rank}
        if errors.kept is not None and errors.kept_call in calls:
            self.collectives.meet_trouble(
                f"switch call #{errors.kept_call}, which rank(s) "
                f"{sorted(r for r, c in trouble.items() if c == errors.kept_call)} "
                f"could not finish")

    def _negotiate(self) -> None:
        """The negotiation thread: a round every ``cycle_time``, each round's outcome
        handed to the runtime's thread, until a rank shuts the runtime down, the
        runtime's thread ends, or a round fails (its exception is handed on)."""
        try:
            while not self._halt:
                started = time.monotonic()
                with self._lock:
                    new, self._local.queue = self._local.queue, []
                    new = [h for h in new if not self._took_owed(h)]
                    for handle in new:
                        self._local.inflight[handle.request.name] = handle
                    send_join = self._local.join is not None and not self._local.join_sent
                    self._local.join_sent |= send_join
                    # (A rank waiting in the gate of a call it could not finish says so:
                    # the others make one if none comes of itself: _meet_trouble.)
                    reporting = self.collectives.errors.reporting
                    message = Message([h.request for h in new], send_join, self._shutdown,
                                      self._stalled,
                                      -1 if reporting is None else reporting,
                                      self._due)
                messages = exchange(self._negotiation_comm, message,
                                    Deadline(self.settings.timeout), self.table.cycle + 1)
                outcome = self.table.absorb(messages, time.monotonic())
                self.fusion["cycles"] += 1
                self._owe(outcome)
                if self.rank == 0:
                    self._stalled = self.table.stalled(time.monotonic(),
                                                       self.settings.stall_warning_time,
                                                       self.settings.stall_shutdown_time)
                    self._due = self.table.due(time.monotonic(),
                                               self.settings.quorum_grace)
                self._taken.clear()
                self._outcomes.put(outcome)
                if outcome.shutdown_by is not None:
                    return
                # One round ahead, no more: the next round is agreed while this one's
                # calls run, and holds what was submitted until it starts (a backlog of
                # rounds would hold a piece that priority moves ahead behind them all).
                # While the runtime's thread waits in a gate in trouble, the rounds go on:
                # they tell the others (_meet_trouble).
                while not self._taken.wait(0.02):
                    if self._halt:
                        return
                    if self.collectives.errors.reporting is not None:
                        break
                spare = self.settings.cycle_time - (time.monotonic() - started)
                if spare > 0:
                    time.sleep(spare)
        except BaseException as exc:  # noqa: BLE001 - the runtime's thread reports it
            self._outcomes.put(exc)

    def _owe(self, outcome: Outcome) -> None:
        """The allreduces this round runs without this rank: a place for each one's
        result, in order, for this rank's submission of it."""
        for ready in outcome.ready:
            if not ready.absent:
                continue
            self.fusion["tensors without some rank"] += 1
            if self.rank in ready.absent:
                self.fusion["tensors without this rank"] += 1
                ready.owed = _Owed(ready.any_request())
                with self._lock:
                    self._owed.setdefault(ready.name, collections.deque()).append(ready.owed)

    def _cycle(self) -> bool:
        """One negotiated round's work, in the negotiation's order; True when the runtime
        must stop."""
        # (The negotiation hands on a round every cycle_time, or its failure within its
        # bound: this wait only backs that up.)
        bound = self.settings.timeout + self.settings.cycle_time + 5.0
        planned, self._planned = self._planned, None
        if planned is not None:  # (taken in the last round's last call: _next_round_first)
            outcome, schedule = planned
            self._taken.set()
        else:
            schedule = None
            try:
                outcome = self._outcomes.get(timeout=bound)
                self._taken.set()
            except queue.Empty:
                raise CollectiveTimeout(f"the negotiation thread gave no round for "
                                        f"{bound:g} s") from None
        if isinstance(outcome, BaseException):
            raise outcome
        self._hand_over()
        if outcome.trouble:
            self._meet_trouble(outcome.trouble)
        for failed in outcome.failed:
            self._finish(failed.name, error=OperationError(failed.message))
        self._execute(outcome.ready, schedule)
        if outcome.join_done is not None:
            self._join_done = outcome.join_done
        # (A joined rank adds zeros to what others carry over: it stays joined till then.)
        with self._lock:
            handle = None
            if (self._join_done is not None and not self._carry
                    and self._local.join is not None):
                handle, self._local.join, self._local.join_sent = self._local.join, None, False
        if handle is not None:
            handle.finish(self._join_done)
            self._join_done = None
        if outcome.shutdown_by is not None:
            self._fail_all(OperationError(f"rank {outcome.shutdown_by} shut the runtime down "
                                          f"before this operation could run"))
            return True
        return False

    # -- program order (``ordered``) -------------------------------------------------------

    # Seconds an idle thread waits for a submission before it looks again (a submission
    # or a shutdown wakes it at once).
    IDLE_WAIT = 0.05

    def _in_order(self) -> bool:
        """Run what this rank submitted, in its order; True when the runtime must stop
        (shut down with nothing left to run)."""
        with self._lock:
            new, self._local.queue = self._local.queue, []
            for handle in new:
                self._local.inflight[handle.request.name] = handle
            stop = self._shutdown
            if not new:
                self._wake.clear()  # (under the lock: a submission after this sets it)
        if not new:
            if stop:
                return True
            self._wake.wait(self.IDLE_WAIT)
            return False
        work = [self._cut_in_order(handle) for handle in new]
        i = 0
        while i < len(work):  # (it may grow: _next_in_order)
            handle, calls = work[i]
            self.fusion["cycles"] += 1
            request = handle.request
            if request.kind != "allreduce":
                self._host_in_order(handle)
                i += 1
                continue
            # What comes next may start in each call's drain: the next piece, the next
            # allreduce taken, or one submitted since (_next_in_order).
            upcoming: list[Any] = calls[1:] + (
                work[i + 1][1][:1] if i + 1 < len(work)
                else [lambda: self._next_in_order(work)])
            for j, call in enumerate(calls):
                if request.name in self._local.inflight:  # (no piece failed)
                    self._allreduce_group(call, upcoming[j] if j < len(upcoming) else None)
            i += 1
        return False

    def _cut_in_order(self, handle: Handle) -> tuple[Handle, list[list[Piece]]]:
        """An operation taken in program order, and its calls: an allreduce cut as the
        negotiated path cuts (a partition's results go back as it completes), each piece
        one call; nothing is fused, since what is queued together differs from rank to
        rank."""
        request = handle.request
        if request.kind != "allreduce":
            return handle, []
        pieces, counts = scheduling.cut([Ready(request.name, {self.rank: request})],
                                        self.settings.partition_bytes,
                                        self.settings.switch_block, self._ready_count)
        self._ready_count += 1
        self._parts_left.update(counts)
        return handle, [[piece] for piece in pieces]

    def _next_in_order(self, work: list[tuple[Handle, list[list[Piece]]]]
                       ) -> list[Piece] | None:
        """The first call of the next submission, taken now (appended to ``work``) if it
        is an allreduce; None otherwise (it waits for its turn)."""
        with self._lock:
            queued = self._local.queue
            if not queued or queued[0].request.kind != "allreduce":
                return None
            handle = queued.pop(0)
            self._local.inflight[handle.request.name] = handle
        work.append(self._cut_in_order(handle))
        return work[-1][1][0] if work[-1][1] else None

    def _host_in_order(self, handle: Handle) -> None:
        """An operation other than allreduce, in program order: its gate (the call
        checked as the array API checks a call it hands to MPI), every rank's request
        (one allgather, compared by the table), then the operation."""
        request = handle.request
        deadline = Deadline(self.settings.timeout)
        try:
            self._gate(request)
            messages = exchange(self.comm, Message([request]), deadline,
                                self.table.cycle + 1)
            outcome = self.table.absorb(messages, time.monotonic())
            for failed in outcome.failed:
                self._finish(failed.name, error=OperationError(failed.message))
            # Every rank saw the same messages: an operation left pending is one that
            # other ranks did not make at this point of the program's order.
            for name, entry in list(self.table.pending.items()):
                del self.table.pending[name]
                self._finish(name, error=OperationError(
                    self.table.out_of_order(name, entry, messages)))
            for ready in outcome.ready:
                self._finish(ready.name, self.host.run(ready.any_request().kind,
                                                       ready.requests, handle.data))
        except InaError as exc:
            self._finish(request.name, error=exc)
            if isinstance(exc, CollectiveTimeout):
                raise

    def _hand_over(self) -> None:
        """The results of staged late submissions (``_took_owed``), from this thread."""
        with self._lock:
            deliveries, self._deliveries = self._deliveries, []
        for owed in deliveries:
            self._deliver(owed)

    def _owed_part(self, piece: Piece, values: np.ndarray | None,
                   error: BaseException | None = None) -> None:
        """A part of an allreduce run without this rank: its result kept (or its error),
        handed to the submission that took it once every part is in."""
        owed = piece.item.owed
        if values is not None:
            owed.result[piece.start:piece.stop] = values
        with self._lock:  # (against _took_owed: one of the two hands it over)
            if error is not None:
                owed.error = error
            else:
                owed.parts -= 1
            ready = owed.done and owed.handle is not None
        if ready:
            self._deliver(owed)

    def _finish(self, name: str, result: Any = None, error: BaseException | None = None
                ) -> None:
        with self._lock:
            handle = self._local.inflight.pop(name, None)
        if handle is not None:
            handle.finish(result, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._local.inflight.values()) + self._local.queue
            self._local.inflight, self._local.queue = {}, []
            if self._local.join is not None:
                handles.append(self._local.join)
                self._local.join = None
            # (What ran without this rank stays for its late submissions: submit.)
            for name, waiting in list(self._owed.items()):
                handles += [o.handle for o in waiting if o.handle is not None]
                kept = collections.deque(o for o in waiting if o.handle is None and o.done
                                         and o.error is None)
                if kept:
                    self._owed[name] = kept
                else:
                    del self._owed[name]
        for handle in handles:
            if not handle.done():
                handle.finish(error=error)

    # -- running what is ready ------------------------------------------------------------

    def _schedule(self, ready: list[Ready]) -> tuple[list[list[Piece]], list[Ready]]:
        """A round's calls, in the order they run (its allreduces cut, ordered with the
        pieces carried from the round before, fused, up to partition_bytes: the rest
        carried on), and its other operations."""
        s = self.settings
        others = [r for r in ready if r.any_request().kind != "allreduce"]
        pieces, counts = scheduling.cut([r for r in ready
                                         if r.any_request().kind == "allreduce"],
                                        s.partition_bytes, s.switch_block, self._ready_count)
        self._ready_count += len(counts)
        self._parts_left.update(counts)
        for item in ready:
            if item.owed is not None:
                item.owed.parts = counts[item.name]
        pieces = scheduling.order(self._carry + pieces, s.ordering == "fifo")
        groups = scheduling.fusion_groups(pieces, s.fusion_threshold, s.partition_bytes)
        run, self._carry = scheduling.take(groups, s.partition_bytes, s.switch_block)
        return run, others

    def _next_round_first(self) -> list[Piece] | None:
        """The next round's first call, where the negotiation has agreed that round
        already and nothing comes between this round's last call and it (no trouble to
        meet, no join or shutdown): its outcome taken now and its calls scheduled
        (``_cycle`` runs them as planned); None otherwise."""
        if self._planned is not None:
            return None
        try:
            outcome = self._outcomes.get_nowait()
        except queue.Empty:
            return None
        # (Not yet ``_taken``: the negotiation's next round starts when this one's cycle
        # does, as ever. Started earlier, it closes with fewer tensors, and a piece that
        # priority would move ahead waits a round longer: priority plus overlap lost 5%.)
        if (isinstance(outcome, BaseException) or outcome.trouble
                or outcome.join_done is not None or outcome.shutdown_by is not None):
            self._planned = (outcome, None)
            return None
        schedule = self._schedule(outcome.ready)
        self._planned = (outcome, schedule)
        return schedule[0][0] if schedule[0] else None

    def _execute(self, ready: list[Ready],
                 schedule: tuple[list[list[Piece]], list[Ready]] | None = None) -> None:
        """A round's calls and operations (``schedule``: planned already)."""
        run, others = schedule if schedule is not None else self._schedule(ready)
        for i, group in enumerate(run):  # (each call checked at its own gate: Collectives)
            # What comes next may start in this call's drain: the round's next call, or
            # after its last (and nothing else), the next round's first.
            after = (run[i + 1] if i + 1 < len(run) else
                     None if others else self._next_round_first)
            self._allreduce_group(group, after)
        for item in others:
            request = item.any_request()
            handle = self._local.inflight.get(item.name)
            try:
                self._gate(request)
                # (A negotiated quorum running ahead is the table's, set as it became
                # ready.)
                result = None if request.kind == "quorum" and self.run_ahead else self.host.run(
                    request.kind, item.requests, handle.data if handle else {})
            except InaError as exc:
                self._finish(item.name, error=exc)
                if isinstance(exc, CollectiveTimeout):
                    raise
                continue
            self._finish(item.name, result)

    def _gate(self, request: OpRequest) -> None:
        """The gate of an operation other than allreduce: the call checked as the array
        API checks a call it hands to MPI (an opening through the switch, or the
        agreement), where a rank that could not finish the switch call before it meets
        the others (collectives/recovery.py)."""
        # (A quorum's setting is gated by the agreement: the next switch call, in the new
        # mode, would meet an opening of its number in the cells it uses.)
        self.collectives.check_agreement(CallSignature(
            CallSignature.MPI_DIRECT, -1, -1, -1, request.describe()),
            Deadline(self.settings.timeout), through_offload=request.kind != "quorum")

    def _buffer(self, group: list[Piece], spare: bool = False
                ) -> tuple[np.ndarray, list[int], int]:
        """Where ``group``'s call reduces, its pieces' offsets there and its length: a
        lone piece in its output (no copy out) unless it is an input the caller still
        needs unchanged; fused pieces in the fusion buffer (``spare``: the other one, for
        a call made ready while one runs)."""
        wire = group[0].request.wire
        offsets, total = scheduling.layout(group, self.settings.switch_block)
        if len(group) == 1:
            handle = self._local.inflight.get(group[0].item.name)
            recv = handle.data["recv"] if handle else None
            return (recv[group[0].start:group[0].stop] if recv is not None
                    else np.empty(total, wire)), offsets, total
        fusion = self._fusion_spare if spare else self._fusion_buffer
        if fusion.nbytes < total * wire.itemsize:
            fusion = np.empty(max(total * wire.itemsize, self.settings.fusion_threshold),
                              np.uint8)
            if spare:
                self._fusion_spare = fusion
            else:
                self._fusion_buffer = fusion
        buffer = fusion[:total * wire.itemsize].view(wire)
        if total > offsets[-1] + group[-1].stop - group[-1].start or any(
                offsets[i] + p.stop - p.start != offsets[i + 1]
                for i, p in enumerate(group[:-1])):
            buffer[...] = 0  # the padding between pieces adds nothing
        return buffer, offsets, total

    def _call_of(self, group: list[Piece]) -> tuple[Any, int]:
        """``group``'s call's key and the ranks present (AllreduceCall)."""
        # Negotiated calls are known by their tensors' names and ranges, alike on every
        # rank, so the offload may learn per tensor (the next step's same call); in
        # program order names are the callers' and need not repeat.
        key = (None if self.ordered else
               tuple((p.item.name, p.start, p.stop) for p in group))
        # (Fused only with its like: scheduling.) Every rank present and named: a call
        # that waited for a rank at its bound, counted in sync.
        item = group[0].item
        present = (sum(1 << r for r in range(self.size) if r not in item.absent)
                   if item.absent or item.waited else 0)
        return key, present

    def _ready_ahead(self, after: list[Piece] | Callable[[], list[Piece] | None]
                     ) -> Following | None:
        """The next call made ready while this one drains (Collectives.allreduce_flat's
        ``following``): its input filled in and prescaled, if none of it waits to land
        (a staged input) and it is not empty; its arguments, else None."""
        group = after() if callable(after) else after
        if not group:
            return None
        for piece in group:
            handle = self._local.inflight.get(piece.item.name)
            if handle is not None and "landed" in handle.data:
                return None
        buffer, offsets, total = self._buffer(group, spare=True)
        if not total:
            return None
        try:
            self._fill(group, buffer, offsets)
            op = scaling.ahead(self.collectives, buffer, group[0].request)
        except Exception:  # (its own run fills it again, and raises it there)
            log.debug("the next call could not be made ready ahead", exc_info=True)
            return None
        self._ahead = (group, buffer, offsets, total)
        key, present = self._call_of(group)
        return Following(None, buffer, op, group[0].request.switch_bits, key, present)

    def _allreduce_group(self, group: list[Piece],
                         after: list[Piece] | Callable[[], list[Piece] | None] | None = None
                         ) -> None:
        """One call: ``group``'s pieces reduced, their results handed back. ``after``:
        the call that comes next (or what finds it), made ready in this one's drain
        (``_ready_ahead``)."""
        req = group[0].request
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is group:
            _, buffer, offsets, total = ahead
            if len(group) > 1:  # (its buffer the spare one: the other is free now)
                self._fusion_buffer, self._fusion_spare = (self._fusion_spare,
                                                           self._fusion_buffer)
        else:
            ahead = None
            buffer, offsets, total = self._buffer(group)
        if len(group) > 1:
            self.fusion["fused calls"] += 1
            self.fusion["tensors fused"] += len(group)
        try:
            if ahead is None:
                self._fill(group, buffer, offsets)  # (a staged input's copy may time out)
            if total:
                key, present = self._call_of(group)
                following = ((lambda: self._ready_ahead(after)) if after is not None
                             else None)
                scaling.reduce(self.collectives, buffer, req, self.size, key=key,
                               present=present, prescaled=ahead is not None,
                               following=following)
        except InaError as exc:
            for piece in group:
                if piece.item.owed is not None:
                    self._owed_part(piece, None, exc)
            failed = {piece.item.name for piece in group}
            self._carry = [p for p in self._carry if p.item.name not in failed]
            for name in failed:
                self._parts_left.pop(name, None)
                self._adding.pop(name, None)
                self._finish(name, error=exc)
            if isinstance(exc, CollectiveTimeout):
                raise
            return
        for piece, offset in zip(group, offsets):
            name = piece.item.name
            handle = self._local.inflight.get(name)
            if piece.item.owed is not None:  # run without this rank: kept for it
                self._owed_part(piece, buffer[offset:offset + piece.stop - piece.start])
            elif handle is not None:
                recv = handle.data["recv"]
                if len(group) > 1:
                    np.copyto(recv[piece.start:piece.stop],
                              buffer[offset:offset + piece.stop - piece.start])
                if "arrived" in handle.data:  # this range is final: it may go back now
                    handle.data["arrived"](piece.start, piece.stop)
            left = self._parts_left.get(name, 1) - 1
            if left > 0:
                self._parts_left[name] = left
                continue
            self._parts_left.pop(name, None)
            self._adding.pop(name, None)
            if handle is not None:
                self._finish(name, handle.data["recv"])

    def _fill(self, group: list[Piece], buffer: np.ndarray, offsets: list[int]) -> None:
        """Each piece's input into its place in ``buffer`` (zeros for a joined rank),
        once it has landed where it is staged."""
        for piece, offset in zip(group, offsets):
            handle = self._local.inflight.get(piece.item.name)
            place = buffer[offset:offset + piece.stop - piece.start]
            if handle is None:          # this rank has joined: it adds nothing
                place[...] = 0
                continue
            if "landed" in handle.data:  # staged a window at a time: wait for this range
                handle.data["landed"](piece.start, piece.stop)
            if handle.data["send"] is not None or len(group) > 1:
                # (send None: in place, the input is in recv, where a lone piece is)
                source = handle.data["send"]
                if source is None:
                    source = handle.data["recv"]
                np.copyto(place, source[piece.start:piece.stop])
            name = piece.item.name
            if self._residual or self._adding:  # its late inputs, carried
                with self._lock:
                    if name not in self._adding and name in self._residual:
                        self._adding[name] = self._residual.pop(name)
                        self._carried_count.pop(name, None)
                carried = self._adding.get(name)
                if carried is not None:
                    place += carried[piece.start:piece.stop]
