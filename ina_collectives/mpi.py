"""An mpi4py intracommunicator whose allreduce goes through this library's engines.

    from mpi4py import MPI
    from ina_collectives.mpi import Intracomm
    comm = Intracomm(MPI.COMM_WORLD)      # a drop-in for MPI.COMM_WORLD

``Allreduce`` (buffers) and ``allreduce`` (objects) pick the best engine per call; what
the engines cannot do (user-defined ops, MAXLOC/MINLOC, derived datatypes, GPU buffers,
long double...) is handed to ``MPI.Intracomm`` itself. Every other method is mpi4py's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .collectives import buffers
from .collectives.agreement import CallSignature
from .collectives.chooser import Collectives
from .collectives.ops import Op, as_op, check_supported
from .ina.engine import InaEngine
from .settings import Settings


class Intracomm(MPI.Intracomm):
    """``MPI.Intracomm`` with allreduce through ina_collectives.

    Constructing it is not collective; the first ``Allreduce``/``allreduce`` (which every
    rank calls) duplicates the communicator for the library's own traffic.
    """

    def __new__(cls, comm: MPI.Intracomm | None = None, **settings: Any) -> "Intracomm":
        return super().__new__(cls, comm)

    def __init__(self, comm: MPI.Intracomm | None = None, **settings: Any) -> None:
        super().__init__()
        self._ina_settings = Settings.load(settings)
        self._ina_state: Collectives | None = None

    @property
    def _ina(self) -> Collectives:
        # mpi4py makes new communicators of our type (Dup, Create...) without __init__.
        state = getattr(self, "_ina_state", None)
        if state is None:
            settings = getattr(self, "_ina_settings", None) or Settings.load()
            state = self._ina_state = Collectives(MPI.Intracomm(self), settings, InaEngine)
        return state

    def ina_stats(self) -> dict[str, Any]:
        """Counters of this communicator's allreduce calls: see ina_collectives.stats()."""
        return self._ina.stats.snapshot()

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


def _engines_take(dtype: np.dtype, op: Op) -> bool:
    try:
        check_supported(dtype, op)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["Intracomm"]
