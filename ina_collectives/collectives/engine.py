"""What an engine is: the call it is offered and the protocols it implements.

The chooser (chooser.py) offers each call to its engines in order and runs the first
that takes it; it alone decides, including the hand-over to the fallback when an engine
gives a call up midway. An engine is ``Engine``: a name, ``declines`` (Horovod's
``Enabled``), ``run`` (its ``Execute``), ``reduce_scatter``, ``close`` and ``report``.

One engine may be more than that: an ``OffloadEngine`` moves the reduction out of the
hosts, and with it state that outlives a call (calls numbered alike on every rank, a
layout that changes at call boundaries). It may agree on a call by its own traffic
instead of a host collective (``gate``), predict a call that needs no gate at all, end
a call with no host collective (its error path: recovery.py) and complete calls with
fewer than every rank (a quorum). The chooser holds one, or none, beside its engines,
and asks those hooks of it alone; the layer above gives it (``Collectives``'s
``offload``), so this layer never imports one.
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
    # Called once, with no arguments, while the call's last window drains, by an engine
    # that can start the next call then (the chooser's: it adopts what its caller says
    # comes next, Collectives.allreduce_flat's ``following``); None: nothing.
    on_drain: Callable[[], None] | None = field(default=None, compare=False, repr=False)

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


class OffloadEngine(Engine):
    """An engine that moves the reduction out of the hosts, with state of its own between
    calls: the hooks the chooser asks of its offload alone (module docstring)."""

    def run(self, call: AllreduceCall, deadline: Deadline, prepared: Any = None,
            agreed_first: np.ndarray | None = None) -> HandOver | None:
        """``Engine.run``; ``prepared``: what ``prepare`` made of the call, and
        ``agreed_first`` the ranks' max of its ``proposal``, where the chooser's gate
        agreed on it (``prepared`` alone: after ``predicts`` said yes)."""
        raise NotImplementedError

    # -- a first window agreed in the chooser's gate --------------------------------------

    def prepare(self, call: AllreduceCall, width: int | None = None) -> Any:
        """The call made ready, with ``proposal`` (int16) for the gate to take the max of
        over the ranks; None where it declines the call (or, with ``width``, it does not
        fit a gate of that many values)."""
        raise NotImplementedError

    def window_size(self) -> int:
        """The int16 values every rank passes in the gate (the same on every rank
        between call boundaries)."""
        raise NotImplementedError

    # -- call boundaries ------------------------------------------------------------------

    def news(self) -> int:
        """This rank's news for the gate (rank 0's reaches every rank): non-zero when
        what the offload lost answers again."""
        raise NotImplementedError

    def at_call_boundary(self, seq: int, news: int | None) -> None:
        """Call ``seq`` starts, the same on every rank, with rank 0's ``news`` (None:
        no gate carried it)."""
        raise NotImplementedError

    def layout(self) -> tuple:
        """What a prepared call depends on: it changes at a call boundary when the call
        must be chosen again."""
        raise NotImplementedError

    # -- the offload's own gate -----------------------------------------------------------

    def gates(self) -> bool:
        """Whether the next call's gate goes through the offload (``gate``) rather than
        the chooser's agreement."""
        raise NotImplementedError

    def gate(self, ident: int, prepared: Any, deadline: Deadline) -> Gated:
        """Collective through the offload (``gates()`` holds, alike on every rank): the
        gate of the call whose identity is ``ident`` (agreement.identity), agreeing on
        ``prepared``'s first window where the offload serves it (None: another engine
        does)."""
        raise NotImplementedError

    def predicts(self, ident: int, prepared: Any) -> bool:
        """Whether this call needs no gate: its own traffic carries what a gate would
        (then ``run`` gets ``prepared`` without ``agreed_first``). Alike on every rank
        while ``gates()`` holds."""
        raise NotImplementedError

    # -- calls back to back -----------------------------------------------------------------

    def adopt(self, call: AllreduceCall, prepared: Any, ident: int, seq: int) -> bool:
        """Start ``call`` (``prepared``; ``ident``, its identity; ``seq``, its number at
        the chooser) now, while the running call drains (its ``on_drain``), where its
        run would need no gate and nothing could differ on a rank that starts it only
        after the running call returned; True if started. The chooser's next call must
        then be this one: ``run`` finishes it. (An offload that cannot: never.)"""
        return False

    def adopted(self) -> AllreduceCall | None:
        """The call ``adopt`` started and no ``run`` finished yet (None: none)."""
        return None

    # -- the error path (recovery.py) and the quorum --------------------------------------

    def help_rescue(self, what: str) -> None:
        """Collective, when a gate showed TROUBLE: take part in the rescue of the call a
        rank could not finish alone (``what`` names it)."""
        raise NotImplementedError

    def set_quorum(self, k: int) -> None:
        """Calls it serves from the next one complete at k ranks (0: every rank)."""
        raise NotImplementedError

    def quorum_active(self) -> bool:
        """Whether calls now complete with fewer than every rank."""
        raise NotImplementedError

    def silence_bound(self) -> float:
        """Seconds a call of its goes without an answer before it gives up: what bounds
        the last gate at finalize (``Collectives.finish_calls``), where a rank may still
        be finishing its last call."""
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
