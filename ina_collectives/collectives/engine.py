"""What an engine is: the call it is offered and the protocols it implements.

The chooser (chooser.py) offers each call to its engines in order and runs the first
that takes it; it alone decides, including the hand-over to the fallback when an engine
gives a call up midway. An engine is ``Engine``: a name, ``declines`` (Horovod's
``Enabled``), ``run`` (its ``Execute``), ``reduce_scatter``, ``close`` and ``report``.

One engine may be more than that: an ``OffloadEngine`` moves the reduction out of the
hosts, and with it state that outlives a call (calls numbered alike on every rank, a
layout that changes at call boundaries). It makes the gate of a call it serves inside
its ``run`` (by its own traffic, by the chooser's agreement through ``HostGate``, or
none for a call it predicts), may make the gate of another engine's call
(``gate``), ends a call with no host collective where it can (its error path:
recovery.py) and completes calls with fewer than every rank (a quorum). The chooser
holds one, or none, beside its engines, and asks those hooks of it alone; the layer
above gives it (``Collectives``'s ``offload``), so this layer never imports one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

from .ops import Op
from .waiting import Deadline


@dataclass
class AllreduceCall:
    """One allreduce as the engines see it: 1-D contiguous views, recv writable."""

    send: np.ndarray | None  # None: in place, the input is already in recv
    recv: np.ndarray
    op: Op
    value_bits: int = 0      # the value width this call asks the offload for (0: the job's)
    # What the caller knows the call by, alike on every rank (the Horovod runtime: its
    # tensors' names and ranges), or None: an engine may keep what it learns of a call
    # under it, for the next call with the same key.
    key: Hashable = None
    # The ranks whose input counts, a bitmap alike on every rank (0: all of them). The
    # others pass zeros and are not counted: the Horovod runtime ran ahead of them in
    # quorum mode (docs/quorum.md, Running ahead); AVERAGE divides by those counted.
    present: int = 0
    # The call's identity (agreement.identity of its signature and value width), made
    # once by the chooser; 0: none given.
    ident: int = field(default=0, compare=False)
    # What makes the caller's next call ready, checked (Collectives.allreduce_flat's
    # ``following``; it returns the call, or None): called at most once, by an engine
    # whose stream of this call paused at its drain, which may then queue that call
    # behind this one (docs/protocol.md, Calls back to back). None: no next call known.
    following: Callable[[], "AllreduceCall | None"] | None = field(
        default=None, compare=False, repr=False)

    @property
    def dtype(self) -> np.dtype:
        return self.recv.dtype

    @property
    def nbytes(self) -> int:
        return self.recv.nbytes

    def divisor(self, n: int) -> int:
        """What AVERAGE divides by in an exact engine: the ranks counted, of ``n``."""
        return self.present.bit_count() if self.present else n

    def absent(self, rank: int) -> bool:
        """Whether ``rank`` adds nothing to this call."""
        return bool(self.present) and not (self.present >> rank) & 1

    def same_as(self, other: "AllreduceCall") -> bool:
        """Whether ``other`` is this call made again: the same buffers, op, value width,
        key and ranks present."""
        return (self.send is other.send and self.recv is other.recv
                and self.op is other.op and self.value_bits == other.value_bits
                and self.key == other.key and self.present == other.present)


@dataclass
class HandOver:
    """An engine gave a call up midway (NaN/Inf found, its hardware failed): the chooser
    finishes it on the fallback, starting again from ``intact``, the call's input as it
    was (widened to the dtype the engine reduced in, exactly). ``ranges``: the element
    ranges [start, stop) left to do, the rest of ``recv`` being done (one of the
    engine's several paths failed); None: all of it. ``rechoose``: nothing of the call
    moved (its gate failed): the chooser picks its engine again, as the other ranks do
    for it. ``mismatch``: nothing moved because the ranks called differently (every rank
    learned it): the chooser names what differs."""

    reason: str
    intact: np.ndarray
    ranges: list[tuple[int, int]] | None = None
    rechoose: bool = False
    mismatch: bool = False


class GateOutcome(enum.StrEnum):
    """How an offload's gate ended (``OffloadEngine.gate``), alike on every rank."""

    AGREED = "agreed"            # the ranks made the same call (``Gated.window``: agreed)
    MISMATCH = "mismatch"        # the ranks called differently: the chooser names how
    RESTART = "restart"          # the gate failed and nothing is lost: choose again
    TO_FALLBACK = "to_fallback"  # the gate failed while a rank was already running the
    #                              call: every rank takes it to the fallback
    NOT_HERE = "not_here"        # the offload makes no gate now: the agreement does


@dataclass
class Gated:
    """What an offload's gate gave every rank: its ``outcome``; when AGREED, ``window``,
    the max of every rank's proposal (for a call the offload serves); when it failed,
    the ``reason``."""

    outcome: GateOutcome
    window: np.ndarray | None = None
    reason: str = ""


class Engine:
    """An engine: what the chooser asks of every engine it holds."""

    name: str = "engine"

    def declines(self, call: AllreduceCall) -> str | None:
        """Why this engine does not take ``call`` (for stats), or None if it does."""
        raise NotImplementedError

    def run(self, call: AllreduceCall, deadline: Deadline) -> HandOver | None:
        """Reduce the call into ``call.recv`` on every rank, collectively; or give it up
        (on every rank alike) with a HandOver."""
        raise NotImplementedError

    def reduce_scatter(self, call: AllreduceCall, bounds: list[tuple[int, int]],
                       deadline: Deadline) -> None:
        """Reduce ``call.recv`` (in place: ``call.send`` is None) over every rank into
        this rank's part, ``bounds[rank]`` ([start, stop), every rank's, alike on every
        rank); the rest of ``recv`` is scratch. An engine without one of its own runs the
        whole allreduce, which leaves every part reduced."""
        handover = self.run(call, deadline)
        if handover is not None:
            raise RuntimeError(f"engine {self.name} gave a reduce-scatter up: "
                               f"{handover.reason}")

    def close(self) -> None:
        """Release what the engine holds (sockets, state held elsewhere)."""

    def report(self) -> dict[str, Any]:
        """What ``stats()`` shows of this engine, beside its calls (none: {})."""
        return {}


class HostGate:
    """The chooser's part of a call's gate, as the offload's ``run`` and ``gate`` use it:
    the call boundary and the agreement by MPI (chooser.py makes one per call)."""

    def boundary(self, news: int | None) -> bool:
        """The call starts, alike on every rank, with rank 0's ``news`` (None: no gate
        carried it): False when the offload's layout changed at it (what the call was
        made ready for no longer holds: it starts over)."""
        raise NotImplementedError

    def agree(self, news: int, proposal: np.ndarray | None, width: int) -> Any:
        """The agreement by MPI (agreement.agree): this rank's ``news`` and the call's
        first-window ``proposal`` (None: none), in a gate of ``width`` values; its
        ``Agreed``, or None where the gate ended in a rescue (the call starts over)."""
        raise NotImplementedError


class OffloadEngine(Engine):
    """An engine that moves the reduction out of the hosts, with state of its own between
    calls. The chooser asks it ``declines`` and ``run`` (``Enabled`` and ``Execute``),
    as any engine; the gate of a call it serves (by its own traffic, or the agreement) and
    calls back to back happen inside its ``run``. Beside those, the chooser asks it
    only what a call it does not serve needs: its ``gate``, its ``news`` and
    ``window_size`` for the agreement by MPI, and the ``at_call_boundary``; and the
    ``quorum`` mode. Its rescue and its silence bound it registers with the ErrorPath
    it is given (recovery.py: ``set_rescue``)."""

    # The quorum mode (docs/quorum.md): ``set(k)``, calls from the next one on complete
    # at k ranks (0: every rank); ``active()``, whether calls now complete with fewer.
    quorum: Any

    def run(self, call: AllreduceCall, deadline: Deadline, gate: HostGate | None = None
            ) -> HandOver | None:
        """``Engine.run``, its gate made here: ``gate``, the chooser's part of it, where
        the chooser compares the ranks' calls (None: the caller did, as the runtime's
        negotiation does: the call boundary is made already). A HandOver with
        ``rechoose`` and no ``reason``: nothing moved and the call starts over (its
        gate failed, or the layout changed at its boundary)."""
        raise NotImplementedError

    def gate(self, ident: int, deadline: Deadline, gate: HostGate) -> Gated:
        """Collective: the gate of a call this offload does not serve (another engine's
        allreduce, another collective), whose identity is ``ident``
        (agreement.identity), through the offload; NOT_HERE, alike on every rank,
        where the offload makes no gate now (the chooser's agreement does)."""
        raise NotImplementedError

    def news(self) -> int:
        """This rank's news for the agreement (rank 0's reaches every rank): non-zero
        when what the offload lost answers again."""
        raise NotImplementedError

    def window_size(self) -> int:
        """The int16 values every rank passes in the agreement (the same on every rank
        between call boundaries)."""
        raise NotImplementedError

    def at_call_boundary(self, seq: int, news: int | None) -> bool:
        """Call ``seq`` starts, the same on every rank, with rank 0's ``news`` (None:
        no gate carried it); False when the offload's layout changed."""
        raise NotImplementedError


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether this MPI's own reductions take dtype (MPICH has float16, not every MPI does)."""
    return dtype.kind in "fiuc" and dtype.itemsize <= 16 and dtype != np.dtype("longdouble")


def mark_refused(exc: BaseException) -> None:
    """Mark an engine's exception as raised before anything started (MPI refused the
    arguments): nothing is in flight, so the communicator stays usable, as with mpi4py."""
    exc.ina_nothing_in_flight = True  # type: ignore[attr-defined]


def was_refused(exc: BaseException) -> bool:
    return bool(getattr(exc, "ina_nothing_in_flight", False))
