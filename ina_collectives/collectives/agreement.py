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
from .waiting import Deadline, wait


@dataclass(frozen=True)
class CallSignature:
    """What every rank must agree on for one collective call."""

    kind: int          # which API path: 0 = array engines, 1 = handed to MPI, 2 = objects
    count: int         # elements (-1 where not known)
    dtype: int         # ops.dtype_code, or -1
    op: int            # index of the op, or -1
    # For the error message only, never compared: a text, or a function that makes it
    # (the text of every call would cost more than the rest of the signature).
    description: str | Callable[[], str]

    ARRAYS = 0
    MPI_DIRECT = 1
    OBJECTS = 2

    def as_array(self, news: int = 0) -> np.ndarray:
        """The compared fields, and ``news`` after them."""
        return np.array([self.kind, self.count, self.dtype, self.op, news], dtype=np.int64)

    def describe(self) -> str:
        return self.description if isinstance(self.description, str) else self.description()


def agree(comm: MPI.Intracomm, call: CallSignature, seq: int, deadline: Deadline,
          news: int = 0) -> int:
    """Raise AgreementError on every rank unless all ranks passed the same signature.
    ``news``: a value that rides along, not compared (rank 0's tells every rank whether
    the aggregator answers again); returns rank 0's."""
    mine = call.as_array(news)
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    request = comm.Iallgather(mine, everyone)
    wait(request, deadline,
         lambda: f"all {comm.Get_size()} ranks to enter allreduce #{seq} "
                 f"(this rank: {call.describe()})")
    compared = everyone[:, :-1]
    if (compared == compared[0]).all():
        return int(everyone[0, -1])
    # Every rank saw the same table, so every rank takes this branch together.
    descriptions = comm.allgather(call.describe())
    calls = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    fields = [name for i, name in enumerate(("API", "length", "dtype", "op"))
              if not (everyone[:, i] == everyone[0, i]).all()]
    raise AgreementError(f"ranks disagree on the {', '.join(fields)} of allreduce #{seq}: "
                         f"{calls}")
