"""Horovod's tensor operations on PyTorch tensors, over the background runtime.

Tensors become NumPy views where they can (CPU, contiguous, a NumPy dtype); bfloat16,
non-contiguous and CUDA tensors are staged through a host copy (bfloat16 reduces as
float32, exactly widened, and is rounded back once). Every async call returns an int
handle for ``poll``/``synchronize``; the synchronous calls are autograd Functions.
"""
from __future__ import annotations

import atexit
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..runtime.background import BackgroundRuntime, Handle
from ..runtime.negotiation import OpRequest
from ..settings import Settings
from .compression import Compression, Compressor

# Reduction ops, compared by value like Horovod's.
Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"
_OPS = (Average, Sum, Min, Max, Product)

# What each supported dtype moves as (bfloat16 has no NumPy dtype: it is staged).
_WIRE = {torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
         torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
         torch.float32: "float32", torch.float64: "float64"}
SUPPORTED_DTYPES = tuple(_WIRE) + (torch.bfloat16,)


@dataclass
class _State:
    runtime: BackgroundRuntime
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


_state: _State | None = None
_init_lock = threading.Lock()
_names = {kind: itertools.count() for kind in
          ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")}
_handles: dict[int, "_Pending"] = {}
_handle_ids = itertools.count(1)


# -- start and stop ----------------------------------------------------------------------

def init(comm: Any = None, **settings: Any) -> None:
    """Start the runtime on ``comm``: None (MPI.COMM_WORLD), a list of COMM_WORLD ranks,
    or an mpi4py communicator. Collective over that communicator (a list: over
    COMM_WORLD). Idempotent: a second call while initialized does nothing. Keyword
    arguments are library settings (``ina_collectives.Settings``)."""
    global _state
    with _init_lock:
        if _state is not None:
            return
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if comm is None:
            comm = world
        elif isinstance(comm, (list, tuple, range)):
            ranks = [int(r) for r in comm]
            if sorted(set(ranks)) != sorted(ranks) or any(
                    not 0 <= r < world.Get_size() for r in ranks):
                raise ValueError(f"init(comm={ranks}): ranks must be distinct and in "
                                 f"0..{world.Get_size() - 1}")
            group = world.Get_group().Incl(ranks)
            sub = world.Create(group)
            group.Free()
            if sub == MPI.COMM_NULL:
                raise ValueError(f"init(comm={ranks}): this process (COMM_WORLD rank "
                                 f"{world.Get_rank()}) is not one of those ranks")
            comm = sub
        elif not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"init(comm=...) takes None, a list of ranks or an mpi4py "
                            f"intracommunicator, got {type(comm).__name__}")
        runtime = BackgroundRuntime(comm, Settings.load({**_horovod_environment(),
                                                         **settings}))
        # Unnamed operations are numbered per runtime: every rank starts again from 0.
        for kind in _names:
            _names[kind] = itertools.count()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross = comm.Split(local.Get_rank(), comm.Get_rank())
        homogeneous = len(set(comm.allgather(local.Get_size()))) == 1
        _state = _State(runtime, comm.Get_rank(), comm.Get_size(), local.Get_rank(),
                        local.Get_size(), cross.Get_rank(), cross.Get_size(), homogeneous)
        local.Free()
        cross.Free()


