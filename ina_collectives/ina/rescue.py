"""The rescue of a call the switch served without a vote (docs/protocol-recovery.md, "A call
without a vote: all or nothing"); the gate it starts from is
collectives/recovery.py's.

A call streamed through one aggregator in sync mode returns as soon as this rank holds
every result: no rank can hold them all unless every other rank holds all but the last
chunk of each slot (the last window). So each rank keeps a copy of its last window's
final values (``Kept``, in the communicator's ErrorPath) until its next call. A rank
that cannot finish a call alone (its stream failed, or a result said some input held a
NaN or an Inf) posts TROUBLE in the next gate; every rank then runs ``rescue`` together:

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

Both steps are bounded and say what they wait for.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..collectives.recovery import ErrorPath
from ..collectives.waiting import Deadline, wait
from ..errors import CommunicatorBroken


class Role(enum.IntEnum):
    """What a rank is to the rescue (the first column of its row)."""

    CLEAN = 0       # it finished its last call (and keeps its last window, if it was one)
    FAILED = 1      # its stream failed: it lacks results of the call
    NAN_OR_INF = 2  # it holds every result, one of which said an input held a NaN or an Inf
    OPENING = 3     # it finished its last call (keeps its window, if any), could not open
    #                 the next
    PREDICTED = 4   # as OPENING, but the call it could not finish went without an opening


_SAYS = {Role.CLEAN: "finished it", Role.FAILED: "its stream failed",
         Role.NAN_OR_INF: "a result said an input held a NaN or an Inf",
         Role.OPENING: "it finished its last call and could not open the next",
         Role.PREDICTED: "it finished its last call and could not finish the next"}
_KEEPERS = (Role.CLEAN, Role.OPENING, Role.PREDICTED)  # (a rank that may keep a window)


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
    # The switch calls the ranks have numbered, the largest of theirs: a rank whose
    # opening failed numbered one fewer than a rank whose stream then failed, and every
    # rank numbers the next switch call alike from this (the switch compares numbers).
    switch_calls: int = 0


@dataclass(frozen=True)
class Holding:
    """What one rank brings to a rescue: its ``role`` in ``call``; a CLEAN or OPENING
    rank's ``kept`` window, if any; an OPENING one's number ``opening`` the call it
    opened would have had; ``seq``, the chooser's call number this rank is at;
    ``switch_calls``, the switch calls this rank has numbered (Quorum.calls)."""

    role: Role
    call: int
    kept: Kept | None = None
    opening: int = -1
    seq: int = 0
    switch_calls: int = 0


def rescue(comm: MPI.Intracomm, holding: Holding, seconds: float, what: str) -> Rescue:
    """Collective, once a gate showed TROUBLE: every rank says what it holds
    (``holding``), and the window goes to the ranks that lack it, in the type its holder
    kept it in (its output's, as every rank's of the call). ``seconds`` bounds each wait;
    ``what`` names the call in a timeout's message."""
    role, call, kept = Role(holding.role), holding.call, holding.kept
    opening, seq, switch_calls = holding.opening, holding.seq, holding.switch_calls
    n, me = comm.Get_size(), comm.Get_rank()
    have = kept if role in _KEEPERS else None
    # (the last column: the kept window's dtype, as its character code, so that every
    # rank receives the window in the type the root sends it in)
    mine = np.array([role, call if have is None and role != Role.CLEAN else
                     (have.call if have else -1), have.start if have else -1,
                     have.values.size if have else 0, opening, seq,
                     ord(have.values.dtype.char) if have else 0, switch_calls], np.int64)
    rows = np.empty((n, 8), np.int64)
    wait(comm.Iallgather(mine, rows), Deadline(seconds),
         lambda: f"every rank to say what it holds of {what}, which a rank could not "
                 f"finish alone (this rank: {_SAYS[role]})")
    told = rows.copy()
    role = _read_predicted(told, me) if role == Role.PREDICTED else role
    for r in range(n):
        if told[r, 0] == Role.PREDICTED:
            rows[r, 0] = _read_predicted(told, r)
            if rows[r, 0] == Role.FAILED:  # it lacks part of that call, kept no window
                rows[r, 1] = rows[r, 4]
    failed = [r for r in range(n) if rows[r, 0] in (Role.FAILED, Role.OPENING)]
    stuck = [r for r in range(n) if rows[r, 0] in (Role.FAILED, Role.NAN_OR_INF)]
    seq, numbered = int(rows[:, 5].max()), int(rows[:, 7].max())
    if not stuck:  # only openings failed: nothing of any call is lost, start again
        return Rescue(None, 0, False, failed, None, restart=True, seq=seq,
                      switch_calls=numbered)
    target = int(rows[stuck[0], 1])
    if all(rows[r, 0] in (Role.FAILED, Role.NAN_OR_INF)
           or (rows[r, 0] == Role.OPENING and rows[r, 4] == target) for r in range(n)):
        # every rank is still in the call (or was opening it): none returned
        return Rescue(None, 0, True, failed, None, seq=seq, switch_calls=numbered)
    holders = [r for r in range(n)
               if rows[r, 0] in (Role.CLEAN, Role.OPENING) and rows[r, 1] == target]
    if any(rows[r, 0] == Role.NAN_OR_INF for r in stuck) or not holders:
        # (Impossible by the protocol: a rank that finished the call saw every result.)
        raise CommunicatorBroken(
            f"ranks {stuck} could not finish {what} and no rank keeps its last window "
            f"(roles {rows[:, 0].tolist()}, calls {rows[:, 1].tolist()})")
    root = holders[0]
    start, length = int(rows[root, 2]), int(rows[root, 3])
    if me == root:
        buf = have.values
    else:  # (in the root's window's type: a window this rank keeps may be another call's)
        buf = np.empty(length, np.dtype(chr(int(rows[root, 6]))))
    wait(comm.Ibcast(buf, root=root), Deadline(seconds),
         lambda: f"rank {root}'s last window of {what} ({length} values)")
    return Rescue(buf if role == Role.FAILED else None, start, False, failed, root,
                  restart=role == Role.OPENING, seq=seq, switch_calls=numbered)


def _read_predicted(rows: np.ndarray, r: int) -> Role:
    """What rank r, whose predicted call (its number in column 4) failed, is to the
    rescue: FAILED if some rank finished that call and keeps its window (one at its next
    call's gate, or in its next call itself), else OPENING."""
    call = rows[r, 4]
    if any(rows[q, 0] in _KEEPERS and rows[q, 1] == call for q in range(rows.shape[0])):
        return Role.FAILED
    return Role.OPENING


def take_part(errors: ErrorPath, role: Role, call: int, what: str, opening: int = -1,
              seq: int = 0, switch_calls: int = 0) -> Rescue:
    """``rescue`` over the communicator's error path, with the window this rank kept
    there, which it then forgets."""
    got = rescue(errors.comm, Holding(role, call, errors.kept, opening, seq, switch_calls),
                 errors.seconds, what)
    errors.forget()
    return got


def stand_by(errors: ErrorPath, what: str, seq: int,
             switch_calls: int = 0) -> tuple[Rescue, Kept | None]:
    """Collective with ranks that could not finish a call (a gate showed TROUBLE): this
    rank finished it, and sends or stands by with its kept window, which it returns with
    what every rank learned."""
    kept = errors.kept
    return take_part(errors, Role.CLEAN, -1, what, seq=seq,
                     switch_calls=switch_calls), kept
