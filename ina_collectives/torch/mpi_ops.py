"""Horovod's API on PyTorch tensors (``horovod.torch.mpi_ops``'s flat namespace), over the
background runtime.

The job's world (ranks, topology, process sets) is ``runtime.world``; tensor staging
(NumPy views, host copies, the dtype and op tables, requests) is ``staging``. Horovod's
calls on top of them are ``basics`` (init, ranks, process sets, flags, stats),
``handle_table`` (the int handles of ``poll``/``synchronize``), ``reductions``
(allreduce, grouped, sparse) and ``data_ops`` (allgather, broadcast, alltoall,
reducescatter); this module gathers them as Horovod's one namespace and adds the
barrier, the quorum and join. The synchronous calls are autograd Functions.
"""
from __future__ import annotations

from typing import Any

from ..collectives.ops import check_quorum
from ..errors import OperationError as HorovodInternalError
from ..runtime import world as _world
from ..runtime.negotiation import OpRequest
from ..runtime.world import ProcessSet, global_process_set
from .basics import (  # noqa: F401
    add_process_set,
    carry_late_inputs,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    set_member,
    shutdown,
    size,
    stats,
    submitted_together,
    summary,
    switch_min_bytes,
)
from .data_ops import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .handle_table import op_name, poll, register, synchronize
from .reductions import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    sparse_allreduce_async,
)
from .staging import (
    SUPPORTED_DTYPES,  # noqa: F401 - a public name of this module, as before
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
)


class _GlobalSet:
    """The global process set as ina_collectives.stats(), summary() and set_quorum()
    see it after hvd.init() (runtime.world's default group)."""

    def stats(self) -> dict[str, Any]:
        return stats()

    def set_quorum(self, k: int) -> None:
        set_quorum(k)


def _default_group() -> _GlobalSet | None:
    return _GlobalSet() if _world.current() is not None else None


_world.provide_default_group(_default_group)


# -- what is out of scope, named --------------------------------------------------------------


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not supported: ina_collectives writes no Horovod timeline (its counters are in
    stats())."""
    raise NotImplementedError("the Horovod timeline is not implemented by ina_collectives; "
                              "hvd.stats() reports the calls, engines and fusion")


def stop_timeline() -> None:
    """Not supported: ina_collectives writes no Horovod timeline (NotImplementedError)."""
    raise NotImplementedError("the Horovod timeline is not implemented by ina_collectives")


# -- barrier and join ------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    member = set_member(process_set, "barrier")
    request = OpRequest("barrier", op_name("barrier", None, member), "none", "uint8")
    handle = member.runtime.submit(request)
    synchronize(register([handle], lambda _: None, "every rank to reach the barrier"))


def set_quorum(k: int, process_set: ProcessSet = global_process_set) -> None:
    """Quorum mode for the allreduces submitted after this call (every rank calls it with
    the same k): the switch completes each chunk when k workers contributed, so a
    straggler does not set the pace; a worker left out of a chunk has its gradient
    dropped for that step, and Average divides by the workers counted. 0: sync.
    ``stats()["switch"]["quorum"]`` says which ranks the last call left out
    (docs/quorum.md)."""
    check_quorum(k)
    member = set_member(process_set, "set_quorum")
    request = OpRequest("quorum", op_name("set_quorum", None, member), "none", "uint8",
                        shape=(int(k),))
    handle = member.runtime.submit(request)
    synchronize(register([handle], lambda _: None, "every rank to set the quorum"))


def join(device: int = -1) -> int:
    """This rank has no more batches: until every rank has joined, it takes part in the
    others' allreduces with zeros. Returns the rank that joined last."""
    runtime = _world.require().runtime
    handle = runtime.join()
    return handle.wait(runtime.wait_seconds(), "every rank to join")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "stats", "summary", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
    "set_quorum",
    "synchronize", "sparse_allreduce_async", "start_timeline", "stop_timeline",
]