def _horovod_environment() -> dict[str, Any]:
    """Horovod's variables for the settings it shares, where no INA_* one is set."""
    env, found = os.environ, {}
    pairs = [("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", int),
             ("cycle_time", "HOROVOD_CYCLE_TIME", lambda v: float(v) / 1000.0),
             ("stall_warning_time", "HOROVOD_STALL_CHECK_TIME_SECONDS", float),
             ("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float)]
    for name, variable, parse in pairs:
        if f"INA_{name.upper()}" not in env and variable in env:
            try:
                found[name] = parse(env[variable])
            except ValueError:
                raise ValueError(f"{variable}: cannot read {env[variable]!r}") from None
    return found


def shutdown() -> None:
    """Stop the background thread (on every rank: the others' pending operations fail)
    and free the communicator. Idempotent; init() may be called again."""
    global _state
    with _init_lock:
        if _state is None:
            return
        state, _state = _state, None
    state.runtime.shutdown(state.runtime.settings.timeout + 5)
    _handles.clear()


atexit.register(shutdown)  # registered after mpi4py's finalize, so it runs before it


def is_initialized() -> bool:
    return _state is not None


def _require() -> _State:
    if _state is None:
        raise ValueError("ina_collectives.torch has not been initialized; use hvd.init()")
    return _state


def size() -> int:
    return _require().size


def rank() -> int:
    return _require().rank


def local_size() -> int:
    return _require().local_size


def local_rank() -> int:
    return _require().local_rank


def cross_size() -> int:
    return _require().cross_size


def cross_rank() -> int:
    return _require().cross_rank


def mpi_threads_supported() -> bool:
    """Whether MPI runs with THREAD_MULTIPLE. Like Horovod, only after init()."""
    _require()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return _require().homogeneous


# What this library is built with, under Horovod's names: MPI is its controller and
# transport; it has no Gloo controller and no GPU (NCCL, CUDA, ROCm), DDL or oneCCL code.

def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: Horovod returns the NCCL version code here, or 0 without NCCL."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def stats() -> dict[str, Any]:
    """Calls, bytes and engines of the reductions so far, and fusion counters."""
    return _require().runtime.stats()


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
    runtime = _require().runtime
    results = [h.wait(runtime.wait_seconds(), pending.what) for h in pending.handles]
    return pending.complete(results)


# -- argument checks and staging ----------------------------------------------------------------

def _op_of(op: Any, average: bool | None, default: str = Average) -> str:
    if average is not None:
        if op is not None:
            raise ValueError("give op or the deprecated average, not both")
        return Average if average else Sum
    if op is None:
        return default
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by ina_collectives; use "
                                  "Average or Sum")
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; expected one of hvd.Average, hvd.Sum, hvd.Min, "
                         f"hvd.Max, hvd.Product")
    return op


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; supported: "
                        f"{', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported")
    return tensor


def _name(kind: str, name: str | None) -> str:
    if name is None:
        return f"{kind}.noname.{next(_names[kind])}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _direct(tensor: torch.Tensor) -> bool:
    """Whether the tensor's own memory can be handed to the runtime as a NumPy array."""
    return (tensor.device.type == "cpu" and tensor.dtype in _WIRE
            and tensor.is_contiguous())


def _numpy(tensor: torch.Tensor, widen: bool = False) -> np.ndarray:
    """A flat NumPy array of the tensor's values: its own memory where _direct, else a
    host copy (bfloat16 as float32 if ``widen``, else as its raw 16 bits)."""
    t = tensor.detach()
    if _direct(t):
        return t.numpy().reshape(-1)
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return (t.float() if widen else t.view(torch.int16)).numpy().reshape(-1)
    return t.numpy().reshape(-1)


