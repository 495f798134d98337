"""MPI's own Allreduce as an engine: it takes whatever dtype this MPI reduces."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .engine import AllreduceCall, Engine, mark_refused, mpi_reduces
from .ops import Op, mpi_op
from .waiting import Deadline, wait


class MpiEngine(Engine):
    """MPI's own Allreduce (non-blocking, so that the wait has a bound)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def declines(self, call: AllreduceCall) -> str | None:
        return None if mpi_reduces(call.dtype) else f"mpi: no MPI reduction for {call.dtype}"

    def run(self, call: AllreduceCall, deadline: Deadline, prepared: object = None,
            agreed_first: np.ndarray | None = None) -> None:
        send = MPI.IN_PLACE if call.send is None else call.send
        try:
            request = self.comm.Iallreduce(send, call.recv, mpi_op(call.op))
        except MPI.Exception as exc:  # refused at the start (arguments): nothing started
            mark_refused(exc)
            raise
        wait(request, deadline,
             lambda: f"MPI_Iallreduce of {call.recv.size} x {call.dtype} to complete on all "
                     f"{self.comm.Get_size()} ranks")
        if call.op is Op.AVERAGE:
            np.divide(call.recv, self.comm.Get_size(), out=call.recv)
