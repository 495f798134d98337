"""Horovod's API on PyTorch tensors, over the background runtime.

The job's world (ranks, topology, process sets) is ``runtime.world``; tensor staging
(NumPy views, host copies, the dtype and op tables, requests) is ``staging``. This module
is Horovod's calls on top of them: every async call returns an int handle for
``poll``/``synchronize``; the synchronous calls are autograd Functions.
"""
from __future__ import annotations

import atexit
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..collectives.ops import check_quorum
from ..errors import CollectiveTimeout, InaError, OperationError, OperationTimeout
from ..errors import OperationError as HorovodInternalError
from ..runtime import world as _world
from ..runtime.background import Handle
from ..runtime.handle_group import HandleGroup
from ..runtime.negotiation import OpRequest
from ..runtime.world import ProcessSet, SetMember, global_process_set
from ..settings import Settings, horovod_environment
from .compression import Compression, Compressor, switch_values
from .sparse import check_sparse, submit_sparse, table_stats
from .staging import (
    SUPPORTED_DTYPES,  # noqa: F401 - a public name of this module, as before
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    check_tensor,
    copy_from,
    data_request,
    direct,
    from_numpy,
    op_of,
    reduction_request,
    submit_allreduce,
    to_numpy,
)

_handles: dict[int, "_Pending"] = {}
_handle_ids = itertools.count(1)


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
    _handles.clear()


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


def _member(process_set: Any, what: str) -> SetMember:
    return _world.require().member(process_set, what)


def submitted_together(process_set: Any = global_process_set) -> Any:
    """A context: the operations of ``process_set`` started inside are ready, and fused,
    together (as a grouped allreduce's)."""
    return _member(process_set, "submitted_together").runtime.together()


def carry_late_inputs(names: Any, process_set: Any = global_process_set) -> None:
    """Quorum mode running ahead (docs/quorum.md): allreduce inputs of these names that
    this rank submits after the others ran them without it are added to its next
    submission of the same name, not dropped (DistributedOptimizer's gradients)."""
    _member(process_set, "carry_late_inputs").runtime.carry_late_inputs(names)


def switch_min_bytes(process_set: Any = global_process_set) -> int:
    """The fewest bytes an allreduce of ``process_set`` needs for the switch to serve it
    (its runtime's setting ``switch_min_bytes``)."""
    return _member(process_set, "switch_min_bytes").runtime.settings.switch_min_bytes


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
    runtime = _member(process_set, "stats").runtime
    return {**runtime.stats(), "sparse": table_stats(runtime)}


def summary(process_set: ProcessSet = global_process_set) -> str:
    """stats() in one paragraph, to print at the end of training (rank 0 only, say):
    what the switch served, what took which other engine, why the switch did not
    serve, its state, this rank's packets, the kernels (ina_collectives.summary())."""
    return _member(process_set, "stats").runtime.summary()


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


# -- handles -------------------------------------------------------------------------------

@dataclass
class _Pending:
    handles: list[Handle]
    complete: Callable[[list[Any]], Any]   # the runtime's results -> what synchronize returns
    what: str


def _register(handles: list[Handle], complete: Callable[[list[Any]], Any], what: str) -> int:
    handle_id = next(_handle_ids)
    _handles[handle_id] = _Pending(handles, complete, what)
    return handle_id


