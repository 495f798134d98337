"""Check, before any data moves, that every rank called the same collective alike.

Ranks that disagree on length, dtype or op would otherwise deadlock in the ring or
silently mix unrelated data; here every rank raises AgreementError with all ranks' calls.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError
from ..protocol import PROPOSAL_NONE
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

    def describe(self) -> str:
        return self.description if isinstance(self.description, str) else self.description()


@dataclass
class Agreed:
    """What the agreement gave every rank: rank 0's ``news``, and the element-wise max of
    the ranks' ``window``s (int16; None if the call passed none). ``trouble``: a rank
    could not finish its last call alone: nothing was agreed, the caller runs the
    rescue (recovery.py) and starts the call again."""

    news: int = 0
    window: np.ndarray | None = None
    trouble: bool = False


def agree(comm: MPI.Intracomm, call: CallSignature, seq: int, deadline: Deadline,
          news: int = 0, window: np.ndarray | None = None, width: int = 0) -> Agreed:
    """Raise AgreementError on every rank unless all ranks passed the same signature.
    ``news``: a value that rides along, not compared (rank 0's tells every rank whether
    what the offload lost answers again). ``window``: up to ``width`` int16 values to
    take the max of over the ranks (the first window's exponent proposals of an offload's
    call);
    ``width`` must be the same on every rank, whatever each one's call. One allgather:
    this is the chooser's gate (recovery.py), where a rank that could not finish its
    last call posts TROUBLE instead (recovery.trouble)."""
    row = _row(width)
    row[:SIGNATURE] = (call.kind, call.count, call.dtype, call.op, news)
    if window is not None:
        row[SIGNATURE:].view(np.int16)[:window.size] = window
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
    mine = np.zeros(DESCRIPTION_BYTES, np.uint8)
    text = call.describe().encode()[:DESCRIPTION_BYTES]
    mine[:len(text)] = np.frombuffer(text, np.uint8)
    rows = np.empty((comm.Get_size(), DESCRIPTION_BYTES), np.uint8)
    wait(comm.Iallgather(mine, rows), deadline,
         lambda: f"every rank's description of allreduce #{seq}")
    descriptions = [row.tobytes().rstrip(b"\0").decode(errors="replace") for row in rows]
    calls = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    fields = [name for i, name in enumerate(("API", "length", "dtype", "op"))
              if not (everyone[:, i] == everyone[0, i]).all()]
    raise AgreementError(f"ranks disagree on the {', '.join(fields)} of allreduce #{seq}: "
                         f"{calls}")


def identity(call: CallSignature, value_bits: int = 0) -> int:
    """What an offload's gate carries for it to compare (the INA engine's gate:
    docs/protocol.md): 48 bits of a hash of what every rank must call alike, the
    signature's compared fields and the width the call asks for."""
    return _identity(call.kind, call.count, call.dtype, call.op, value_bits)


@functools.lru_cache(maxsize=1024)  # (every training step repeats its calls' identities)
def _identity(kind: int, count: int, dtype: int, op: int, value_bits: int) -> int:
    fields = np.array([kind, count, dtype, op, value_bits], "<i8")
    return int.from_bytes(hashlib.blake2b(fields.tobytes(), digest_size=6).digest(), "little")


def disagree(comm: MPI.Intracomm, call: CallSignature, seq: int, deadline: Deadline,
             width: int) -> None:
    """The error path of a gate the offload marked MISMATCH (every rank got the mark):
    one gate by MPI, which names what differs (AgreementError on every rank); if the
    signatures agree, what differed is the width the calls asked for."""
    agree(comm, call, seq, deadline, 0, None, width)
    raise AgreementError(f"ranks disagree on the value width of allreduce #{seq} (the "
                         f"offload saw their calls differ; this rank: {call.describe()})")


SIGNATURE = 5  # the int64 columns of a row before the window: 4 compared, then news
DESCRIPTION_BYTES = 256  # of each rank's description, where the ranks disagree


def columns(width: int) -> int:
    """The int64 columns of a row of a gate of ``width`` window values (a rank in
    trouble posts a row as long: recovery.trouble)."""
    return SIGNATURE + -(-width // 4)


def _row(width: int) -> np.ndarray:
    """A rank's row for a gate of ``width`` window values: the signature's columns, then
    the window's int16 values four to an int64 column, each PROPOSAL_NONE (the smallest
    int16, which loses every max) until set."""
    row = np.empty(columns(width), np.int64)
    row[SIGNATURE:].view(np.int16)[:] = PROPOSAL_NONE
    return row
