"""Check, before any data moves, that every rank called the same collective alike.

Ranks that disagree on length, dtype or op would otherwise deadlock in the ring or
silently mix unrelated data; here every rank raises AgreementError with all ranks' calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError
from .recovery import TROUBLE
from .waiting import Deadline, wait


@dataclass(frozen=True)
class CallSignature:
    """What every rank must agree on for one collective call."""

    kind: int          # which API path: 0 = array engines, 1 = handed to MPI, 2 = objects,
    #                    3 = finalize
    count: int         # elements (-1 where not known)
    dtype: int         # ops.dtype_code, or -1
    op: int            # index of the op, or -1
    # For the error message only, never compared: a text, or a function that makes it
    # (the text of every call would cost more than the rest of the signature).
    description: str | Callable[[], str]

    ARRAYS = 0
    MPI_DIRECT = 1
    OBJECTS = 2
    FINISH = 3     # the communicator's last gate (Collectives.finish_calls)

    def as_array(self, news: int = 0) -> np.ndarray:
        """The compared fields, and ``news`` after them."""
        return np.array([self.kind, self.count, self.dtype, self.op, news], dtype=np.int64)

    def describe(self) -> str:
        return self.description if isinstance(self.description, str) else self.description()


@dataclass
class Agreed:
    """What the agreement gave every rank: rank 0's ``news``, and the element-wise max of
    the ranks' ``window``s (int16; None if the call passed none). ``trouble``: a rank
    could not finish its last switch call: nothing was agreed, the caller runs the
    rescue (recovery.py) and starts the call again."""

    news: int = 0
    window: np.ndarray | None = None
    trouble: bool = False


def agree(comm: MPI.Intracomm, call: CallSignature, seq: int, deadline: Deadline,
          news: int = 0, window: np.ndarray | None = None) -> Agreed:
    """Raise AgreementError on every rank unless all ranks passed the same signature.
    ``news``: a value that rides along, not compared (rank 0's tells every rank whether
    the aggregator answers again). ``window``: int16 values to take the max of over the
    ranks (the first window's exponent proposals of a switch call), the same length on
    every rank. One allgather: this is the chooser's gate (recovery.py), where a rank
    that could not finish its last call posts ``trouble`` instead."""
    row = _row(call.as_array(news), window)
    everyone = np.empty((comm.Get_size(), row.size), dtype=np.int64)
    wait(comm.Iallgather(row, everyone), deadline,
         lambda: f"all {comm.Get_size()} ranks to enter allreduce #{seq} "
                 f"(this rank: {call.describe()})")
    if (everyone[:, 0] == TROUBLE).any():
        return Agreed(trouble=True)
    compared = everyone[:, :SIGNATURE - 1]
    if (compared == compared[0]).all():
        agreed = None
        if window is not None:
            agreed = everyone[:, SIGNATURE:].copy().view(np.int16).max(axis=0)[:window.size]
        return Agreed(int(everyone[0, SIGNATURE - 1]), agreed)
    # Every rank saw the same table, so every rank takes this branch together.
    descriptions = comm.allgather(call.describe())
    calls = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    fields = [name for i, name in enumerate(("API", "length", "dtype", "op"))
              if not (everyone[:, i] == everyone[0, i]).all()]
    raise AgreementError(f"ranks disagree on the {', '.join(fields)} of allreduce #{seq}: "
                         f"{calls}")


SIGNATURE = 5  # the int64 columns of a row before the window: 4 compared, then news


def _row(signature: np.ndarray, window: np.ndarray | None) -> np.ndarray:
    """One rank's row: the signature's columns, then the window's int16 values four to
    an int64 column (padded with the smallest int16, which loses every max)."""
    if window is None or window.size == 0:
        return signature
    packed = np.full(-(-window.size // 4) * 4, np.iinfo(np.int16).min, np.int16)
    packed[:window.size] = window
    return np.concatenate([signature, packed.view(np.int64)])


def trouble(comm: MPI.Intracomm, seconds: float, what: str, window: int) -> None:
    """The chooser's gate from a rank that could not finish ``what`` alone: its row says
    TROUBLE (recovery.py), as long as the others' (``window``: the int16 values they
    pass); bounded by ``seconds``."""
    row = _row(np.zeros(SIGNATURE, np.int64), np.zeros(window, np.int16) if window else None)
    row[0] = TROUBLE
    everyone = np.empty((comm.Get_size(), row.size), dtype=np.int64)
    wait(comm.Iallgather(row, everyone), Deadline(seconds),
         lambda: f"all {comm.Get_size()} ranks to take up the error path of {what}")
