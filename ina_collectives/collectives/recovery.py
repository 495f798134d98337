"""The error path of a call the switch served without a vote (docs/protocol.md, "A call
without host collectives: all or nothing").

A call streamed through one aggregator in sync mode returns as soon as this rank holds
every result: no rank can hold them all unless every other rank holds all but the last
chunk of each slot (the last window). So each rank keeps a copy of its last window's
final values (``Kept``) until its next call. A rank that cannot finish a call alone (its
stream failed, or a result said some input held a NaN or an Inf) tells the others
through its owner's *gate*, the collective every rank makes before anything else on the
communicator (the chooser's agreement, the runtime's negotiation), with ``TROUBLE`` in
the first column of its row. Every rank then runs ``rescue`` together:

- if some rank finished the call cleanly, the lowest such rank broadcasts its kept
  window and the ranks that lost part of it complete the call from that: every rank
  returns the same bits;
- if none did (every rank is still in the call), every rank hands the whole call over
  to the ring, from its untouched input.

A rank whose *opening* of the next call failed (docs/protocol.md, A call's opening: its
packets through the switch went unanswered) takes the same path with the role
``OPENING``: it finished its last call (and keeps that window) and holds nothing of the
next one. It gives its window to a rank that lacks it, stands in for a rank still in
the call it was opening (every rank then takes that call to the ring), or, where no rank
lacks anything, every rank starts its call again (``restart``).

A rank whose *predicted* call failed (docs/protocol.md, One round trip: the call went
without an opening) takes the role ``PREDICTED``: like ``OPENING`` it finished its last
call and keeps that window, but another rank may have finished this one. Every rank
reads the rows alike: where a rank finished the predicted call, the ranks that failed it
lack part of it (``FAILED``); where none did, they hold nothing of it (``OPENING``).

Both steps are bounded and say what they wait for. ``ErrorPath`` holds a communicator's
part of it: whether its owner's next collective is a gate, and the kept window; it is the
only writer of both, and the engines reach them through its methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import CommunicatorBroken
from .waiting import Deadline, wait

# The first column of a gate row from a rank that cannot finish its call alone (the
# gates' own first columns are never negative: a kind of call, a byte count).
TROUBLE = -2

# What a rank is to the rescue.
CLEAN = 0       # it finished its last call (and keeps its last window, if it was one)
FAILED = 1      # its stream failed: it lacks results of the call
NAN_OR_INF = 2   # it holds every result, one of which said an input held a NaN or an Inf
OPENING = 3     # it finished its last call (keeps its window, if any), could not open the next
PREDICTED = 4   # as OPENING, but the call it could not finish went without an opening


@dataclass
class Kept:
    """A rank's last window of the call it finished last without a vote: the final values
    (the output's dtype) of the elements from ``start`` on."""

    call: int            # the engine's number of the call
    aggregator: int      # which aggregator served it (its index in INA_SWITCH)
    start: int
    values: np.ndarray


@dataclass
class Rescue:
    """What every rank learned: ``values`` (a rank that lacked results: the kept window,
    from element ``start``; else None), whether no rank finished the call (then every rank
    hands it to the ring), the ranks whose streams or openings failed, who sent the
    window, whether the ranks that were opening a call start it again, and the call
    number every rank marks the aggregator lost at (the largest of theirs: the retries
    that follow are then scheduled alike)."""

    values: np.ndarray | None
    start: int
    to_ring: bool
    failed: list[int]
    holder: int | None
    restart: bool = False
    seq: int = 0


def rescue(comm: MPI.Intracomm, role: int, call: int, kept: Kept | None,
           seconds: float, what: str, opening: int = -1, seq: int = 0) -> Rescue:
    """Collective, once a gate showed TROUBLE: this rank's ``role`` in ``call`` (a CLEAN
    or OPENING rank passes its ``kept`` window, if any; an OPENING one the number
    ``opening`` the call it opened would have had). The window goes to every rank in the
    type its holder kept it in (its output's, as every rank's of the call).
    ``seq``: the chooser's call number this rank is at. ``seconds`` bounds each wait;
    ``what`` names the call in a timeout's message."""
    n, me = comm.Get_size(), comm.Get_rank()
    have = kept if role in (CLEAN, OPENING, PREDICTED) else None
    # (the last column: the kept window's dtype, as its character code, so that every
    # rank receives the window in the type the root sends it in)
    mine = np.array([role, call if have is None and role != CLEAN else
                     (have.call if have else -1), have.start if have else -1,
                     have.values.size if have else 0, opening, seq,
                     ord(have.values.dtype.char) if have else 0], np.int64)
    rows = np.empty((n, 7), np.int64)
    wait(comm.Iallgather(mine, rows), Deadline(seconds),
         lambda: f"every rank to say what it holds of {what}, which a rank could not "
                 f"finish alone (this rank: {_ROLES[role]})")
    told = rows.copy()
    role = _read_predicted(told, me) if role == PREDICTED else role
    for r in range(n):
        if told[r, 0] == PREDICTED:
            rows[r, 0] = _read_predicted(told, r)
            if rows[r, 0] == FAILED:  # it lacks part of that call, kept no window of it
                rows[r, 1] = rows[r, 4]
    failed = [r for r in range(n) if rows[r, 0] in (FAILED, OPENING)]
    stuck = [r for r in range(n) if rows[r, 0] in (FAILED, NAN_OR_INF)]
    seq = int(rows[:, 5].max())
    if not stuck:  # only openings failed: nothing of any call is lost, start again
        return Rescue(None, 0, False, failed, None, restart=True, seq=seq)
    target = int(rows[stuck[0], 1])
    if all(rows[r, 0] in (FAILED, NAN_OR_INF)
           or (rows[r, 0] == OPENING and rows[r, 4] == target) for r in range(n)):
        # every rank is still in the call (or was opening it): none returned
        return Rescue(None, 0, True, failed, None, seq=seq)
    troubled = stuck
    holders = [r for r in range(n) if rows[r, 0] in (CLEAN, OPENING) and rows[r, 1] == target]
    if any(rows[r, 0] == NAN_OR_INF for r in troubled) or not holders:
        # (Impossible by the protocol: a rank that finished the call saw every result.)
        raise CommunicatorBroken(
            f"ranks {troubled} could not finish {what} and no rank keeps its last window "
            f"(roles {rows[:, 0].tolist()}, calls {rows[:, 1].tolist()})")
    root = holders[0]
    start, length = int(rows[root, 2]), int(rows[root, 3])
    if me == root:
        buf = have.values
    else:  # (in the root's window's type: a window this rank keeps may be another call's)
        buf = np.empty(length, np.dtype(chr(int(rows[root, 6]))))
    wait(comm.Ibcast(buf, root=root), Deadline(seconds),
         lambda: f"rank {root}'s last window of {what} ({length} values)")
    return Rescue(buf if role == FAILED else None, start, False, failed, root,
                  restart=role == OPENING, seq=seq)


def _read_predicted(rows: np.ndarray, r: int) -> int:
    """What rank r, whose predicted call (its number in column 4) failed, is to the
    rescue: FAILED if some rank finished that call and keeps its window (one at its next
    call's gate, or in its next call itself), else OPENING."""
    call = rows[r, 4]
    if any(rows[q, 0] in (CLEAN, OPENING, PREDICTED) and rows[q, 1] == call
           for q in range(rows.shape[0])):
        return FAILED
    return OPENING


_ROLES = {CLEAN: "finished it", FAILED: "its stream failed",
          NAN_OR_INF: "a result said an input held a NaN or an Inf",
          OPENING: "it finished its last call and could not open the next",
          PREDICTED: "it finished its last call and could not finish the next"}


def trouble(comm: MPI.Intracomm, columns: int, seconds: float, what: str,
            background: bool = False) -> None:
    """A gate from a rank that could not finish ``what`` alone: its row of ``columns``
    int64 values (as long as the others' rows in that gate) says TROUBLE; bounded by
    ``seconds``. ``background``: the caller is the runtime's thread (waiting.wait)."""
    row = np.zeros(columns, np.int64)
    row[0] = TROUBLE
    everyone = np.empty((comm.Get_size(), columns), np.int64)
    wait(comm.Iallgather(row, everyone), Deadline(seconds),
         lambda: f"all {comm.Get_size()} ranks to take up the error path of {what}",
         background=background)


class ErrorPath:
    """One communicator's error path: whether its owner's next collective is a gate (the
    chooser's agreement, the runtime's negotiation) and the window this rank kept of its
    last vote-free call. The chooser owns it and the owner of the next collective says
    whether it is a gate (``set_gate``); an engine posts TROUBLE (``report``), keeps a
    window (``keep``) and runs the rescue (``help``, ``rescue``) through it."""

    def __init__(self, comm: MPI.Intracomm, seconds: float):
        self._comm, self._seconds = comm, seconds
        self._gate: tuple[Callable[[], int], bool] | None = None
        self._kept: Kept | None = None

    # -- the gate -----------------------------------------------------------------------

    def set_gate(self, columns: Callable[[], int] | None, background: bool = False
                 ) -> None:
        """The owner's next collective is a gate whose rows are ``columns()`` int64 values
        long (``background``: made by the runtime's thread); None: it is not, and calls
        end with a vote."""
        self._gate = None if columns is None else (columns, background)

    @property
    def gated(self) -> bool:
        return self._gate is not None

    def report(self, what: str) -> None:
        """Post TROUBLE in the gate: this rank could not finish ``what`` alone."""
        if self._gate is None:
            raise CommunicatorBroken(f"{what} needs the error path, and the next "
                                     "collective is not a gate")
        columns, background = self._gate
        trouble(self._comm, columns(), self._seconds, what, background)

    # -- the kept window ----------------------------------------------------------------

    @property
    def kept(self) -> Kept | None:
        return self._kept

    def keep(self, kept: Kept) -> None:
        self._kept = kept

    def forget(self) -> None:
        """Every rank is past the last call (a gate passed without TROUBLE)."""
        self._kept = None

    # -- the rescue ---------------------------------------------------------------------

    def rescue(self, role: int, call: int, what: str, opening: int = -1, seq: int = 0
               ) -> Rescue:
        """``rescue`` with this rank's kept window, which it then forgets."""
        got = rescue(self._comm, role, call, self._kept, self._seconds, what, opening, seq)
        self._kept = None
        return got

    def help(self, what: str, seq: int) -> tuple[Rescue, Kept | None]:
        """Collective with ranks that could not finish a call (a gate showed TROUBLE):
        this rank finished it, and sends or stands by with its kept window, which it
        returns with what every rank learned."""
        kept = self._kept
        return self.rescue(CLEAN, -1, what, seq=seq), kept
