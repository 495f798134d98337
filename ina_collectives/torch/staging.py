"""Tensors in and out of the runtime: what every torch binding (the Horovod API, the
torch.distributed backend, the optimizer) shares.

Tensors become NumPy views where they can (CPU, contiguous, a NumPy dtype); bfloat16,
non-contiguous and CUDA tensors are staged through a host copy (bfloat16 reduces as
float32, exactly widened, and is rounded back once; it moves as its raw 16 bits). An
allreduce of a contiguous one is staged a window at a time, both ways, overlapping the
stream (torch/windows.py). Here
too: the ops by Horovod's names, the dtype tables, the checks every call makes, and the
requests the runtime takes.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..collectives.ops import Op, as_op
from ..runtime.background import BackgroundRuntime, Handle
from ..runtime.negotiation import OpRequest
from .compression import SWITCH_BITS
from .windows import HostWindows, stageable

# Horovod's reduction ops, compared by value like Horovod's (each is a name of
# collectives.ops's one table: as_op turns it into the runtime's Op).
Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"
OPS = (Average, Sum, Min, Max, Product)

# What each supported dtype moves as (bfloat16 has no NumPy dtype: it is staged).
WIRE = {torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
        torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
        torch.float32: "float32", torch.float64: "float64"}
SUPPORTED_DTYPES = tuple(WIRE) + (torch.bfloat16,)


def op_of(op: Any, average: bool | None, default: str = Average) -> str:
    """Horovod's op argument (and its deprecated ``average``) as one of OPS."""
    if average is not None:
        if op is not None:
            raise ValueError("give op or the deprecated average, not both")
        return Average if average else Sum
    if op is None:
        return default
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by ina_collectives; use "
                                  "Average or Sum")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of hvd.Average, hvd.Sum, hvd.Min, "
                         f"hvd.Max, hvd.Product")
    return op


def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor``, if it is a dense tensor of a supported dtype; else TypeError naming
    what is wrong."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; supported: "
                        f"{', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported")
    return tensor


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def reduced_as(tensor: torch.Tensor) -> str:
    """The NumPy dtype ``tensor`` is reduced in (bfloat16: float32)."""
    return "float32" if tensor.dtype == torch.bfloat16 else WIRE[tensor.dtype]


def moved_as(tensor: torch.Tensor) -> str:
    """The NumPy dtype ``tensor`` is copied in (bfloat16: its 16 bits as int16)."""
    return "int16" if tensor.dtype == torch.bfloat16 else WIRE[tensor.dtype]


def direct(tensor: torch.Tensor) -> bool:
    """Whether the tensor's own memory can be handed to the runtime as a NumPy array."""
    return (tensor.device.type == "cpu" and tensor.dtype in WIRE
            and tensor.is_contiguous())


def to_numpy(tensor: torch.Tensor, widen: bool = False) -> np.ndarray:
    """A flat NumPy array of the tensor's values: its own memory where ``direct``, else a
    host copy (bfloat16 as float32 if ``widen``, else as its raw 16 bits)."""
    t = tensor.detach()
    if direct(t):
        return t.numpy().reshape(-1)
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return (t.float() if widen else t.view(torch.int16)).numpy().reshape(-1)
    return t.numpy().reshape(-1)


def from_numpy(array: np.ndarray, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``like``'s dtype and device holding ``array``'s values."""
    t = torch.from_numpy(array)
    if like.dtype == torch.bfloat16:
        t = t.view(torch.bfloat16) if array.dtype == np.int16 else t.to(torch.bfloat16)
    return t.reshape(tuple(shape)).to(like.device)


def copy_from(target: torch.Tensor, array: np.ndarray) -> torch.Tensor:
    """Write ``array``'s values into ``target`` (any dtype, device and layout)."""
    with torch.no_grad():
        target.copy_(from_numpy(np.ascontiguousarray(array), target, target.shape))
    return target


def data_request(kind: str, tensor: torch.Tensor, name: str, **fields: Any) -> OpRequest:
    """The request of an operation that moves ``tensor``'s values unchanged (allgather,
    broadcast, alltoall). The API checked the tensor (check_tensor)."""
    return OpRequest(kind, name, dtype_name(tensor), moved_as(tensor), tuple(tensor.shape),
                     **fields)


def reduction_request(kind: str, tensor: torch.Tensor, name: str, op: Op | str,
                      prescale: float = 1.0, postscale: float = 1.0,
                      **fields: Any) -> OpRequest:
    """The request of a reduction of ``tensor`` (allreduce, reducescatter): ``op`` (a
    Horovod name, or an Op) as the runtime's Op. The API checked the tensor."""
    return OpRequest(kind, name, dtype_name(tensor), reduced_as(tensor),
                     tuple(tensor.shape), as_op(op), prescale=float(prescale),
                     postscale=float(postscale), **fields)


# The priority of allreduces submitted where none is given (torch/overlap.py: priority).
PRIORITY: ContextVar[int] = ContextVar("allreduce_priority", default=0)


def submit_allreduce(runtime: BackgroundRuntime, tensor: torch.Tensor,
                     output: torch.Tensor, name: str, op: Op | str, prescale: float = 1.0,
                     postscale: float = 1.0, priority: int | None = None
                     ) -> tuple[Handle, Callable[[Any], torch.Tensor]]:
    """Submit the allreduce of ``tensor`` into ``output`` (which may be ``tensor``);
    returns the runtime's handle and the step that finishes ``output`` from its result.
    The values go to the runtime without a copy where the memory allows. ``priority``:
    lower runs sooner (the runtime's order, docs/ordering.md); None: PRIORITY's."""
    if priority is None:
        priority = PRIORITY.get()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    request = reduction_request("allreduce", tensor, name, op, prescale, postscale,
                                switch_bits=SWITCH_BITS.get(), priority=priority)
    if output is tensor and direct(tensor):
        handle = runtime.submit(request, send=None, recv=to_numpy(tensor))
        return handle, lambda _: output
    if direct(output) and output.dtype == tensor.dtype:
        handle = runtime.submit(request, send=to_numpy(tensor), recv=to_numpy(output))
        return handle, lambda _: output
    if stageable(tensor, output):  # (CUDA, or bfloat16) a window at a time, both ways
        windows = HostWindows(tensor, output, seconds=runtime.settings.timeout)
        handle = runtime.submit(request, send=None, recv=windows.host,
                                landed=windows.landed, arrived=windows.arrived)
        return handle, windows.finish
    staged = np.array(to_numpy(tensor, widen=True), copy=True)
    handle = runtime.submit(request, send=None, recv=staged)
    return handle, lambda _: copy_from(output, staged)


def check_like(tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
    """Each of ``tensors`` has ``like``'s shape and dtype (one rank's row of a gather or
    a scatter), else ValueError naming the first that does not."""
    for i, t in enumerate(tensors):
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"{what}: tensor {i} is {t.dtype} {list(t.shape)}, the "
                             f"operation's is {like.dtype} {list(like.shape)}")


def check_count(tensors: Sequence[torch.Tensor], n: int, what: str) -> None:
    if len(tensors) != n:
        raise ValueError(f"{what}: expected one tensor per rank ({n}), got {len(tensors)}")
