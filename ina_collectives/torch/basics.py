"""The Horovod API's basics on PyTorch (Horovod's common/basics.py): init and shutdown,
the job's ranks and topology, the process sets, the *_built and *_enabled flags, and the
counters (stats, summary). The job's world is ``runtime.world``."""
from __future__ import annotations

import atexit
from typing import Any, Sequence

from ..runtime import world as _world
from ..runtime.world import ProcessSet, SetMember, global_process_set
from ..settings import Settings, horovod_environment
from . import handle_table
from .sparse import table_stats
from .staging import (
    SUPPORTED_DTYPES,  # noqa: F401 - a public name of this module, as before
)

# -- start and stop ----------------------------------------------------------------------

def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None,
         **settings: Any) -> None:
    """Start the runtime on ``comm``: None (MPI.COMM_WORLD), a list of COMM_WORLD ranks,
    or an mpi4py communicator. Collective over that communicator (a list: over
    COMM_WORLD). ``process_sets``: ProcessSets to register now (every rank passes the
    same list), or "dynamic" (accepted: sets can always be added later). Idempotent: a
    second call while initialized does nothing. Keyword arguments are library settings
    (``ina_collectives.Settings``); Horovod's variables set the settings they share."""
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                raise TypeError(f"init(process_sets=...) takes ProcessSet objects, got "
                                f"{type(ps).__name__}")
    elif process_sets not in (None, "dynamic"):
        raise ValueError(f"init(process_sets={process_sets!r}): give a list of ProcessSet "
                         f"or 'dynamic'")
    if _world.current() is not None:
        return
    loaded = Settings.load({**horovod_environment(), **settings})
    _world.start(comm, process_sets if isinstance(process_sets, list) else None, loaded)


def shutdown() -> None:
    """Stop the background thread (on every rank: the others' pending operations fail)
    and free the communicator. Idempotent; init() may be called again."""
    if _world.current() is None:
        return
    _world.stop()
    handle_table.clear()


atexit.register(shutdown)  # registered after mpi4py's finalize, so it runs before it


def is_initialized() -> bool:
    """Whether hvd.init() has run (and shutdown() has not since)."""
    return _world.current() is not None


# -- process sets ------------------------------------------------------------------------

def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set of global ranks and return it. Collective: every rank
    calls it with the same ranks, members or not (ValueError on every rank if they
    differ or the set exists already)."""
    return _world.require().add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective, as add_process_set). Returns False for the
    global set or a set that is not registered; pending operations on it fail."""
    return _world.require().remove(process_set)


def set_member(process_set: Any, what: str) -> SetMember:
    """This rank's part of ``process_set`` for the call ``what`` (ValueError if it is
    not a member)."""
    return _world.require().member(process_set, what)


def submitted_together(process_set: Any = global_process_set) -> Any:
    """A context: the operations of ``process_set`` started inside are ready, and fused,
    together (as a grouped allreduce's)."""
    return set_member(process_set, "submitted_together").runtime.together()


def carry_late_inputs(names: Any, process_set: Any = global_process_set) -> None:
    """Quorum mode running ahead (docs/quorum.md): allreduce inputs of these names that
    this rank submits after the others ran them without it are added to its next
    submission of the same name, not dropped (DistributedOptimizer's gradients)."""
    set_member(process_set, "carry_late_inputs").runtime.carry_late_inputs(names)


def switch_min_bytes(process_set: Any = global_process_set) -> int:
    """The fewest bytes an allreduce of ``process_set`` needs for the switch to serve it
    (its runtime's setting ``switch_min_bytes``)."""
    return set_member(process_set, "switch_min_bytes").runtime.settings.switch_min_bytes


def size() -> int:
    """The number of ranks in the job."""
    return _world.require().size


def rank() -> int:
    """This process's rank in the job."""
    return _world.require().rank


def local_size() -> int:
    """The number of ranks on this host."""
    return _world.require().local_size


def local_rank() -> int:
    """This process's rank among the ranks on this host."""
    return _world.require().local_rank


def cross_size() -> int:
    """The number of hosts with a rank of this local rank."""
    return _world.require().cross_size


def cross_rank() -> int:
    """This host's rank among the hosts (ranks of this local rank)."""
    return _world.require().cross_rank


def mpi_threads_supported() -> bool:
    """Whether MPI runs with THREAD_MULTIPLE. Like Horovod, only after init()."""
    _world.require()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return _world.require().homogeneous


# What this library is built with, under Horovod's names: MPI is its controller and
# transport; it has no Gloo controller and no GPU (NCCL, CUDA, ROCm), DDL or oneCCL code.

def mpi_enabled() -> bool:
    """True: the ranks talk through MPI (mpi4py)."""
    return True


def mpi_built() -> bool:
    """True: built with MPI (mpi4py)."""
    return True


def gloo_enabled() -> bool:
    """False: Horovod's gloo controller is not used (torch.distributed's gloo is)."""
    return False


def gloo_built() -> bool:
    """False: Horovod's gloo controller is not built."""
    return False


def nccl_built() -> int:
    """0: Horovod returns the NCCL version code here, or 0 without NCCL."""
    return 0


def ddl_built() -> bool:
    """False: no DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: no CUDA collectives (CUDA tensors are staged through the host)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm collectives."""
    return False


def stats(process_set: ProcessSet = global_process_set) -> dict[str, Any]:
    """Calls, bytes and engines of the set's reductions so far, fusion counters, and per
    sparse tensor its hot rows and traffic ("sparse"); as ina_collectives.stats()
    otherwise (the switch, this rank's packets, the kernels)."""
    runtime = set_member(process_set, "stats").runtime
    return {**runtime.stats(), "sparse": table_stats(runtime)}


def summary(process_set: ProcessSet = global_process_set) -> str:
    """stats() in one paragraph, to print at the end of training (rank 0 only, say):
    what the switch served, what took which other engine, why the switch did not
    serve, its state, this rank's packets, the kernels (ina_collectives.summary())."""
    return set_member(process_set, "stats").runtime.summary()