def _from_numpy(array: np.ndarray, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``like``'s dtype and device holding ``array``'s values."""
    t = torch.from_numpy(array)
    if like.dtype == torch.bfloat16:
        t = t.view(torch.bfloat16) if array.dtype == np.int16 else t.to(torch.bfloat16)
    return t.reshape(tuple(shape)).to(like.device)


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: str,
                     prescale: float, postscale: float) -> tuple[Handle, Callable]:
    """Submit; returns the runtime handle and the step that finishes ``output``."""
    _check_tensor(tensor, "allreduce")
    runtime = _require().runtime
    wire = "float32" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    request = OpRequest("allreduce", _name("allreduce", name), _dtype_name(tensor), wire,
                      tuple(tensor.shape), op, prescale=float(prescale),
                      postscale=float(postscale))
    if output is tensor and _direct(tensor):
        handle = runtime.submit(request, send=None, recv=_numpy(tensor))
        return handle, lambda _: output
    if _direct(output) and output.dtype == tensor.dtype:
        handle = runtime.submit(request, send=_numpy(tensor), recv=_numpy(output))
        return handle, lambda _: output
    staged = np.array(_numpy(tensor, widen=True), copy=True)
    handle = runtime.submit(request, send=None, recv=staged)

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(_from_numpy(staged, output, output.shape))
        return output
    return handle, copy_back


def _submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, name: str | None,
                      op: str, prescale: float, postscale: float) -> int:
    handle, finish = _allreduce_async(tensor, output, name, op, prescale, postscale)
    return _register([handle], lambda results: finish(results[0]),
                     f"allreduce '{handle.request.name}' on all ranks")


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over all ranks into a new tensor; returns a handle.
    The default op is Average. The input is not modified."""
    _check_tensor(tensor, "allreduce")
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit_allreduce(tensor, output, name, _op_of(op, average), prescale_factor,
                             postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> int:
    """In-place allreduce_async: the result replaces ``tensor``'s values."""
    _check_tensor(tensor, "allreduce")
    return _submit_allreduce(tensor, tensor, name, _op_of(op, average), prescale_factor,
                             postscale_factor)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # d(sum_r x_r)/dx_r = 1: the gradient of every rank's input is the reduced gradient.
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale,
                          postscale_factor=ctx.postscale), None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Average by default); returns a new tensor.
    Gradients flow: the gradient of an allreduce is the allreduce of the gradient."""
    op = _op_of(op, average)
    _check_tensor(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def _grouped(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
             name: str | None, op: str, prescale: float, postscale: float) -> int:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    base = _name("allreduce", name)
    started = [_allreduce_async(t, o, f"{base}.{i}", op, prescale, postscale)
               for i, (t, o) in enumerate(zip(tensors, outputs))]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped allreduce '{base}' ({len(tensors)} tensors) on all ranks")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing a list of tensors together (fused into one reduction where they fit
    the fusion threshold); synchronize returns the list of new tensors."""
    tensors = [_check_tensor(t, "grouped_allreduce") for t in tensors]
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped(tensors, outputs, name, _op_of(op, average), prescale_factor,
                    postscale_factor)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> int:
    tensors = [_check_tensor(t, "grouped_allreduce") for t in tensors]
    return _grouped(tensors, tensors, name, _op_of(op, average), prescale_factor,
                    postscale_factor)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(synchronize(grouped_allreduce_async(
            tensors, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.prescale,
                                    postscale_factor=ctx.postscale)
        return (None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce a list of tensors together; returns new tensors. Gradients flow."""
    op = _op_of(op, average)
    pairs = [compression.compress(_check_tensor(t, "grouped_allreduce")) for t in tensors]
    reduced = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor,
                                              *[t for t, _ in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor))


# -- allgather ---------------------------------------------------------------------------------

def _data_request(kind: str, tensor: torch.Tensor, name: str | None, **fields: Any
                  ) -> OpRequest:
    wire = "int16" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    return OpRequest(kind, _name(kind, name), _dtype_name(tensor), wire, tuple(tensor.shape),
                   **fields)


def _allgather_submit(tensor: torch.Tensor, name: str | None) -> tuple[Handle, Callable]:
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it "
                         "concatenates along the first)")
    request = _data_request("allgather", tensor, name)
    handle = _require().runtime.submit(request, send=_numpy(tensor))
    return handle, lambda result: (_from_numpy(result[0], tensor, result[0].shape), result[1])


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension (which may
    differ per rank); returns a handle."""
    handle, finish = _allgather_submit(tensor, name)
    return _register([handle], lambda results: finish(results[0])[0],
                     f"allgather '{handle.request.name}' on all ranks")


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        handle, finish = _allgather_submit(tensor, name)
        output, rows = synchronize(_register([handle], lambda results: finish(results[0]),
                                             f"allgather '{handle.request.name}'"))
        ctx.rows = rows
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # Every rank's output depends on this rank's rows: sum the gradients, take ours.
        summed = allreduce(grad, op=Sum)
        start = sum(ctx.rows[:rank()])
        return summed.narrow(0, start, ctx.rows[rank()]), None


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension. Gradients flow."""
    return _AllgatherFunction.apply(tensor, name)


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_submit(tensor: torch.Tensor, output: torch.Tensor, root_rank: int,
                      name: str | None) -> int:
    _check_tensor(tensor, "broadcast")
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    request = _data_request("broadcast", tensor, name, root=root_rank)
    if output is tensor and _direct(tensor):
        handle = _require().runtime.submit(request, buf=_numpy(tensor))
        return _register([handle], lambda _: output, f"broadcast '{request.name}'")
    buf = np.array(_numpy(tensor), copy=True)
    handle = _require().runtime.submit(request, buf=buf)

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(_from_numpy(buf, output, output.shape))
        return output
    return _register([handle], copy_back, f"broadcast '{request.name}' from rank {root_rank}")


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start copying root_rank's ``tensor`` into a new tensor on every rank."""
    _check_tensor(tensor, "broadcast")
    return _broadcast_submit(tensor, torch.empty_like(tensor), root_rank, name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start overwriting ``tensor`` on every rank with root_rank's."""
    return _broadcast_submit(tensor, tensor, root_rank, name)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None
                ) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # Only the root's input reaches the outputs: it gets every rank's gradient.
        summed = allreduce(grad, op=Sum)
        if rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """root_rank's ``tensor`` on every rank, as a new tensor. Gradients flow."""
    return _BroadcastFunction.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


# -- alltoall and reducescatter -------------------------------------------------------------

def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> int:
    """Start sending ``splits[i]`` first-dimension rows of ``tensor`` to rank i (equal
    parts if None); synchronize returns (output, received_splits)."""
    _check_tensor(tensor, "alltoall")
    n = size()
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
    request = _data_request("alltoall", tensor, name, splits=tuple(parts))
    handle = _require().runtime.submit(request, send=_numpy(tensor))

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        return (_from_numpy(out, tensor, out.shape),
                torch.tensor(received, dtype=torch.int32))
    return _register([handle], finish, f"alltoall '{request.name}' on all ranks")


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        # Rows travel back to where they came from.
        returned, _ = alltoall(grad.contiguous(), splits=ctx.received)
        return returned, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows of ``tensor`` to the ranks and gather theirs. As Horovod: returns the
    output alone when ``splits`` is None (equal parts), else (output, received_splits).
    Gradients flow."""
    return _AlltoallFunction.apply(tensor, splits, name)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over all ranks (Average by default) and keeping this
    rank's part of the first dimension (split as torch.tensor_split does)."""
    _check_tensor(tensor, "reducescatter")
    op = _op_of(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports hvd.Average and hvd.Sum, not {op!r}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    wire = "float32" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    request = OpRequest("reducescatter", _name("reducescatter", name), _dtype_name(tensor),
                      wire, tuple(tensor.shape), op, prescale=float(prescale_factor),
                      postscale=float(postscale_factor))
    handle = _require().runtime.submit(request, send=_numpy(tensor, widen=True))
    return _register([handle], lambda results: _from_numpy(results[0], tensor,
                                                           results[0].shape),
                     f"reducescatter '{request.name}' on all ranks")


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str) -> torch.Tensor:
        ctx.op = op
        return synchronize(reducescatter_async(tensor, name, op))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        gathered = allgather(grad.contiguous())
        if ctx.op == Average:
            gathered = gathered / size()
        return gathered, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: Any = None
                  ) -> torch.Tensor:
    """Reduce over all ranks and keep this rank's rows. Gradients flow."""
    return _ReducescatterFunction.apply(tensor, name, _op_of(op, None))


# -- barrier and join ------------------------------------------------------------------------

def barrier() -> None:
    """Return once every rank has called barrier()."""
    request = OpRequest("barrier", _name("barrier", None), "none", "uint8")
    handle = _require().runtime.submit(request)
    synchronize(_register([handle], lambda _: None, "every rank to reach the barrier"))


def join(device: int = -1) -> int:
    """This rank has no more batches: until every rank has joined, it takes part in the
    others' allreduces with zeros. Returns the rank that joined last."""
    runtime = _require().runtime
    handle = runtime.join()
    return handle.wait(runtime.wait_seconds(), "every rank to join")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "stats",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "poll", "synchronize",
]
