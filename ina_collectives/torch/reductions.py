"""The Horovod API's reductions on PyTorch tensors: allreduce and grouped allreduce,
async (an int handle: handle_table.py) and as autograd Functions (the gradient of an
allreduce is the allreduce of its gradient), and the sparse allreduce."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..runtime.world import ProcessSet, global_process_set
from .basics import set_member
from .compression import Compression, Compressor, switch_values
from .handle_table import op_name, register, synchronize
from .sparse import check_sparse, submit_sparse
from .staging import (
    SUPPORTED_DTYPES,  # noqa: F401 - a public name of this module, as before
    Average,
    check_tensor,
    op_of,
    submit_allreduce,
)

# -- allreduce ---------------------------------------------------------------------------------

def _submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, name: str | None,
                      op: str, prescale: float, postscale: float,
                      process_set: ProcessSet, priority: int | None = None) -> int:
    member = set_member(process_set, "allreduce")
    handle, finish = submit_allreduce(member.runtime, tensor, output,
                                      op_name("allreduce", name, member), op, prescale,
                                      postscale, priority)
    return register([handle], lambda results: finish(results[0]),
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
    member = set_member(process_set, "grouped_allreduce")
    base = op_name("allreduce", name, member)
    with member.runtime.together():
        started = [submit_allreduce(member.runtime, t, o, f"{base}.{i}", op, prescale,
                                    postscale)
                   for i, (t, o) in enumerate(zip(tensors, outputs))]
    return register([h for h, _ in started],
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
    member = set_member(process_set, "sparse_allreduce")
    base = op_name("sparse_allreduce", name, member)
    settings = member.runtime.settings
    handles, finish = submit_sparse(member.runtime, tensor, base, op,
                                    settings.sparse_hot_rows, settings.sparse_reelect_calls)
    handle = register(handles, finish, f"sparse allreduce '{base}' on all ranks")
    return lambda: synchronize(handle)
