"""The collectives layer: one communicator's allreduce and the engines that can serve it.

``chooser``: Collectives, which checks a call, agrees on it with the other ranks
(``agreement``), offers it to the engines in order and keeps the ``stats``; ``engine``:
the Engine protocol and the call an engine is offered; the engines: ``ina_engine`` (the
aggregator, through ina/), ``ring`` (pipelined ring over mpi4py, the exact fallback) and
``mpi_engine`` (MPI's own Allreduce); ``ops``: reduction ops and dtype rules;
``waiting``: bounded, interruptible waits on MPI requests; ``buffers``: mpi4py buffer
specs as NumPy views (for ina_collectives.mpi).
"""
from __future__ import annotations

from typing import Any

__all__ = ["Collectives"]


def __getattr__(name: str) -> Any:
    # The chooser imports mpi4py.MPI, which initialises MPI: only when it is used, so
    # that ina-run and the switch, which import ops from here, never start MPI.
    if name == "Collectives":
        from .chooser import Collectives
        return Collectives
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