def poll(handle: int) -> bool:
    """True once the operation of ``handle`` has finished (synchronize will not wait)."""
    try:
        pending = _handles[handle]
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    return all(h.done() for h in pending.handles)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output. Raises the operation's
    error (RuntimeError: ranks disagreed, it stalled, a peer died) on every rank."""
    try:
        pending = _handles.pop(handle)
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    runtime = _world.require().runtime
    try:  # every handle waited on, so that each name is free again
        results = HandleGroup(pending.handles, pending.what).wait(runtime.wait_seconds())
    except OperationError:
        raise
    except InaError as exc:
        # Horovod raises HorovodInternalError for every failure of an operation.
        kind = OperationTimeout if isinstance(exc, CollectiveTimeout) else OperationError
        raise kind(f"{pending.what} failed: {exc}") from exc
    return pending.complete(results)


# -- names ---------------------------------------------------------------------------------

def _name(kind: str, name: str | None, member: SetMember) -> str:
    if name is None:
        return member.next_name(kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


# -- allreduce ---------------------------------------------------------------------------------

def _submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, name: str | None,
                      op: str, prescale: float, postscale: float,
                      process_set: ProcessSet, priority: int | None = None) -> int:
    member = _member(process_set, "allreduce")
    handle, finish = submit_allreduce(member.runtime, tensor, output,
                                      _name("allreduce", name, member), op, prescale,
                                      postscale, priority)
    return _register([handle], lambda results: finish(results[0]),
                     f"allreduce '{handle.request.name}' on all ranks")


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    priority: int | None = None) -> int:
    """Start reducing ``tensor`` over the ranks of ``process_set`` into a new tensor;
    returns a handle. The default op is Average. The input is not modified.
    ``priority`` (not in Horovod): among allreduces ready together, a lower one runs
    sooner (docs/ordering.md); every rank must give the same. None: 0, or the
    enclosing ``ina_collectives.torch.overlap.priority`` block's."""
    check_tensor(tensor, "allreduce")
    return _start_allreduce(tensor, name, op_of(op, average), prescale_factor,
                            postscale_factor, process_set, priority)


