"""The engines that can compute an allreduce, and the call they are offered.

Each engine says why it declines a call (or None if it takes it); ``Collectives`` runs the
first that takes it, in the order INA (a later engine), ring, MPI. One place decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .ops import MPI_OP, RING_DTYPES, Op
from .ring import Ring
from .settings import Settings
from .waiting import Deadline, wait


@dataclass
class AllreduceCall:
    """One allreduce as the engines see it: 1-D contiguous views, recv writable."""

    send: np.ndarray | None  # None: in place, the input is already in recv
    recv: np.ndarray
    op: Op

    @property
    def dtype(self) -> np.dtype:
        return self.recv.dtype

    @property
    def nbytes(self) -> int:
        return self.recv.nbytes


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether this MPI's own reductions take dtype (MPICH has float16, not every MPI does)."""
    return dtype.kind in "fiuc" and dtype.itemsize <= 16 and dtype != np.dtype("longdouble")


class RingEngine:
    name = "ring"

    def __init__(self, comm: MPI.Intracomm, settings: Settings):
        self.ring = Ring(comm, settings.ring_chunk_bytes)
        self.min_bytes = settings.ring_min_bytes

    def declines(self, call: AllreduceCall) -> str | None:
        if call.dtype not in RING_DTYPES:
            return f"ring: dtype {call.dtype} is left to MPI"
        if call.nbytes < self.min_bytes and mpi_reduces(call.dtype):
            return f"ring: below ring_min_bytes ({self.min_bytes})"
        return None

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        if call.send is not None:
            np.copyto(call.recv, call.send)
        self.ring.allreduce(call.recv, call.op, deadline)


class MpiEngine:
    """MPI's own Allreduce (non-blocking, so that the wait has a bound)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def declines(self, call: AllreduceCall) -> str | None:
        return None if mpi_reduces(call.dtype) else f"mpi: no MPI reduction for {call.dtype}"

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        send = MPI.IN_PLACE if call.send is None else call.send
        request = self.comm.Iallreduce(send, call.recv, MPI_OP[call.op])
        wait(request, deadline,
             lambda: f"MPI_Iallreduce of {call.recv.size} x {call.dtype} to complete on all "
                     f"{self.comm.Get_size()} ranks")
        if call.op is Op.AVERAGE:
            np.divide(call.recv, self.comm.Get_size(), out=call.recv)
