"""A call's opening through the switch (docs/protocol.md, "A call's opening"): the
call's identity and its first window's exponents agreed in-band, in one round trip.

This module makes the packets' contents from a prepared call and reads the agreement
back; the engine decides what the outcome means for the call (rescue.py when it
failed).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import protocol as P
from ..collectives.waiting import Deadline
from ..settings import Settings
from .link import Timers, WorkerLink
from .preparing import Prepared

if TYPE_CHECKING:
    from .._fast.transport import Result


def open_call(link: WorkerLink, ident: int, prepared: Prepared | None, call_number: int,
              settings: Settings, deadline: Deadline) -> tuple[str, np.ndarray | None,
                                                                Result]:
    """This rank's opening of call ``call_number`` with identity ``ident``
    (agreement.identity): one packet per slot of the first window (one for a small call,
    or a call another engine serves), proposing ``prepared``'s first exponents and
    whether that window holds a NaN or an Inf. Returns the link's outcome ("done",
    "mismatch" or why it failed), the agreed window in ``Prepared.proposal``'s layout
    (when done and ``prepared`` is a switch call's) and the link's Result (its
    counters)."""
    g = -(-link.k // link.block)
    used = prepared.shares[0].ready if prepared is not None and prepared.shares else 1
    proposals = np.full((used, g), P.PROPOSAL_NONE, np.int16)
    span = 0
    if prepared is not None and prepared.shares:
        a, b = prepared.shares[0].window
        span = b - a
        proposals.reshape(-1)[:span] = prepared.local[a:b]
        if prepared.proposal[0]:  # a NaN or an Inf in the first window
            proposals[0] = P.NONFINITE_MARK
    remaining = max(0.0, deadline.expires - time.monotonic())
    s = settings
    result = link.opening(ident, proposals, call_number, Timers.of(s), remaining)
    outcome = result.reason
    if outcome != "done" or prepared is None:
        return outcome, None, result
    window = np.empty_like(prepared.proposal)
    window[0] = proposals[0, 0] == P.NONFINITE_MARK
    if span:
        window[1:] = proposals.reshape(-1)[:span]
    return outcome, window, result
