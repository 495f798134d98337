"""What an engine is: the call it is offered and the protocol it implements.

The chooser (chooser.py) offers each call to its engines in order and runs the first
that takes it; it alone decides, including the hand-over to the fallback when an engine
gives a call up midway. Adding an engine means implementing ``Engine`` and placing it in
``Collectives.engines``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    do for it."""

    reason: str
    intact: np.ndarray
    ranges: list[tuple[int, int]] | None = None
    rechoose: bool = False


class Engine(Protocol):
    name: str

    def declines(self, call: AllreduceCall) -> str | None:
        """Why this engine does not take ``call`` (for stats), or None if it does."""

    def run(self, call: AllreduceCall, deadline: Deadline) -> HandOver | None:
        """Reduce the call into ``call.recv`` on every rank, collectively; or give it up
        (on every rank alike) with a HandOver."""

    def close(self) -> None:
        """Release what the engine holds (sockets, jobs at the aggregator)."""


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether this MPI's own reductions take dtype (MPICH has float16, not every MPI does)."""
    return dtype.kind in "fiuc" and dtype.itemsize <= 16 and dtype != np.dtype("longdouble")


def mark_refused(exc: BaseException) -> None:
    """Mark an engine's exception as raised before anything started (MPI refused the
    arguments): nothing is in flight, so the communicator stays usable, as with mpi4py."""
    exc.ina_nothing_in_flight = True  # type: ignore[attr-defined]


def was_refused(exc: BaseException) -> bool:
    return bool(getattr(exc, "ina_nothing_in_flight", False))
