"""Ring allreduce over mpi4py point-to-point: the fallback engine (RingEngine).

Reduce-scatter then allgather, each n-1 steps around the ring. Each of the n segments is
cut into chunks of ``chunk_bytes``; a chunk is forwarded to the right neighbour as soon as
it is reduced, so the ring runs as a pipeline rather than step by step, and receiving one
chunk overlaps reducing the previous one. Each segment is reduced once, in a fixed order,
by one rank and then copied to all: every rank ends with the same bits.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..settings import Settings
from .engine import AllreduceCall, Engine, mpi_reduces
from .ops import RING_DTYPES, UFUNC, Op
from .peers import TorchPeers
from .waiting import Deadline, wait, wait_all

_TAG_REDUCE_SCATTER = 11
_TAG_ALLGATHER = 12


def segment_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split range(count) into ``parts`` contiguous pieces whose sizes differ by <= 1."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Ring:
    """Ring allreduce on one communicator; keeps its scratch buffers between calls."""

    def __init__(self, comm: MPI.Intracomm, chunk_bytes: int):
        self.comm = comm
        self.chunk_bytes = chunk_bytes
        self._scratch = np.empty(0, dtype=np.uint8)

    def allreduce(self, buf: np.ndarray, op: Op, deadline: Deadline,
                  divisor: int = 0) -> None:
        """Reduce the 1-D contiguous ``buf`` in place across all ranks (AVERAGE divides
        by ``divisor``, 0: by n)."""
        n, rank = self.comm.Get_size(), self.comm.Get_rank()
        if n == 1 or buf.size == 0:
            return  # the sum, product, min, max or mean of one rank's array is itself
        segments = [buf[a:b] for a, b in segment_bounds(buf.size, n)]
        chunk = max(1, self.chunk_bytes // buf.itemsize)
        with np.errstate(all="ignore"):  # overflow is the op's semantics (as in MPI)
            self._reduce_scatter(segments, op, chunk, deadline)
            owned = segments[(rank + 1) % n]
            if op is Op.AVERAGE:
                np.divide(owned, divisor or n, out=owned)
        self._allgather(segments, chunk, deadline)

    def reduce_scatter(self, buf: np.ndarray, op: Op, bounds: list[tuple[int, int]],
                       deadline: Deadline) -> None:
        """Reduce the 1-D contiguous ``buf`` across all ranks into this rank's part only:
        ``bounds[r]`` ([start, stop) of buf, the same list on every rank, covering buf
        in order) is what rank r ends with reduced; the rest of buf is left partial.
        The ring's first half: (n-1)/n of buf sent and received, where an allreduce
        through an offload moves all of it each way. AVERAGE divides the part by n."""
        n, rank = self.comm.Get_size(), self.comm.Get_rank()
        if n == 1 or buf.size == 0:
            return
        # The ring leaves segment s reduced on rank s - 1: rank r's part goes at r + 1.
        parts = [buf[a:b] for a, b in bounds]
        segments = [parts[(s - 1) % n] for s in range(n)]
        chunk = max(1, self.chunk_bytes // buf.itemsize)
        with np.errstate(all="ignore"):
            self._reduce_scatter(segments, op, chunk, deadline)
            if op is Op.AVERAGE:
                np.divide(parts[rank], n, out=parts[rank])

    def _scratch_pair(self, largest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two receive buffers, each as large as the largest segment."""
        nbytes = largest.nbytes
        if self._scratch.size < 2 * nbytes:
            self._scratch = np.empty(2 * nbytes, dtype=np.uint8)
        return (self._scratch[:nbytes].view(largest.dtype),
                self._scratch[nbytes:2 * nbytes].view(largest.dtype))

    def _reduce_scatter(self, segments: list[np.ndarray], op: Op, chunk: int,
                        deadline: Deadline) -> None:
        comm, n, rank = self.comm, self.comm.Get_size(), self.comm.Get_rank()
        right, left = (rank + 1) % n, (rank - 1) % n
        reduce = UFUNC[op]
        scratch = self._scratch_pair(max(segments, key=lambda s: s.size))

        def post_receives(step: int) -> list[MPI.Request]:
            seg = segments[(rank - step - 1) % n]
            into = scratch[step % 2]
            return [comm.Irecv(into[a:min(a + chunk, seg.size)], left, _TAG_REDUCE_SCATTER)
                    for a in range(0, seg.size, chunk)]

        sends = [comm.Isend(segments[rank][a:a + chunk], right, _TAG_REDUCE_SCATTER)
                 for a in range(0, segments[rank].size, chunk)]
        receives = post_receives(0)
        for step in range(n - 1):
            # Post the next step's receives first, into the other scratch half, so the
            # left neighbour never waits for a posted receive.
            following = post_receives(step + 1) if step + 1 < n - 1 else []
            seg_index = (rank - step - 1) % n
            seg, incoming = segments[seg_index], scratch[step % 2]
            for k, a in enumerate(range(0, seg.size, chunk)):
                wait(receives[k], deadline,
                     lambda: f"rank {left} to send chunk {k} of segment {seg_index} "
                             f"(reduce-scatter step {step + 1} of {n - 1})")
                piece = seg[a:a + chunk]
                reduce(piece, incoming[a:a + piece.size], out=piece)
                if step + 1 < n - 1:
                    sends.append(comm.Isend(piece, right, _TAG_REDUCE_SCATTER))
            receives = following
        wait_all(sends, deadline,
                 lambda: f"rank {right} to receive this rank's reduce-scatter chunks")

    def _allgather(self, segments: list[np.ndarray], chunk: int, deadline: Deadline) -> None:
        comm, n, rank = self.comm, self.comm.Get_size(), self.comm.Get_rank()
        right, left = (rank + 1) % n, (rank - 1) % n
        owned = segments[(rank + 1) % n]
        sends = [comm.Isend(owned[a:a + chunk], right, _TAG_ALLGATHER)
                 for a in range(0, owned.size, chunk)]
        # Every segment this rank receives has its own place in buf: post them all now.
        receives = [[comm.Irecv(segments[(rank - step) % n][a:a + chunk], left, _TAG_ALLGATHER)
                     for a in range(0, segments[(rank - step) % n].size, chunk)]
                    for step in range(n - 1)]
        for step in range(n - 1):
            seg_index = (rank - step) % n
            seg = segments[seg_index]
            for k, a in enumerate(range(0, seg.size, chunk)):
                wait(receives[step][k], deadline,
                     lambda: f"rank {left} to send chunk {k} of segment {seg_index} "
                             f"(allgather step {step + 1} of {n - 1})")
                if step + 1 < n - 1:
                    sends.append(comm.Isend(seg[a:a + chunk], right, _TAG_ALLGATHER))
        wait_all(sends, deadline, lambda: f"rank {right} to receive this rank's allgather chunks")


