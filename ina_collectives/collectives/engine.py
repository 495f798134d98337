"""What an engine is: the call it is offered and the protocol it implements.

The chooser (chooser.py) offers each call to its engines in order and runs the first
that takes it; it alone decides, including the hand-over to the fallback when an engine
gives a call up midway. Adding an engine means subclassing ``Engine`` and placing it in
``Collectives.engines`` (a switch engine: the chooser's ``switch_engine`` argument).
Every hook the chooser calls is declared here; those that only an engine with an
aggregator has (a first window to agree on, openings, the quorum) default to "none", so
the chooser treats every engine alike and never asks which one it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .ops import Op
from .waiting import Deadline


@dataclass
class AllreduceCall:
    """One allreduce as the engines see it: 1-D contiguous views, recv writable."""

    send: np.ndarray | None  # None: in place, the input is already in recv
    recv: np.ndarray
    op: Op
    value_bits: int = 0      # the switch's value width this call asks for (0: the job's)

    @property
    def dtype(self) -> np.dtype:
        return self.recv.dtype

    @property
    def nbytes(self) -> int:
        return self.recv.nbytes


@dataclass
class HandOver:
    """An engine gave a call up midway (NaN/Inf found, the aggregator failed): the
    chooser finishes it on the fallback, starting again from ``intact``, the call's
    input as it was (widened to the dtype the engine reduced in, exactly). ``ranges``:
    the element ranges [start, stop) left to do, the rest of ``recv`` being done (one
    of several aggregators failed); None: all of it. ``rechoose``: nothing of the call
    moved (its opening failed): the chooser picks its engine again, as the other ranks
    do for it. ``mismatch``: nothing moved because the ranks called differently (every
    rank learned it): the chooser names what differs."""

    reason: str
    intact: np.ndarray
    ranges: list[tuple[int, int]] | None = None
    rechoose: bool = False
    mismatch: bool = False


@dataclass
class Opened:
    """How a call's opening ended (``Engine.open``), alike on every rank: "agreed" (with
    ``window``, the max of every rank's proposal, for a call the opener serves),
    "mismatch" (the ranks called differently), "restart" (an opening failed and nothing
    is lost: every rank chooses the call's engine again) or "to_ring" (an opening failed
    while a rank was already streaming the call: every rank takes it to the ring)."""

    outcome: str
    window: np.ndarray | None = None
    reason: str = ""


class Engine:
    """The protocol of an engine, with the defaults of one that has no aggregator."""

    name: str = "engine"

    def declines(self, call: AllreduceCall) -> str | None:
        """Why this engine does not take ``call`` (for stats), or None if it does."""
        raise NotImplementedError

    def run(self, call: AllreduceCall, deadline: Deadline, prepared: Any = None,
            agreed_first: np.ndarray | None = None) -> HandOver | None:
        """Reduce the call into ``call.recv`` on every rank, collectively; or give it up
        (on every rank alike) with a HandOver. ``prepared``: what ``prepare`` made of
        the call, and ``agreed_first`` the ranks' max of its ``proposal``, where the
        chooser's gate agreed on it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (sockets, jobs at the aggregator)."""

    # -- a first window agreed in the chooser's gate --------------------------------------

    def prepare(self, call: AllreduceCall, width: int | None = None) -> Any:
        """The call made ready, with ``proposal`` (int16) for the gate to take the max of
        over the ranks; None where there is nothing to agree on (or, with ``width``, it
        does not fit a gate of that many values)."""
        return None

    def window_size(self) -> int:
        """The int16 values every rank passes in the gate (the same on every rank
        between call boundaries)."""
        return 0

    def answers_again(self) -> int:
        """This rank's news for the gate (rank 0's reaches every rank): non-zero when an
        aggregator the engine lost answers again."""
        return 0

    def at_call_boundary(self, seq: int, news: int | None) -> None:
        """Call ``seq`` starts, the same on every rank, with rank 0's ``news``."""

    def layout(self) -> tuple:
        """What a prepared call depends on: it changes at a call boundary when the call
        must be chosen again."""
        return ()

    # -- openings: the gate through the aggregator -------------------------------------

    def opens(self) -> bool:
        """Whether the next call's gate is an opening through this engine (``open``)."""
        return False

    def opens_served(self, dtype: np.dtype, op: Op, nbytes: int) -> bool:
        """Whether such a call, made next, would open through this engine and be
        served by it."""
        return False

    def open(self, ident: int, prepared: Any, deadline: Deadline) -> Opened:
        """Collective through the aggregator: the call's opening (see ``Opened``)."""
        raise NotImplementedError(f"engine {self.name} has no openings")

    def predicts(self, ident: int, prepared: Any) -> bool:
        """Whether this call (``ident``: its identity; ``prepared``: as ``prepare`` made
        it) needs no opening: its own packets carry what one would (then ``run`` gets
        ``prepared`` without ``agreed_first``). Alike on every rank while ``opens()``
        holds."""
        return False

    # -- the error path (recovery.py) and the quorum ------------------------------------

    def help_rescue(self, what: str) -> bool:
        """Collective, when a gate showed TROUBLE: take part in the rescue; False where
        this engine has no vote-free calls (another engine does it)."""
        return False

    def set_quorum(self, k: int) -> None:
        """Switch-served calls from the next one complete at k workers (0: sync)."""

    def quorum_active(self) -> bool:
        """Whether calls now complete with fewer than every worker."""
        return False

    def report(self) -> dict[str, Any]:
        """What ``stats()`` shows of this engine, beside its calls (none: {})."""
        return {}


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether this MPI's own reductions take dtype (MPICH has float16, not every MPI does)."""
    return dtype.kind in "fiuc" and dtype.itemsize <= 16 and dtype != np.dtype("longdouble")


def mark_refused(exc: BaseException) -> None:
    """Mark an engine's exception as raised before anything started (MPI refused the
    arguments): nothing is in flight, so the communicator stays usable, as with mpi4py."""
    exc.ina_nothing_in_flight = True  # type: ignore[attr-defined]


def was_refused(exc: BaseException) -> bool:
    return bool(getattr(exc, "ina_nothing_in_flight", False))
