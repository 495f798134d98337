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
    """Collective, for a share (chunks c0 .. c1) some rank did not finish: each chunk any
    rank lacks (``missing``: this rank's, relative to c0) is sent to every rank by the
    lowest rank that has it, one broadcast per such rank (at most n). Returns the element
    ranges of the chunks no rank has (for the ring) and the number of chunks repaired
    here. ``collective`` completes a request within a bound, naming what it waited for
    (``Aggregators.collective``)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    marks = np.zeros(c1 - c0, np.uint8)
    marks[missing] = 1
    union = np.empty_like(marks)
    collective(comm.Iallreduce(marks, union, MPI.MAX), "the chunks lost")
    lost = np.flatnonzero(union)
    if lost.size == 0:
        return [], 0
    # Per lost chunk, the lowest rank that has it (n: none has).
    mine = np.where(marks[lost] == 0, rank, n).astype(np.int32)
    owner = np.empty_like(mine)
    collective(comm.Iallreduce(mine, owner, MPI.MIN), "which rank has each lost chunk")

    def span(j: int) -> tuple[int, int]:
        return (c0 + j) * k, min((c0 + j + 1) * k, size)

    repaired = 0
    for root in np.unique(owner).tolist():
        if root == n:
            continue
        ranges = [span(j) for j in lost[owner == root].tolist()]
        total = sum(b - a for a, b in ranges)
        buf = (np.concatenate([out[a:b] for a, b in ranges]) if rank == root
               else np.empty(total, out.dtype))
        collective(comm.Ibcast(buf, root=int(root)),
                   f"rank {root}'s copy of {len(ranges)} chunks")
        if rank != root:
            at = 0
            for a, b in ranges:
                out[a:b] = buf[at:at + b - a]
                at += b - a
        repaired += len(ranges)
    return [span(j) for j in lost[owner == n].tolist()], repaired
