"""The negotiated controller (the Horovod API's runtime): a negotiation thread agrees with
the other ranks, every ``cycle_time`` and on a communicator of its own, which operations
are ready (negotiation.py), ahead of the calls; the runtime's thread takes each round's
outcome, the same on every rank, in order, and hands its calls to the executor: the
ready allreduces as ``scheduling`` orders, cuts and fuses them (docs/ordering.md), the
other kinds by ``HostCollectives`` after their gate. Quorum mode's running ahead of a
late rank is this controller's policy (running_ahead.py), as are join and the trouble a
rank waiting in a gate reports (``_meet_trouble``)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

from ..collectives.waiting import Deadline
from ..errors import CollectiveTimeout, InaError, OperationError
from ..settings import Settings
from . import scheduling
from .executor import Executor
from .host_collectives import HostCollectives
from .negotiation import Message, Outcome, ReadinessTable, Ready, exchange
from .scheduling import Piece

# A round's calls in the order they run, and its other operations.
Schedule = tuple[list[list[Piece]], list[Ready]]


class NegotiatedController:
    """Feeds the executor the negotiation's rounds. ``run_ahead``: quorum mode runs
    ahead of late ranks here, in the negotiation (its table's k)."""

    def __init__(self, executor: Executor, host: HostCollectives, table: ReadinessTable,
                 settings: Settings, run_ahead: bool):
        self.ex, self.host, self.table, self.settings = executor, host, table, settings
        self.subs, self.late = executor.subs, executor.late
        self.collectives, self.rank = executor.collectives, executor.rank
        self.run_ahead = run_ahead
        # Ready partitions a round left for the next (the same on every rank).
        self._carry: list[Piece] = []
        self._join_done: int | None = None  # every rank joined: finished once carried ran
        self._stalled: tuple[str, ...] = ()
        self._due: tuple[str, ...] = ()  # rank 0: what may run without some ranks
        # The negotiation's outcomes, in cycle order, for the runtime's thread (or the
        # exception that ended the negotiation); ``halt``: the runtime's thread ended.
        self._outcomes: queue.SimpleQueue[Outcome | BaseException] = queue.SimpleQueue()
        self._taken = threading.Event()  # the runtime's thread took the last outcome
        # The next round, taken from the negotiation in this round's last call (its
        # outcome, and its schedule: None where it is not to be run ahead).
        self._planned: tuple[Outcome | BaseException, Schedule | None] | None = None
        self.halt = False
        self._comm = executor.collectives.comm.Dup()
        self._thread = threading.Thread(target=self._negotiate, name="ina-negotiation",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the negotiation to end (after the runtime's thread
        has: ``halt``); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def free(self) -> None:
        """The negotiation's communicator freed (once both threads have ended)."""
        self._comm.Free()

    # -- the negotiation thread -----------------------------------------------------------

    def _negotiate(self) -> None:
        """A round every ``cycle_time``, each round's outcome handed to the runtime's
        thread, until a rank shuts the runtime down, the runtime's thread ends, or a round
        fails (its exception is handed on)."""
        subs = self.subs
        try:
            while not self.halt:
                started = time.monotonic()
                with subs.lock:
                    new = subs.take(lambda h: not self.late.take(h))
                    send_join = subs.join is not None and not subs.join_sent
                    subs.join_sent |= send_join
                    # (A rank waiting in the gate of a call it could not finish says so:
                    # the others make one if none comes of itself: _meet_trouble.)
                    reporting = self.collectives.errors.reporting
                    message = Message([h.request for h in new], send_join, subs.shutdown,
                                      self._stalled,
                                      -1 if reporting is None else reporting,
                                      self._due)
                messages = exchange(self._comm, message, Deadline(self.settings.timeout),
                                    self.table.cycle + 1)
                outcome = self.table.absorb(messages, time.monotonic())
                self.ex.counters["cycles"] += 1
                self.late.owe(outcome)
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
                    if self.halt:
                        return
                    if self.collectives.errors.reporting is not None:
                        break
                spare = self.settings.cycle_time - (time.monotonic() - started)
                if spare > 0:
                    time.sleep(spare)
        except BaseException as exc:  # noqa: BLE001 - the runtime's thread reports it
            self._outcomes.put(exc)

    # -- the runtime's thread -------------------------------------------------------------

    def step(self) -> bool:
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
        self.late.hand_over()
        if outcome.trouble:
            self._meet_trouble(outcome.trouble)
        for failed in outcome.failed:
            self.subs.finish(failed.name, error=OperationError(failed.message))
        self._execute(outcome.ready, schedule)
        if outcome.join_done is not None:
            self._join_done = outcome.join_done
        # (A joined rank adds zeros to what others carry over: it stays joined till then.)
        subs = self.subs
        with subs.lock:
            handle = None
            if self._join_done is not None and not self._carry and subs.join is not None:
                handle, subs.join, subs.join_sent = subs.join, None, False
        if handle is not None:
            handle.finish(self._join_done)
            self._join_done = None
        if outcome.shutdown_by is not None:
            self.ex.subs.fail_all(OperationError(
                f"rank {outcome.shutdown_by} shut the runtime down before this operation "
                f"could run"), self.late.late_handles)
            return True
        return False

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

    def _schedule(self, ready: list[Ready]) -> Schedule:
        """A round's calls, in the order they run (its allreduces cut, ordered with the
        pieces carried from the round before, fused, up to partition_bytes: the rest
        carried on), and its other operations."""
        s = self.settings
        others = [r for r in ready if r.any_request().kind != "allreduce"]
        pieces = self.ex.cut([r for r in ready if r.any_request().kind == "allreduce"])
        pieces = scheduling.order(self._carry + pieces, s.ordering == "fifo")
        groups = scheduling.fusion_groups(pieces, s.fusion_threshold, s.partition_bytes)
        run, self._carry = scheduling.take(groups, s.partition_bytes, s.switch_block)
        return run, others

    def _next_round_first(self) -> list[Piece] | None:
        """The next round's first call, where the negotiation has agreed that round
        already and nothing comes between this round's last call and it (no trouble to
        meet, no join or shutdown): its outcome taken now and its calls scheduled
        (``step`` runs them as planned); None otherwise."""
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

    def _execute(self, ready: list[Ready], schedule: Schedule | None = None) -> None:
        """A round's calls and operations (``schedule``: planned already)."""
        run, others = schedule if schedule is not None else self._schedule(ready)
        for i, group in enumerate(run):  # (each call checked at its own gate: Collectives)
            # What comes next may start in this call's drain: the round's next call, or
            # after its last (and nothing else), the next round's first.
            after: Any = (run[i + 1] if i + 1 < len(run) else
                          None if others else self._next_round_first)
            failed = self.ex.run(group, after)
            if failed:
                self._carry = [p for p in self._carry if p.item.name not in failed]
        for item in others:
            request = item.any_request()
            handle = self.subs.inflight.get(item.name)
            try:
                self.ex.gate(request)
                # (A negotiated quorum running ahead is the table's, set as it became
                # ready.)
                result = None if request.kind == "quorum" and self.run_ahead else self.host.run(
                    request.kind, item.requests, handle.data if handle else {})
            except InaError as exc:
                self.subs.finish(item.name, error=exc)
                if isinstance(exc, CollectiveTimeout):
                    raise
                continue
            self.subs.finish(item.name, result)
