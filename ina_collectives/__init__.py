"""ina_collectives: allreduce computed in the network, with a ring fallback over mpi4py.

    import ina_collectives as ina
    ina.init()                                  # MPI.COMM_WORLD, settings from INA_*
    total = ina.allreduce(grad)                 # SUM over all ranks, a new array
    ina.allreduce(grad, op=ina.AVERAGE, out=grad)
    ina.stats()                                 # which engine served, bytes, reasons
    ina.set_quorum(3)                           # chunks complete with 3 workers' values

For mpi4py code: ``ina_collectives.mpi.Intracomm(MPI.COMM_WORLD)`` is a drop-in
communicator; for Horovod scripts, ``import ina_collectives.torch as hvd``. Settings:
``python -m ina_collectives.settings`` or docs/settings.md.

The layers, top to bottom (docs/architecture.md): the APIs (this module, ``mpi``,
``torch``); ``runtime`` (the Horovod API's background runtime); ``collectives`` (the
engine choice, the ring and MPI engines); ``ina`` (the worker's link to the aggregator
and the kernels, compiled in ``_fast``); ``protocol`` (the wire format); ``switch`` (the
software aggregator); ``control`` (P4Runtime controller); ``launch`` (``ina-run``).
``errors`` holds every exception type, ``settings`` every setting.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .collectives.ops import AVERAGE, MAX, MIN, PROD, SUM, Op
from .errors import (
    AggregatorUnavailable,
    AgreementError,
    CollectiveTimeout,
    CommunicatorBroken,
    InaError,
    OperationError,
)

__version__ = "0.1.0"
__all__ = [
    "init", "finalize", "is_initialized", "allreduce", "stats", "summary", "set_quorum",
    "last_call_counted", "rank", "size",
    "Op", "SUM", "PROD", "MIN", "MAX", "AVERAGE", "Settings",
    "InaError", "AgreementError", "CollectiveTimeout", "CommunicatorBroken",
    "AggregatorUnavailable", "OperationError",
]

_state = None  # the Collectives of init()'s communicator


def init(comm: Any = None, **settings: Any) -> None:
    """Start the library on ``comm`` (default MPI.COMM_WORLD); collective over comm.

    Keyword arguments override INA_* environment variables (see Settings). Calling it
    again with no arguments does nothing; with arguments it needs finalize() first.
    """
    global _state
    if _state is not None:
        if comm is None and not settings:
            return
        raise RuntimeError("ina_collectives is already initialized; call finalize() first "
                           "to change the communicator or settings")
    from mpi4py import MPI

    from .collectives import Collectives
    from .ina.offload import ABSENT, offload_for
    from .settings import Settings

    loaded = Settings.load(settings)
    _state = Collectives(MPI.COMM_WORLD if comm is None else comm, loaded,
                         offload_for(loaded), ABSENT)


def finalize() -> None:
    """Release the library's communicator; init() may be called again. Idempotent."""
    global _state
    if _state is not None:
        _state.free()
        _state = None


def is_initialized() -> bool:
    """Whether init() has run (and finalize() has not since)."""
    return _state is not None


def _require() -> Any:
    if _state is None:
        raise RuntimeError("ina_collectives is not initialized: call ina_collectives.init() first")
    return _state


def rank() -> int:
    """This process's rank in init()'s communicator."""
    return _require().rank


def size() -> int:
    """The number of ranks in init()'s communicator."""
    return _require().size


def allreduce(array: Any, op: Any = SUM, out: np.ndarray | None = None) -> np.ndarray:
    """Reduce ``array`` element-wise over all ranks; collective.

    op: SUM (default), PROD, MIN, MAX, AVERAGE (floats), as Op, name or MPI.Op.
    out: where to write the result (may be ``array`` itself); a new array if None.
    Returns ``out``. Every rank gets the same bits.
    """
    return _require().allreduce(array, op, out)


def stats() -> dict[str, Any]:
    """Counters since init(): calls, bytes, calls and bytes per engine (ina: the switch;
    ring; mpi, or gloo without an MPI job), fallback reasons (why an engine declined a
    call, with counts), the last call's engine, the switch's state, this rank's packet
    counters ("transport") and the kernels the switch engine runs ("kernels": "fast",
    compiled, or "numpy", the reference; None without a switch).

    Without init(): those of the API the process started instead: the Horovod API's
    (hvd.init(), its global process set), torch.distributed's default group of backend
    "ina" or the group a DDP hook made (torch.hooks.allreduce_hook), or the first
    ``ina_collectives.mpi.Intracomm`` made and not freed. RuntimeError if none is."""
    group = _default_group()
    if group is not None:
        return group.stats()
    if _state is None:
        raise RuntimeError("ina_collectives has no counters yet: none of its APIs is "
                           "started (ina_collectives.init(), hvd.init(), "
                           "ina_collectives.mpi.Intracomm(comm), "
                           "init_process_group('ina') or a DDP hook's first bucket)")
    return _state.stats.snapshot()


def summary() -> str:
    """stats() in one paragraph, to print at the end of training (under any API, as
    stats()): the share of calls and bytes the switch served, what took which other
    engine, why the switch did not serve, the switch's state, the packets this rank sent
    and the kernels."""
    from .ina.summary import summarize

    return summarize(stats())


def set_quorum(k: int) -> None:
    """Quorum mode from the next allreduce on; collective, every rank the same k. The
    switch completes each chunk when k workers contributed, so a straggler does not set
    the pace; a worker left out of a chunk has its values dropped for that step, and an
    AVERAGE divides by the workers counted (docs/quorum.md). 0: sync (every worker).
    Calls on the ring are exact and unaffected. Without init(), on the API the process
    started instead, as stats()."""
    group = _default_group()
    if group is not None:
        group.set_quorum(k)
        return
    _require().set_quorum(k)


def _default_group() -> Any:
    """Without init(): the default group a binding registered (the Horovod API's world,
    torch.distributed's group of backend "ina", an mpi4py Intracomm), or None. Imported
    here, not above: the runtime starts MPI."""
    if _state is not None:
        return None
    from .runtime import world
    return world.default_group()


def last_call_counted() -> bool:
    """False if the last switch-served allreduce left this rank's values out of some
    chunk (quorum mode; stats()["switch"]["quorum"] has the counts and which ranks)."""
    switch = stats().get("switch") or {}
    return bool(switch.get("quorum", {}).get("last_call", {}).get("counted", True))


def __getattr__(name: str) -> Any:
    # Imported on first use, so that ``python -m ina_collectives.settings`` runs the
    # module fresh (runpy warns about a module the package already imported).
    if name == "Settings":
        from .settings import Settings
        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
