"""Check, before any data moves, that every rank called the same collective alike.

Ranks that disagree on length, dtype or op would otherwise deadlock in the ring or
silently mix unrelated data; here every rank raises AgreementError with all ranks' calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError, CommunicatorBroken
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


def agree(comm: MPI.Intracomm, call: CallSignature, seq: int, deadline: Deadline,
          news: int = 0, on_trouble: Callable[[str], None] | None = None) -> int:
    """Raise AgreementError on every rank unless all ranks passed the same signature.
    ``news``: a value that rides along, not compared (rank 0's tells every rank whether
    the aggregator answers again); returns rank 0's. This is the chooser's gate
    (recovery.py): a rank that could not finish its last call posts ``trouble`` instead;
    every rank then runs ``on_trouble`` (the rescue) and agrees again."""
    mine = call.as_array(news)
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    while True:
        request = comm.Iallgather(mine, everyone)
        wait(request, deadline,
             lambda: f"all {comm.Get_size()} ranks to enter allreduce #{seq} "
                     f"(this rank: {call.describe()})")
        if not (everyone[:, 0] == TROUBLE).any():
            break
        if on_trouble is None:
            raise CommunicatorBroken(
                f"rank(s) {np.flatnonzero(everyone[:, 0] == TROUBLE).tolist()} could not "
                f"finish their last switch call, and this communicator cannot help")
        on_trouble(f"the switch call before allreduce #{seq}")
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


def trouble(comm: MPI.Intracomm, seconds: float, what: str) -> None:
    """The chooser's gate from a rank that could not finish ``what`` alone: its row says
    TROUBLE (recovery.py); bounded by ``seconds``."""
    mine = np.zeros(len(CallSignature(0, 0, 0, 0, "").as_array()), np.int64)
    mine[0] = TROUBLE
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    wait(comm.Iallgather(mine, everyone), Deadline(seconds),
         lambda: f"all {comm.Get_size()} ranks to take up the error path of {what}")
