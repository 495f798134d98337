"""The error path of a call that ended without a host collective (docs/protocol-recovery.md,
"A call without a vote: all or nothing"): its neutral part, the gate.

An offload (engine.py: OffloadEngine) may end a call with no host collective of its own
when the call's owner makes one next: a *gate*, the collective every rank makes before
anything else on the communicator (the chooser's agreement, an offload's own gate, or
``Collectives.meet_trouble``, which an owner makes when ranks say they are in trouble
while no gate comes of itself: the runtime, between negotiated rounds).
A rank that cannot finish such a call alone says so in that gate, with ``TROUBLE`` in
the first column of its row (``trouble``); every rank that reads it then takes part in
the offload's rescue (``ErrorPath.rescue``), which may need what a rank kept of
its last call until every rank is past it.

``ErrorPath`` holds a communicator's part of it: whether its owner's next collective is
a gate, and what this rank keeps of its last call (``kept``: the offload's, opaque
here); it is the only writer of both, and the engines reach them through its methods.
Every wait is bounded and says what it waits for.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import CommunicatorBroken
from .waiting import Deadline, wait

# The first column of a gate row from a rank that cannot finish its call alone (the
# gates' own first columns are never negative: a kind of call, a byte count).
TROUBLE = -2


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
    chooser's agreement, an offload's own) and what this rank kept of its last
    call that ended without a host collective. The chooser owns it and the owner of the
    next collective says whether it is a gate (``set_gate``); an engine posts TROUBLE
    (``report``), keeps what the others may need (``keep``) and runs its rescue over
    ``comm``, each wait bounded by ``seconds``."""

    def __init__(self, comm: MPI.Intracomm, seconds: float):
        self.comm, self.seconds = comm, seconds
        self._gate: tuple[Callable[[], int], bool] | None = None
        self._kept: Any = None
        # The offload's number of the call kept (``keep``), and of the call this rank is
        # posting TROUBLE for while it waits in the gate (``report``; None: it is not):
        # an owner whose gate may not come of itself (the runtime, between negotiated
        # rounds) tells the other ranks, which make one (runtime/negotiated.py).
        self.kept_call: int | None = None
        self.reporting: int | None = None
        # The offload's rescue and silence bound (``set_rescue``): none without one.
        self._rescue: Callable[[str], None] | None = None
        self.silence = 0.0

    # -- the rescue ---------------------------------------------------------------------

    def set_rescue(self, rescue: Callable[[str], None] | None, silence: float = 0.0
                   ) -> None:
        """The offload's part in a rescue (``rescue(what)``, collective, when a gate
        showed TROUBLE), and ``silence``, the seconds a call of its goes without an
        answer before it gives up (what bounds the last gate at finalize); None: the
        communicator has no engine that ends calls without a host collective."""
        self._rescue, self.silence = rescue, silence if rescue is not None else 0.0

    def rescue(self, what: str) -> None:
        """Collective, when a gate showed TROUBLE: take part in the rescue of ``what``,
        the call a rank could not finish alone."""
        if self._rescue is None:
            raise CommunicatorBroken(f"a rank could not finish {what}, and this "
                                     "communicator has no engine that ends calls "
                                     "without a host collective")
        self._rescue(what)

    # -- the gate -----------------------------------------------------------------------

    def set_gate(self, columns: Callable[[], int] | None, background: bool = False
                 ) -> None:
        """The owner's next collective is a gate whose rows are ``columns()`` int64 values
        long (``background``: made by the runtime's thread); None: it is not, and calls
        end with a host collective of their own."""
        self._gate = None if columns is None else (columns, background)

    @property
    def gated(self) -> bool:
        return self._gate is not None

    def report(self, what: str, call: int | None = None) -> None:
        """Post TROUBLE in the gate: this rank could not finish ``what`` (the offload's
        call ``call``, if it kept one) alone."""
        if self._gate is None:
            raise CommunicatorBroken(f"{what} needs the error path, and the next "
                                     "collective is not a gate")
        columns, background = self._gate
        self.reporting = call
        try:
            trouble(self.comm, columns(), self.seconds, what, background)
        finally:
            self.reporting = None

    # -- what a rank keeps of its last call ---------------------------------------------

    @property
    def kept(self) -> Any:
        """What this rank keeps of its last call for the others (None: nothing)."""
        return self._kept

    def keep(self, kept: Any, call: int | None = None) -> None:
        self._kept, self.kept_call = kept, call

    def forget(self) -> None:
        """Every rank is past the last call (a gate passed without TROUBLE)."""
        self._kept = self.kept_call = None