def _start_allreduce(tensor: torch.Tensor, name: str | None, op: str, prescale: float,
                     postscale: float, process_set: ProcessSet,
                     priority: int | None = None) -> int:
    """allreduce_async of a checked tensor and op, into a new tensor."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit_allreduce(tensor, output, name, op, prescale, postscale, process_set,
                             priority)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                    priority: int | None = None) -> int:
    """In-place allreduce_async: the result replaces ``tensor``'s values."""
    check_tensor(tensor, "allreduce")
    return _submit_allreduce(tensor, tensor, name, op_of(op, average), prescale_factor,
                             postscale_factor, process_set, priority)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str,
                prescale: float, postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        ctx.process_set = process_set
        # (allreduce checked the tensor and the op.)
        return synchronize(_start_allreduce(tensor, name, op, prescale, postscale,
                                            process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # As Horovod: the gradient of an allreduce is the same allreduce of the gradient.
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale,
                          postscale_factor=ctx.postscale, process_set=ctx.process_set),
                None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` (Average by default); returns a
    new tensor. Gradients flow: the gradient of an allreduce is the allreduce of the
    gradient."""
    op = op_of(op, average)
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise ValueError("allreduce of a sparse tensor takes no prescale or postscale "
                             "factor")
        return sparse_allreduce_async(tensor, name, op, process_set)()
    check_tensor(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    with switch_values(compression):
        reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor,
                                           postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
             name: str | None, op: str, prescale: float, postscale: float,
             process_set: ProcessSet) -> int:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    member = _member(process_set, "grouped_allreduce")
    base = _name("allreduce", name, member)
    with member.runtime.together():
        started = [submit_allreduce(member.runtime, t, o, f"{base}.{i}", op, prescale,
                                    postscale)
                   for i, (t, o) in enumerate(zip(tensors, outputs))]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped allreduce '{base}' ({len(tensors)} tensors) on all ranks")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors together (fused into one reduction where they fit
    the fusion threshold); synchronize returns the list of new tensors."""
    tensors = [check_tensor(t, "grouped_allreduce") for t in tensors]
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped(tensors, outputs, name, op_of(op, average), prescale_factor,
                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place grouped_allreduce_async: the results replace the tensors' values."""
    tensors = [check_tensor(t, "grouped_allreduce") for t in tensors]
    return _grouped(tensors, tensors, name, op_of(op, average), prescale_factor,
                    postscale_factor, process_set)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        ctx.process_set = process_set
        # (grouped_allreduce checked the tensors and the op.)
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                   for t in tensors]
        return tuple(synchronize(_grouped(tensors, outputs, name, op, prescale, postscale,
                                          process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.prescale,
                                    postscale_factor=ctx.postscale,
                                    process_set=ctx.process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors together; returns new tensors. Gradients flow."""
    op = op_of(op, average)
    pairs = [compression.compress(check_tensor(t, "grouped_allreduce")) for t in tensors]
    with switch_values(compression):
        reduced = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor,
                                                  process_set, *[t for t, _ in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped_allreduce: each tensor's values replaced by the reduction."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------------------

def _allgather_submit(tensor: torch.Tensor, name: str | None, member: SetMember
                      ) -> tuple[Handle, Callable]:
    check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it "
                         "concatenates along the first)")
    request = data_request("allgather", tensor, _name("allgather", name, member))
    handle = member.runtime.submit(request, send=to_numpy(tensor))
    return handle, lambda result: from_numpy(result[0], tensor, result[0].shape)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating the ranks' ``tensor`` (in rank order within ``process_set``)
    along the first dimension, which may differ per rank; returns a handle."""
    handle, finish = _allgather_submit(tensor, name, _member(process_set, "allgather"))
    return _register([handle], lambda results: finish(results[0]),
                     f"allgather '{handle.request.name}' on all ranks")


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list; synchronize returns the list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    member = _member(process_set, "grouped_allgather")
    base = _name("allgather", name, member)
    started = [_allgather_submit(t, f"{base}.{i}", member) for i, t in enumerate(tensors)]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped allgather '{base}' ({len(tensors)} tensors) on all ranks")


def _gathered_slice(grads: list[torch.Tensor], rows: list[int], process_set: ProcessSet
                    ) -> list[torch.Tensor]:
    """Horovod's allgather gradient: the average over the set of each output's gradient,
    then this rank's rows of it (every rank's row counts gathered again, as Horovod)."""
    reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                process_set=process_set)
    counts = grouped_allgather([torch.tensor([r], dtype=torch.int32) for r in rows],
                               process_set=process_set)
    index = process_set.rank()
    return [g.narrow(0, int(c[:index].sum()), r) for g, c, r in zip(reduced, counts, rows)]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
                ) -> torch.Tensor:
        handle = allgather_async(tensor, name, process_set)  # (it checks the tensor)
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gathered_slice([grad], [ctx.rows], ctx.process_set)[0], None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The ranks' ``tensor`` concatenated along the first dimension. Gradients flow."""
    return _AllgatherFunction.apply(tensor, name, process_set)


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
                ) -> tuple:
        handle = grouped_allgather_async(tensors, name, process_set)  # (it checks them)
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, *_gathered_slice(list(grads), ctx.rows, ctx.process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list; returns the list. Gradients flow."""
    return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_submit(tensor: torch.Tensor, output: torch.Tensor, root_rank: int,
                      name: str | None, process_set: ProcessSet) -> int:
    """(The API checked the tensor.)"""
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    member = _member(process_set, "broadcast")
    # The runtime numbers ranks within the set; Horovod's root is a global rank.
    root = (member.set_rank(root_rank, "broadcast") if process_set.process_set_id
            else root_rank)
    request = data_request("broadcast", tensor, _name("broadcast", name, member),
                           root=root)
    if output is tensor and direct(tensor):
        handle = member.runtime.submit(request, buf=to_numpy(tensor))
        return _register([handle], lambda _: output, f"broadcast '{request.name}'")
    buf = np.array(to_numpy(tensor), copy=True)
    handle = member.runtime.submit(request, buf=buf)
    return _register([handle], lambda _: copy_from(output, buf),
                     f"broadcast '{request.name}' from rank {root_rank}")


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying root_rank's ``tensor`` into a new tensor on every rank."""
    check_tensor(tensor, "broadcast")
    return _broadcast_submit(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` on every rank with root_rank's."""
    check_tensor(tensor, "broadcast")
    return _broadcast_submit(tensor, tensor, root_rank, name, process_set)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(_broadcast_submit(tensor, torch.empty_like(tensor), root_rank,
                                             name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # As Horovod: the set's average gradient reaches the root, zeros the others.
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """root_rank's ``tensor`` on every rank, as a new tensor. Gradients flow."""
    check_tensor(tensor, "broadcast")
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------

def _alltoall_submit(tensor: torch.Tensor, splits: Any, name: str | None,
                     process_set: ProcessSet) -> int:
    """Submit; synchronize returns (output, received_splits)."""
    check_tensor(tensor, "alltoall")
    member = _member(process_set, "alltoall")
    n = len(member.ranks)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall: the first dimension {tensor.shape[0]} does not "
                             f"divide into {n} equal parts; give splits")
        parts = [tensor.shape[0] // n] * n
    else:
        parts = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor)
                                  else splits)]
        if len(parts) != n or any(p < 0 for p in parts) or sum(parts) != tensor.shape[0]:
            raise ValueError(f"alltoall: splits {parts} must be {n} non-negative counts "
                             f"summing to the first dimension {tensor.shape[0]}")
    request = data_request("alltoall", tensor, _name("alltoall", name, member),
                           splits=tuple(parts))
    handle = member.runtime.submit(request, send=to_numpy(tensor))

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        return (from_numpy(out, tensor, out.shape),
                torch.tensor(received, dtype=torch.int32))
    return _register([handle], finish, f"alltoall '{request.name}' on all ranks")


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` first-dimension rows of ``tensor`` to the set's i-th
    rank (equal parts if None); synchronize returns (output, received_splits)."""
    return _alltoall_submit(tensor, splits, name, process_set)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> Any:
        output, received = synchronize(_alltoall_submit(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        # Rows travel back to where they came from.
        returned, _ = alltoall(grad.contiguous(), splits=ctx.received,
                               process_set=ctx.process_set)
        return returned, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows of ``tensor`` to the ranks and gather theirs. As Horovod: returns the
    output alone when ``splits`` is None (equal parts), else (output, received_splits).
    Gradients flow."""
    return _AlltoallFunction.apply(tensor, splits, name, process_set)


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_submit(tensor: torch.Tensor, name: str, op: str, prescale: float,
                          postscale: float, member: SetMember) -> tuple[Handle, Callable]:
    """(The API checked the tensor.)"""
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports hvd.Average and hvd.Sum, not {op!r}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    request = reduction_request("reducescatter", tensor, name, op, prescale, postscale)
    handle = member.runtime.submit(request, send=to_numpy(tensor, widen=True))
    return handle, lambda result: from_numpy(result, tensor, result.shape)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set's ranks (Average by default) and keeping
    this rank's part of the first dimension (split as torch.tensor_split does)."""
    check_tensor(tensor, "reducescatter")
    return _start_reducescatter(tensor, name, op_of(op, None), process_set,
                                prescale_factor, postscale_factor)


def _start_reducescatter(tensor: torch.Tensor, name: str | None, op: str,
                         process_set: ProcessSet, prescale: float, postscale: float) -> int:
    """reducescatter_async of a checked tensor and op."""
    member = _member(process_set, "reducescatter")
    handle, finish = _reducescatter_submit(tensor, _name("reducescatter", name, member),
                                           op, prescale, postscale, member)
    return _register([handle], lambda results: finish(results[0]),
                     f"reducescatter '{handle.request.name}' on all ranks")


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of a list; synchronize returns the list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_reducescatter needs at least one tensor")
    tensors = [check_tensor(t, "grouped_reducescatter") for t in tensors]
    return _start_grouped_reducescatter(tensors, name, op_of(op, None), process_set,
                                        prescale_factor, postscale_factor)


def _start_grouped_reducescatter(tensors: list[torch.Tensor], name: str | None, op: str,
                                 process_set: ProcessSet, prescale: float,
                                 postscale: float) -> int:
    """grouped_reducescatter_async of checked tensors and op."""
    member = _member(process_set, "grouped_reducescatter")
    base = _name("reducescatter", name, member)
    started = [_reducescatter_submit(t, f"{base}.{i}", op, prescale, postscale, member)
               for i, t in enumerate(tensors)]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped reducescatter '{base}' ({len(tensors)} tensors) on all ranks")


def _scattered_grads(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Horovod's reducescatter gradient: each output's gradient times the set's size for
    Sum and times the scale factors, gathered back along the first dimension."""
    factor = (len(ctx.process_set.ranks or []) if ctx.op == Sum else 1) * ctx.prescale * \
        ctx.postscale
    scaled = [g.contiguous() * factor if factor != 1 else g.contiguous() for g in grads]
    return grouped_allgather(scaled, process_set=ctx.process_set)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str,
                process_set: ProcessSet, prescale: float, postscale: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.prescale, ctx.postscale = (op, process_set, prescale,
                                                                postscale)
        return synchronize(_start_reducescatter(tensor, name, op, process_set, prescale,
                                                postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _scattered_grads(ctx, [grad])[0], None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0
                  ) -> torch.Tensor:
    """Reduce over the set's ranks and keep this rank's rows. Gradients flow."""
    compressed, ctx = compression.compress(check_tensor(tensor, "reducescatter"))
    reduced = _ReducescatterFunction.apply(compressed, name, op_of(op, None), process_set,
                                           prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, process_set: ProcessSet,
                prescale: float, postscale: float, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.process_set, ctx.prescale, ctx.postscale = (op, process_set, prescale,
                                                                postscale)
        return tuple(synchronize(_start_grouped_reducescatter(
            list(tensors), name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, *_scattered_grads(ctx, grads))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0
                          ) -> list[torch.Tensor]:
    """A reducescatter of each tensor of a list; returns the list. Gradients flow."""
    pairs = [compression.compress(check_tensor(t, "grouped_reducescatter"))
             for t in tensors]
    reduced = _GroupedReducescatterFunction.apply(name, op_of(op, None), process_set,
                                                  prescale_factor, postscale_factor,
                                                  *[t for t, _ in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, pairs)]


# -- sparse tensors -------------------------------------------------------------------------

def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Start the exact reduction (Sum or Average) of a sparse COO tensor over
    ``process_set``: every rank's indices and values gathered and coalesced
    (torch/sparse.py). Returns, as Horovod does, a function that waits for it and
    returns the coalesced result."""
    op = op_of(op, None)
    check_sparse(tensor, op, "sparse_allreduce_async")
    member = _member(process_set, "sparse_allreduce")
    base = _name("sparse_allreduce", name, member)
    settings = member.runtime.settings
    handles, finish = submit_sparse(member.runtime, tensor, base, op,
                                    settings.sparse_hot_rows, settings.sparse_reelect_calls)
    handle = _register(handles, finish, f"sparse allreduce '{base}' on all ranks")
    return lambda: synchronize(handle)


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
    member = _member(process_set, "barrier")
    request = OpRequest("barrier", _name("barrier", None, member), "none", "uint8")
    handle = member.runtime.submit(request)
    synchronize(_register([handle], lambda _: None, "every rank to reach the barrier"))


def set_quorum(k: int, process_set: ProcessSet = global_process_set) -> None:
    """Quorum mode for the allreduces submitted after this call (every rank calls it with
    the same k): the switch completes each chunk when k workers contributed, so a
    straggler does not set the pace; a worker left out of a chunk has its gradient
    dropped for that step, and Average divides by the workers counted. 0: sync.
    ``stats()["switch"]["quorum"]`` says which ranks the last call left out
    (docs/quorum.md)."""
    check_quorum(k)
    member = _member(process_set, "set_quorum")
    request = OpRequest("quorum", _name("set_quorum", None, member), "none", "uint8",
                        shape=(int(k),))
    handle = member.runtime.submit(request)
    synchronize(_register([handle], lambda _: None, "every rank to set the quorum"))


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
