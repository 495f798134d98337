"""An mpi4py intracommunicator whose allreduce goes through this library's engines.

    from mpi4py import MPI
    from ina_collectives.mpi import Intracomm
    comm = Intracomm(MPI.COMM_WORLD)      # a drop-in for MPI.COMM_WORLD

``Allreduce`` (buffers) and ``allreduce`` (objects) pick the best engine per call; what
the engines cannot do (user-defined ops, MAXLOC/MINLOC, derived datatypes, GPU buffers,
long double...) is handed to ``MPI.Intracomm`` itself. Every other method is mpi4py's.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from .collectives import buffers
from .collectives.agreement import CallSignature
from .collectives.chooser import Collectives
from .collectives.ops import Op, as_op, check_supported
from .ina.offload import ABSENT, offload_for
from .ina.summary import summarize
from .runtime import world
from .settings import Settings


class Intracomm(MPI.Intracomm):
    """``MPI.Intracomm`` with allreduce through ina_collectives.

    Constructing it over a communicator is collective over that communicator, as
    ``ina_collectives.init()`` is: it duplicates the communicator for the library's own
    traffic and joins the switch, so that a switch INA_REQUIRE_SWITCH needs fails here,
    on every rank. (Communicators mpi4py makes of this type, with Dup, Create and the
    like, start the library at their first ``Allreduce``/``allreduce`` instead.) The first
    one constructed, until freed, is what ``ina_collectives.stats()`` and ``summary()``
    report when ``ina_collectives.init()`` has not run.
    """

    def __new__(cls, comm: MPI.Intracomm | None = None, **settings: Any) -> "Intracomm":
        return super().__new__(cls, comm)

    def __init__(self, comm: MPI.Intracomm | None = None, **settings: Any) -> None:
        super().__init__()
        self._ina_settings = Settings.load(settings)
        self._ina_state: Collectives | None = None
        if self != MPI.COMM_NULL:
            self._ina  # noqa: B018 - started now: collective, as init() is
            _made.append(weakref.ref(self))

    @property
    def _ina(self) -> Collectives:
        # mpi4py makes new communicators of our type (Dup, Create...) without __init__.
        state = getattr(self, "_ina_state", None)
        if state is None:
            settings = getattr(self, "_ina_settings", None) or Settings.load()
            state = Collectives(MPI.Intracomm(self), settings, offload_for(settings),
                                ABSENT)
            self._ina_state = state
        return state

    def ina_stats(self) -> dict[str, Any]:
        """Counters of this communicator's allreduce calls: see ina_collectives.stats()."""
        return self._ina.stats.snapshot()

    def ina_summary(self) -> str:
        """ina_stats() in one paragraph: see ina_collectives.summary()."""
        return summarize(self.ina_stats())

    def ina_set_quorum(self, k: int) -> None:
        """Collective: quorum k (0: sync) for this communicator's switch-served calls from
        the next one on (ina_collectives.set_quorum)."""
        self._ina.set_quorum(k)

    def Free(self) -> None:
        state = getattr(self, "_ina_state", None)
        if state is not None:
            state.free()
            self._ina_state = None
        super().Free()

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM) -> None:
        ours = as_op(op)
        send = buffers.parse(sendbuf, writable=False)
        recv = buffers.parse(recvbuf, writable=True)
        taken = (ours is not None and isinstance(recv, np.ndarray) and send is not None
                 and _engines_take(recv.dtype, ours))
        if not taken:
            if isinstance(op, Op):  # AVERAGE & co. are ours: MPI cannot be asked
                if isinstance(recv, np.ndarray):
                    check_supported(recv.dtype, op)
                raise ValueError(f"op {op.name} needs plain contiguous CPU buffers of a "
                                 f"NumPy dtype; got sendbuf {sendbuf!r}, recvbuf {recvbuf!r}")
            self._ina.check_agreement(CallSignature(
                CallSignature.MPI_DIRECT, -1, -1, -1, f"Allreduce handed to MPI, op {op!r}"))
            super().Allreduce(sendbuf, recvbuf, op)
            return
        if send is not buffers.IN_PLACE:
            if send.dtype != recv.dtype:
                raise ValueError(f"mismatch in send and receive datatypes: sendbuf holds "
                                 f"{send.dtype}, recvbuf {recv.dtype}")
            if send.size != recv.size:
                raise ValueError(f"mismatch in send count {send.size} and receive count "
                                 f"{recv.size}")
        self._ina.allreduce_flat(None if send is buffers.IN_PLACE else send, recv, ours)

    def allreduce(self, sendobj: Any, op: Any = MPI.SUM) -> Any:
        ours = as_op(op)
        if (ours is not None and isinstance(sendobj, np.ndarray)
                and _engines_take(sendobj.dtype, ours)):
            return self._ina.allreduce(sendobj, ours)
        if isinstance(op, Op):
            raise ValueError(f"op {op.name} takes numpy arrays of a supported dtype, "
                             f"got {type(sendobj).__name__}")
        self._ina.check_agreement(CallSignature(
            CallSignature.OBJECTS, -1, -1, -1, f"allreduce of a {type(sendobj).__name__}"))
        return super().allreduce(sendobj, op)


# The Intracomms constructed over a communicator, in order (weakly: one the program
# dropped is gone); the first not freed is the array API's default group.
_made: list[weakref.ref[Intracomm]] = []


class _DefaultComm:
    """An Intracomm as ina_collectives.stats(), summary() and set_quorum() see it
    (runtime.world's default group)."""

    def __init__(self, comm: Intracomm):
        self.comm = comm

    def stats(self) -> dict[str, Any]:
        return self.comm.ina_stats()

    def set_quorum(self, k: int) -> None:
        self.comm.ina_set_quorum(k)


def _default_comm() -> _DefaultComm | None:
    _made[:] = [ref for ref in _made if ref() is not None]
    for ref in _made:
        comm = ref()
        if comm is not None and getattr(comm, "_ina_state", None) is not None:
            return _DefaultComm(comm)
    return None


world.provide_default_group(_default_comm)


def _engines_take(dtype: np.dtype, op: Op) -> bool:
    try:
        check_supported(dtype, op)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["Intracomm"]
