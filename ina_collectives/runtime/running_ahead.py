"""Quorum mode running ahead, this rank's side (docs/quorum.md, Running ahead): the
allreduces the other ranks ran without this rank, each one's result kept for this rank's
late submission of it (``Owed``), and the late inputs carried into the rank's next
contribution of the same name (``RunAhead.carry``). A policy of the negotiated
controller (negotiated.py); the executor asks it of each piece run without this rank."""
from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from ..errors import OperationError
from .handles import Handle
from .negotiation import OpRequest, Outcome
from .scheduling import Piece


class Owed:
    """An allreduce the ranks ran without this rank: its result, once every part has
    run, for this rank's submission of it, which came later (``handle``: bound once it
    has)."""

    __slots__ = ("result", "parts", "error", "handle")

    def __init__(self, request: OpRequest):
        self.result = np.empty(int(np.prod(request.shape)), request.wire)
        self.parts = -1  # parts still to run (-1: not cut yet)
        self.error: BaseException | None = None
        self.handle: Handle | None = None

    @property
    def done(self) -> bool:
        return self.parts == 0 or self.error is not None


class RunAhead:
    """What this rank owes and carries; ``lock``: the runtime's (its Submissions')."""

    def __init__(self, lock: threading.RLock, counters: dict[str, int], rank: int):
        self.lock, self.counters, self.rank = lock, counters, rank
        # Allreduces the others ran without this rank, by name, in order; and the
        # submissions that took one whose result must be handed over by the runtime's
        # thread (a staged input's).
        self._owed: dict[str, collections.deque[Owed]] = {}
        self._deliveries: list[Owed] = []
        # Names whose late inputs are carried, what is carried, and what a call adds.
        self._carries: set[str] = set()
        self._residual: dict[str, np.ndarray] = {}
        self._carried_count: dict[str, int] = {}
        self._adding: dict[str, np.ndarray] = {}

    def owe(self, outcome: Outcome) -> None:
        """The allreduces this round runs without this rank: a place for each one's
        result, in order, for this rank's submission of it."""
        for ready in outcome.ready:
            if not ready.absent:
                continue
            self.counters["tensors without some rank"] += 1
            if self.rank in ready.absent:
                self.counters["tensors without this rank"] += 1
                ready.owed = Owed(ready.any_request())
                with self.lock:
                    self._owed.setdefault(ready.name, collections.deque()).append(ready.owed)

    def take(self, handle: Handle, finished_only: bool = False) -> bool:
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
            self._drop(request.name, owed)
            return True
        owed.handle = handle
        if owed.done:
            if "landed" in handle.data:  # (a staged tensor: handed over by the thread)
                self._deliveries.append(owed)
            else:
                self._deliver(owed)
        return True

    def carry(self, names: Any) -> None:
        """This rank's late inputs of these names are added to its next contribution of
        the same name instead of being dropped (BackgroundRuntime.carry_late_inputs)."""
        with self.lock:
            self._carries.update(names)

    def hand_over(self) -> None:
        """The results of staged late submissions (``take``), from the runtime's thread."""
        with self.lock:
            deliveries, self._deliveries = self._deliveries, []
        for owed in deliveries:
            self._deliver(owed)

    def part(self, piece: Piece, values: np.ndarray | None,
             error: BaseException | None = None) -> None:
        """A part of an allreduce run without this rank: its result kept (or its error),
        handed to the submission that took it once every part is in."""
        owed = piece.item.owed
        if values is not None:
            owed.result[piece.start:piece.stop] = values
        with self.lock:  # (against take: one of the two hands it over)
            if error is not None:
                owed.error = error
            else:
                owed.parts -= 1
            ready = owed.done and owed.handle is not None
        if ready:
            self._deliver(owed)

    def adding(self, name: str) -> np.ndarray | None:
        """What this rank's contribution of ``name`` adds: its late inputs, carried."""
        if not (self._residual or self._adding):
            return None
        with self.lock:
            if name not in self._adding and name in self._residual:
                self._adding[name] = self._residual.pop(name)
                self._carried_count.pop(name, None)
        return self._adding.get(name)

    def added(self, name: str) -> None:
        """``name``'s contribution is complete (or failed): what it added is spent."""
        self._adding.pop(name, None)

    def late_handles(self) -> list[Handle]:
        """(Under the lock, as the runtime stops.) The late submissions bound to a call
        not finished, to fail; what ran without this rank stays for its later ones."""
        handles = []
        for name, waiting in list(self._owed.items()):
            handles += [o.handle for o in waiting if o.handle is not None]
            kept = collections.deque(o for o in waiting if o.handle is None and o.done
                                     and o.error is None)
            if kept:
                self._owed[name] = kept
            else:
                del self._owed[name]
        return handles

    def _drop(self, name: str, owed: Owed) -> None:
        waiting = self._owed[name]
        waiting.remove(owed)
        if not waiting:
            del self._owed[name]

    def _deliver(self, owed: Owed) -> None:
        """A late submission's result: the call the others ran without this rank."""
        handle = owed.handle
        with self.lock:
            self._drop(handle.request.name, owed)
        if owed.error is not None:
            handle.finish(error=owed.error)
            return
        recv = handle.data["recv"]
        if "landed" in handle.data:  # (its input lands in recv: not over it)
            handle.data["landed"](0, recv.size)
        name = handle.request.name
        if name in self._carries:  # (its input, for its next contribution of the name)
            source = handle.data["send"] if handle.data["send"] is not None else recv
            with self.lock:  # (the mean of those carried: one step's weight, stale)
                kept = self._residual.get(name)
                count = self._carried_count[name] = self._carried_count.get(name, 0) + 1
                if kept is None:
                    self._residual[name] = np.array(source, copy=True).reshape(-1)
                else:
                    kept += (source.reshape(-1) - kept) / kept.dtype.type(count)
                self.counters["late inputs carried"] += 1
        np.copyto(recv, owed.result.reshape(recv.shape))
        if "arrived" in handle.data:
            handle.data["arrived"](0, recv.size)
        handle.finish(recv)
