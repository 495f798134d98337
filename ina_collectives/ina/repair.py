"""Chunks a lagging rank lost in a quorum call (the switch moved their cells on before
its results reached that rank), sent to it by a peer that has them, so that every rank
holds the same bits; what no rank has whole is left to the ring (docs/quorum.md)."""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI


def repair_share(comm: MPI.Intracomm, c0: int, c1: int, missing: np.ndarray,
                 out: np.ndarray, size: int, k: int,
                 collective: Callable[[MPI.Request, str], None]
                 ) -> tuple[list[tuple[int, int]], int]:
    """Collective, for a share (chunks c0 .. c1) some rank did not finish: the chunks any
    rank lacks (``missing``: this rank's, relative to c0) are sent to every rank by the
    lowest rank that has them all. Returns the element ranges no rank has whole (for the
    ring) and the number of chunks repaired here. ``collective`` completes a request
    within a bound, naming what it waited for (``Aggregators.collective``)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    marks = np.zeros(c1 - c0, np.uint8)
    marks[missing] = 1
    union = np.empty_like(marks)
    collective(comm.Iallreduce(marks, union, MPI.MAX), "the chunks lost")
    root = np.array([rank if not marks.any() else n], np.int64)
    lowest = np.empty_like(root)
    collective(comm.Iallreduce(root, lowest, MPI.MIN), "which rank has every chunk")
    ranges = [((c0 + j) * k, min((c0 + j + 1) * k, size))
              for j in np.flatnonzero(union).tolist()]
    if lowest[0] == n:
        return ranges, 0
    total = sum(b - a for a, b in ranges)
    buf = (np.concatenate([out[a:b] for a, b in ranges]) if rank == lowest[0]
           else np.empty(total, out.dtype))
    collective(comm.Ibcast(buf, root=int(lowest[0])),
               f"rank {lowest[0]}'s copy of {len(ranges)} chunks")
    at = 0
    for a, b in ranges:
        out[a:b] = buf[at:at + b - a]
        at += b - a
    return [], len(ranges)
