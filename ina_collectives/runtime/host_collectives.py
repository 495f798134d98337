"""The runtime's collectives other than allreduce, run on the host by MPI's non-blocking
calls with a bound: one method per kind of request, in an explicit table (``run``)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..collectives.chooser import Collectives
from ..collectives.waiting import Deadline, wait
from . import scaling
from .negotiation import OpRequest


class HostCollectives:
    """allgather, broadcast, alltoall, reducescatter, barrier, and the quorum's setting,
    for one runtime's communicator (the ranks compared every request in the
    negotiation: ``reqs`` holds each rank's)."""

    def __init__(self, collectives: Collectives, timeout: float):
        self.collectives, self.timeout = collectives, timeout
        self.comm = collectives.comm
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.table: dict[str, Callable[[dict[int, OpRequest], dict[str, Any]], Any]] = {
            "allgather": self.allgather, "broadcast": self.broadcast,
            "alltoall": self.alltoall, "reducescatter": self.reducescatter,
            "barrier": self.barrier, "quorum": self.quorum}

    def run(self, kind: str, reqs: dict[int, OpRequest], data: dict[str, Any]) -> Any:
        """The result of the operation of ``kind`` (data: this rank's arrays)."""
        return self.table[kind](reqs, data)

    def _wait(self, request: MPI.Request, what: str) -> None:
        wait(request, Deadline(self.timeout), lambda: what, background=True)

    def allgather(self, reqs: dict[int, OpRequest], data: dict[str, Any]
                  ) -> tuple[np.ndarray, list[int]]:
        req = reqs[self.rank]
        row = math.prod(req.shape[1:]) * req.wire.itemsize
        rows = [reqs[r].shape[0] for r in range(self.size)]
        out = np.empty((sum(rows),) + req.shape[1:], req.wire)
        counts = [n * row for n in rows]
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        self._wait(self.comm.Iallgatherv(
            [_bytes(data["send"]), MPI.BYTE], [_bytes(out), counts, displs, MPI.BYTE]),
            f"allgather '{req.name}' ({sum(counts)} bytes) to complete on all ranks")
        return out, rows

    def broadcast(self, reqs: dict[int, OpRequest], data: dict[str, Any]) -> np.ndarray:
        req = reqs[self.rank]
        buf = data["buf"]
        self._wait(self.comm.Ibcast([_bytes(buf), MPI.BYTE], root=req.root),
                   f"broadcast '{req.name}' from rank {req.root} to complete")
        return buf

    def alltoall(self, reqs: dict[int, OpRequest], data: dict[str, Any]
                 ) -> tuple[np.ndarray, list[int]]:
        req = reqs[self.rank]
        row = math.prod(req.shape[1:]) * req.wire.itemsize
        received = [reqs[r].splits[self.rank] for r in range(self.size)]
        out = np.empty((sum(received),) + req.shape[1:], req.wire)
        send_counts = [n * row for n in req.splits]
        recv_counts = [n * row for n in received]
        offsets = lambda c: np.concatenate(([0], np.cumsum(c)[:-1])).tolist()  # noqa: E731
        self._wait(self.comm.Ialltoallv(
            [_bytes(data["send"]), send_counts, offsets(send_counts), MPI.BYTE],
            [_bytes(out), recv_counts, offsets(recv_counts), MPI.BYTE]),
            f"alltoall '{req.name}' to complete on all ranks")
        return out, received

    def reducescatter(self, reqs: dict[int, OpRequest], data: dict[str, Any]
                      ) -> np.ndarray:
        req = reqs[self.rank]
        full = np.array(data["send"], copy=True).reshape(-1)
        first, row = req.shape[0], math.prod(req.shape[1:])
        start, stop = scaling.split_rows(first, self.size, self.rank)
        if full.size:
            scaling.reduce(self.collectives, full, req, self.size,
                           (start * row, stop * row))
        return full[start * row:stop * row].reshape((stop - start,) + req.shape[1:])

    def barrier(self, reqs: dict[int, OpRequest], data: dict[str, Any]) -> None:
        self._wait(self.comm.Ibarrier(), "every rank to reach the barrier")

    def quorum(self, reqs: dict[int, OpRequest], data: dict[str, Any]) -> None:
        # The negotiation compared every rank's k (the request's shape).
        self.collectives.set_quorum(next(iter(reqs.values())).shape[0], checked=True)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)
