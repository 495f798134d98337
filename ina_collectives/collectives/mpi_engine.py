"""MPI's own Allreduce as an engine: it takes whatever dtype this MPI reduces. Without an
MPI job (torchrun) the peers are gloo's (peers.TorchPeers), and so is the allreduce: the
engine is then named "gloo", in stats() and its reasons."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .engine import AllreduceCall, Engine, mark_refused, mpi_reduces
from .ops import Op, mpi_op
from .peers import TorchPeers
from .waiting import Deadline, wait


class MpiEngine(Engine):
    """MPI's own Allreduce (non-blocking, so that the wait has a bound)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm | TorchPeers):
        self.comm = comm
        self._library = "MPI"
        if isinstance(comm, TorchPeers):
            self.name, self._library = "gloo", "gloo"

    def declines(self, call: AllreduceCall) -> str | None:
        if mpi_reduces(call.dtype):
            return None
        return f"{self.name}: no {self._library} reduction for {call.dtype}"

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        send = MPI.IN_PLACE if call.send is None else call.send
        try:
            request = self.comm.Iallreduce(send, call.recv, mpi_op(call.op))
        except MPI.Exception as exc:  # refused at the start (arguments): nothing started
            mark_refused(exc)
            raise
        wait(request, deadline,
             lambda: f"{self._library}'s allreduce of {call.recv.size} x {call.dtype} to "
                     f"complete on all {self.comm.Get_size()} ranks")
        if call.op is Op.AVERAGE:
            np.divide(call.recv, call.divisor(self.comm.Get_size()), out=call.recv)
