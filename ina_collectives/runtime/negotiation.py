"""The ranks' agreement, each cycle, on which named operations are ready to run.

Horovod's controller without a coordinator round trip: every cycle each rank publishes
what it newly submitted (and its join/shutdown flags; rank 0 also the names it found
stalled), one allgather hands every rank every message, and every rank updates an
identical ``ReadinessTable``. An operation is ready when every rank has submitted it; its
metadata (kind, dtype, shape, op, root, scale factors) is compared first, so a mismatch
fails on every rank in the same cycle, before any data moves. Every rank sees the same
messages in the same order and so derives the same ready list in the same order.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..collectives.ops import Op, as_op
from ..collectives.waiting import Deadline, wait

log = logging.getLogger("ina_collectives")

# quorum: set the switch's quorum mode at this point of every rank's sequence (its shape
# holds k, compared like any shape).
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
         "quorum")


@dataclass(frozen=True)
class OpRequest:
    """One named operation as a rank submitted it: what every rank must agree on."""

    kind: str                     # one of KINDS
    name: str
    dtype: str                    # the framework's dtype name, compared across ranks
    wire: np.dtype                # the NumPy dtype the data moves as (a name is taken)
    shape: tuple[int, ...] = ()
    op: Op | None = None          # reductions (a name ops.as_op knows is taken)
    root: int = -1                # broadcast
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()  # alltoall: first-dimension rows sent to each rank
    switch_bits: int = 0          # allreduce: 16 asks the switch for 16-bit values
    priority: int = 0             # allreduce: lower runs sooner (runtime/negotiated.py)

    def __post_init__(self) -> None:
        # (Frozen: set once, here, so that every request holds an np.dtype and an Op.)
        object.__setattr__(self, "wire", np.dtype(self.wire))
        if self.op is not None and not isinstance(self.op, Op):
            object.__setattr__(self, "op", as_op(self.op))

    def describe(self) -> str:
        parts = [f"{self.kind} '{self.name}'", f"{self.dtype}{list(self.shape)}"]
        if self.op is not None:
            parts.append(self.op.value)
        if self.root >= 0:
            parts.append(f"root {self.root}")
        return " ".join(parts)


@dataclass
class Message:
    """What one rank publishes in one cycle."""

    requests: list[OpRequest] = field(default_factory=list)
    join: bool = False
    shutdown: bool = False
    stalled: tuple[str, ...] = ()   # rank 0 only: names to fail as stalled
    trouble: int = -1               # the switch call this rank posts TROUBLE for (-1: none)
    # rank 0 only: allreduces to run without the ranks that have not submitted them
    # (quorum mode: ReadinessTable.due)
    go_ahead: tuple[str, ...] = ()


@dataclass
class Ready:
    name: str
    requests: dict[int, OpRequest]    # by rank; a joined rank has none (allreduce only)
    # Quorum mode: the ranks it runs without (they had not submitted it); each takes the
    # result when it does (runtime/running_ahead.py). ``owed``: this rank's place for it.
    absent: tuple[int, ...] = ()
    owed: Any = None
    # Quorum mode: it waited for a rank at its bound of absent steps (ReadinessTable),
    # so it counts every rank: it runs in sync.
    waited: bool = False

    def any_request(self) -> OpRequest:
        return next(iter(self.requests.values()))


@dataclass
class Failed:
    name: str
    message: str


@dataclass
class Outcome:
    """What one cycle decided, identically on every rank."""

    ready: list[Ready] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    join_done: int | None = None     # the last rank to join, once every rank has
    shutdown_by: int | None = None   # a rank that asked to shut down
    trouble: dict[int, int] = field(default_factory=dict)  # rank -> its Message.trouble


@dataclass
class _Entry:
    first_seen: float
    requests: dict[int, OpRequest] = field(default_factory=dict)
    warned: bool = False
    quorate: float | None = None  # when it reached the quorum (rank 0's clock: ``due``)


class ReadinessTable:
    """Every rank's identical view of what is pending where.

    In quorum k (``quorum``: set by the negotiated "quorum" operations, from the job's
    setting at first; not with ``run_ahead`` False, where k is the switch's) an
    allreduce the ranks have all run before (the response cache: ``known``) may run
    once k ranks have submitted it, the others absent: rank 0 names it in
    ``Message.go_ahead`` after ``grace`` seconds (``due``), and every rank makes it
    ready in the same cycle. A rank is absent from the calls of at most ``max_steps``
    training steps in a row (a step ends where a call it was absent from repeats); then
    its submission is waited for (docs/quorum.md, Running ahead)."""

    def __init__(self, size: int, quorum: int = 0, max_steps: int = 0,
                 run_ahead: bool = True):
        self.size = size
        self.pending: dict[str, _Entry] = {}
        self.joined: dict[int, int] = {}   # rank -> cycle it joined in
        self.cycle = 0
        self.run_ahead = run_ahead  # (False: k is the switch's, the table never runs ahead)
        self.quorum = quorum if run_ahead else 0
        self.max_steps = max_steps
        self.known: dict[str, OpRequest] = {}  # allreduces every rank ran, as they ran
        # Per rank: the training steps in a row it was absent from some call of, and the
        # names it was absent from in the current one.
        self.absent_steps = [0] * size
        self._absent_names: list[set[str]] = [set() for _ in range(size)]
        self.absences = 0  # calls made ready with some rank absent

    def absorb(self, messages: list[Message], now: float) -> Outcome:
        self.cycle += 1
        out = Outcome()
        for rank, msg in enumerate(messages):
            for req in msg.requests:
                entry = self.pending.setdefault(req.name, _Entry(now))
                if rank in entry.requests:
                    out.failed.append(Failed(req.name, f"rank {rank} submitted '{req.name}' "
                                             f"again while its first one was pending"))
                    del self.pending[req.name]
                    continue
                entry.requests[rank] = req
            if msg.join and rank not in self.joined:
                self.joined[rank] = self.cycle
            if msg.shutdown and out.shutdown_by is None:
                out.shutdown_by = rank
            if msg.trouble >= 0:
                out.trouble[rank] = msg.trouble
        go_ahead = messages[0].go_ahead
        for name in messages[0].stalled:
            entry = self.pending.pop(name, None)
            if entry is not None:
                out.failed.append(Failed(name, self._stall_text(name, entry, final=True)))
        for name in list(self.pending):
            entry = self.pending[name]
            present = set(entry.requests) | set(self.joined)
            absent: tuple[int, ...] = ()
            if len(present) < self.size:
                if name not in go_ahead or not self._may_run_without(name, entry):
                    continue
                absent = tuple(sorted(set(range(self.size)) - present))
            del self.pending[name]
            problem = self._mismatch(name, entry.requests)
            if problem:
                out.failed.append(Failed(name, problem))
                continue
            first = entry.requests[min(entry.requests)]
            if first.kind == "quorum" and self.run_ahead:
                self.quorum = first.shape[0] if first.shape else 0
            waited = False
            if first.kind == "allreduce" and not self.joined:
                waited = not absent and self._at_bound()
                self._count_absent(name, absent)
                if not absent:
                    self.known[name] = first
            out.ready.append(Ready(name, dict(sorted(entry.requests.items())), absent,
                                   waited=waited))
        if len(self.joined) == self.size:
            last = max(self.joined.values())
            out.join_done = max(r for r, c in self.joined.items() if c == last)
            self.joined.clear()
        return out

    def _may_run_without(self, name: str, entry: _Entry) -> bool:
        """Whether ``name`` may run without the ranks that have not submitted it: quorum
        mode, an allreduce every rank ran before as now, k ranks in, none joined, and no
        missing rank at its bound of absent steps."""
        k = self.quorum
        if not 0 < k < self.size or self.joined or len(entry.requests) < k:
            return False
        known = self.known.get(name)
        if known is None or any(q != known for q in entry.requests.values()):
            return False
        return not self.max_steps or all(
            self._steps_if_absent(r, name) <= self.max_steps
            for r in range(self.size) if r not in entry.requests)

    def _steps_if_absent(self, rank: int, name: str) -> int:
        """The steps in a row ``rank`` would be absent in, were it absent from ``name``."""
        names = self._absent_names[rank]
        return self.absent_steps[rank] + (not names or name in names)

    def _at_bound(self) -> bool:
        """Quorum mode with some rank absent for ``max_steps`` steps in a row."""
        return (0 < self.quorum < self.size and bool(self.max_steps)
                and max(self.absent_steps) >= self.max_steps)

    def _count_absent(self, name: str, absent: tuple[int, ...]) -> None:
        """The staleness count after an allreduce made ready without ``absent``."""
        if absent:
            self.absences += 1
        for r in range(self.size):
            names = self._absent_names[r]
            if r not in absent:
                self.absent_steps[r] = 0
                names.clear()
            else:
                self.absent_steps[r] = self._steps_if_absent(r, name)
                if name in names:  # a call it missed repeats: a new step
                    names.clear()
                names.add(name)

    def due(self, now: float, grace: float) -> tuple[str, ...]:
        """Rank 0: the allreduces that may run without the ranks missing from them, k
        ranks having submitted them ``grace`` seconds ago or more (every rank makes them
        ready when rank 0's message names them)."""
        k = self.quorum
        if not 0 < k < self.size or self.joined:
            return ()
        names = []
        for name, entry in self.pending.items():
            if len(entry.requests) < k or name not in self.known:
                continue
            if entry.quorate is None:
                entry.quorate = now
            if now - entry.quorate >= grace:
                names.append(name)
        return tuple(names)

    def _mismatch(self, name: str, reqs: dict[int, OpRequest]) -> str | None:
        joined = sorted(set(range(self.size)) - set(reqs))
        first = next(iter(reqs.values()))
        if joined and first.kind != "allreduce":
            return (f"{first.kind} '{name}' cannot run: rank(s) {joined} have joined, and "
                    f"only allreduce continues with joined ranks")

        def differ(label: str, value: Callable[[OpRequest], object]) -> str | None:
            values = {r: value(q) for r, q in reqs.items()}
            if len(set(map(repr, values.values()))) <= 1:
                return None
            listed = ", ".join(f"rank {r}: {v}" for r, v in values.items())
            return f"Mismatched {label} of {first.kind} '{name}': {listed}"

        checks: list[tuple[str, Callable[[OpRequest], object]]] = [
            ("operation", lambda q: q.kind), ("dtype", lambda q: q.dtype),
            ("reduction op", lambda q: q.op.value if q.op else "-"),
            ("root rank", lambda q: q.root),
            ("prescale/postscale factors", lambda q: (q.prescale, q.postscale)),
            ("switch value bits (compression)", lambda q: q.switch_bits),
            ("priority", lambda q: q.priority)]
        if first.kind in ("allgather", "alltoall"):
            checks.append(("number of dimensions", lambda q: len(q.shape)))
            checks.append(("shape beyond the first dimension", lambda q: q.shape[1:]))
        else:
            checks.append(("shape", lambda q: q.shape))
        for label, value in checks:
            problem = differ(label, value)
            if problem:
                return problem
        if first.kind == "broadcast" and not 0 <= first.root < self.size:
            return f"broadcast '{name}': root rank {first.root} is not in 0..{self.size - 1}"
        if first.kind == "alltoall":
            for r, q in reqs.items():
                if len(q.splits) != self.size:
                    return (f"alltoall '{name}': rank {r} gave {len(q.splits)} splits for "
                            f"{self.size} ranks")
        return None

    def _stall_text(self, name: str, entry: _Entry, final: bool) -> str:
        missing = sorted(set(range(self.size)) - set(entry.requests) - set(self.joined))
        what = next(iter(entry.requests.values())).describe() if entry.requests else name
        verb = "never submitted" if final else "have not submitted"
        return (f"stalled: {what} was submitted by rank(s) {sorted(entry.requests)}, but "
                f"rank(s) {missing} {verb} it")

    def out_of_order(self, name: str, entry: _Entry, messages: list[Message]) -> str:
        """Why ``name``, pending after a program-order exchange (each rank's message holds
        the one operation it made at this point), cannot run: the ranks that made
        another operation there, and which."""
        what = next(iter(entry.requests.values())).describe()
        others = {r: ", ".join(q.describe() for q in m.requests) or "nothing"
                  for r, m in enumerate(messages) if r not in entry.requests}
        listed = "; ".join(f"rank {r}: {d}" for r, d in others.items())
        return (f"{what} was submitted by rank(s) {sorted(entry.requests)}, but rank(s) "
                f"{sorted(others)} never submitted it at this point of the program's "
                f"order (every rank must make the same collectives in the same order): "
                f"{listed}")

    def stalled(self, now: float, warn_after: float, fail_after: float) -> tuple[str, ...]:
        """Names pending for longer than ``fail_after`` (rank 0 publishes them); warns
        once about those pending for longer than ``warn_after``."""
        failing = []
        for name, entry in self.pending.items():
            age = now - entry.first_seen
            if age >= fail_after:
                failing.append(name)
            elif age >= warn_after and not entry.warned:
                entry.warned = True
                log.warning("%s for %.0f s (fails after %.0f s)",
                            self._stall_text(name, entry, final=False), age, fail_after)
        return tuple(failing)


def exchange(comm: MPI.Intracomm, message: Message, deadline: Deadline, cycle: int
             ) -> list[Message]:
    """Every rank's message of this cycle, in rank order (one or two allgathers; an idle
    cycle costs one allgather of one int64 per rank). It is no gate (runtime/negotiated.py:
    the negotiation runs on a communicator of its own, ahead of the calls)."""
    payload = b"" if message == Message() else pickle.dumps(message, protocol=5)
    n = comm.Get_size()
    sizes = np.empty(n, np.int64)
    wait(comm.Iallgather(np.array([len(payload)], np.int64), sizes), deadline,
         lambda: f"all {n} ranks to reach negotiation cycle {cycle} of the background "
                 f"thread", background=True)
    if not sizes.any():
        return [Message() for _ in range(n)]
    displs = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=displs[1:])
    gathered = np.empty(int(sizes.sum()), np.uint8)
    wait(comm.Iallgatherv(np.frombuffer(payload, np.uint8),
                          [gathered, sizes.tolist(), displs.tolist(), MPI.BYTE]), deadline,
         lambda: f"every rank's requests of negotiation cycle {cycle}", background=True)
    return [pickle.loads(gathered[d:d + s].tobytes()) if s else Message()
            for d, s in zip(displs.tolist(), sizes.tolist())]