class RingEngine(Engine):
    name = "ring"

    def __init__(self, comm: MPI.Intracomm | TorchPeers, settings: Settings):
        self.ring = Ring(comm, settings.ring_chunk_bytes)
        self.min_bytes = settings.ring_min_bytes
        # gloo's send and receive (the peers of a job without MPI) end only in a blocking
        # wait, never in a poll: the ring's bounded waits would never see them end.
        self.usable = not isinstance(comm, TorchPeers)

    def declines(self, call: AllreduceCall) -> str | None:
        if not self.usable:
            return ("ring: gloo's point-to-point cannot be polled (no MPI job): gloo's "
                    "allreduce")
        if call.dtype not in RING_DTYPES:
            return f"ring: dtype {call.dtype} is left to MPI"
        if call.nbytes < self.min_bytes and mpi_reduces(call.dtype):
            return f"ring: below ring_min_bytes ({self.min_bytes})"
        return None

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        if call.send is not None:
            np.copyto(call.recv, call.send)
        self.ring.allreduce(call.recv, call.op, deadline,
                            call.divisor(self.ring.comm.Get_size()))

    def reduce_scatter(self, call: AllreduceCall, bounds: list[tuple[int, int]],
                       deadline: Deadline) -> None:
        if call.send is not None:
            raise ValueError("the ring's reduce-scatter is in place (call.send: None)")
        self.ring.reduce_scatter(call.recv, call.op, bounds, deadline)

    def close(self) -> None:
        pass
