"""The collectives layer: one communicator's allreduce, engine-neutral.

``chooser``: Collectives, which checks a call, agrees on it with the other ranks
(``agreement``), offers it to the engines in order and keeps the ``stats``; ``engine``:
the Engine protocol, the OffloadEngine protocol (the hooks only an engine that serves
calls out of the hosts has) and the call an engine is offered; ``recovery``: the gate of
the error path of a call that ended without a host collective (ErrorPath: the gate and
what a rank keeps of its last call); the exact engines: ``ring`` (pipelined ring over
mpi4py, the fallback) and ``mpi_engine`` (MPI's own Allreduce); the offload is ina/'s,
given to the chooser by the layer above; ``ops``: reduction ops, their names and dtype rules;
``waiting``: bounded, interruptible waits on MPI requests; ``buffers``: mpi4py buffer
specs as NumPy views (for ina_collectives.mpi); ``peers``: the peers without an MPI job.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Collectives"]


def __getattr__(name: str) -> Any:
    # The chooser imports mpi4py.MPI, which initialises MPI: only when it is used, so
    # that the processes that import the package alone (ina-run), and so ops from
    # here, never start MPI.
    if name == "Collectives":
        from .chooser import Collectives
        return Collectives
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
