"""A switch-served call's outcome, agreed by every rank: which aggregators' shares
failed, how long each share took, the newest mode the results announced, the quorum
chunks some rank lost, and whether any stream met a NaN or an Inf.

One reduction over the ranks' reports (MAX), so that every rank acts alike on it: hand
a failed share to the ring, repair lost chunks, update the throughput estimates, adopt
a mode. Bounded: a dead peer never reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..collectives.waiting import Deadline, wait

if TYPE_CHECKING:
    from .._fast.transport import Result


@dataclass
class Outcome:
    """What every rank learned of a call; indexed by aggregator."""

    failed: list[int]        # aggregators whose share failed on some rank
    seconds: np.ndarray      # the longest any rank took for each aggregator's share
    mode: int                # the newest mode announced (generation << 8 | k)
    lost: list[int]          # aggregators whose share some rank finished with chunks lost
    nonfinite: bool          # some stream met a NaN or an Inf past the first window


def vote(comm: MPI.Intracomm, aggregators: int, served: list[int],
         results: list[Result], seconds: float, what: str) -> Outcome:
    """Collective: combine every rank's ``results`` of the shares of ``served`` (the
    aggregators this call used, in order) into the Outcome every rank gets alike.
    ``seconds`` bounds the wait; ``what`` names the call in a timeout's message."""
    count = aggregators
    mine = np.zeros(4 * count + 1)
    for i, result in zip(served, results):
        mine[i] = 0 if result.ok else 1
        mine[count + i] = result.seconds
        mine[2 * count + i] = result.mode  # exact in a float64
        mine[3 * count + i] = bool(result.ok and result.missing.size)
        mine[4 * count] = max(mine[4 * count], result.nonfinite)
    votes = np.empty_like(mine)
    here = "; ".join(r.reason for r in results) or "nothing to stream"
    wait(comm.Iallreduce(mine, votes, MPI.MAX), Deadline(seconds),
         lambda: f"all ranks to report the outcome of {what} (this rank: {here})")
    return Outcome([i for i in served if votes[i]], votes[count:2 * count],
                   int(votes[2 * count:3 * count].max(initial=0)),
                   [i for i in served if votes[3 * count + i] and not votes[i]],
                   bool(votes[4 * count]))
