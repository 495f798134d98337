"""The Horovod API's data movement on PyTorch tensors: allgather, broadcast, alltoall and
reducescatter, async (an int handle: handle_table.py) and as autograd Functions with Horovod's
gradients (an allgather's: the set's average gradient, this rank's rows of it; a
broadcast's: the average at the root, zeros elsewhere; an alltoall's: sent back by
the splits received; a reducescatter's: the allgather of its gradient)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..runtime.background import Handle
from ..runtime.world import ProcessSet, SetMember, global_process_set
from . import basics
from .basics import set_member
from .compression import Compression, Compressor
from .handle_table import op_name, register, synchronize
from .reductions import allreduce, grouped_allreduce
from .staging import (
    Average,
    Sum,
    check_tensor,
    copy_from,
    data_request,
    direct,
    from_numpy,
    op_of,
    reduction_request,
    to_numpy,
)

# -- allgather ---------------------------------------------------------------------------------

def _allgather_submit(tensor: torch.Tensor, name: str | None, member: SetMember
                      ) -> tuple[Handle, Callable]:
    check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it "
                         "concatenates along the first)")
    request = data_request("allgather", tensor, op_name("allgather", name, member))
    handle = member.runtime.submit(request, send=to_numpy(tensor))
    return handle, lambda result: from_numpy(result[0], tensor, result[0].shape)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating the ranks' ``tensor`` (in rank order within ``process_set``)
    along the first dimension, which may differ per rank; returns a handle."""
    handle, finish = _allgather_submit(tensor, name, set_member(process_set, "allgather"))
    return register([handle], lambda results: finish(results[0]),
                     f"allgather '{handle.request.name}' on all ranks")


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list; synchronize returns the list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    member = set_member(process_set, "grouped_allgather")
    base = op_name("allgather", name, member)
    started = [_allgather_submit(t, f"{base}.{i}", member) for i, t in enumerate(tensors)]
    return register([h for h, _ in started],
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
    member = set_member(process_set, "broadcast")
    # The runtime numbers ranks within the set; Horovod's root is a global rank.
    root = (member.set_rank(root_rank, "broadcast") if process_set.process_set_id
            else root_rank)
    request = data_request("broadcast", tensor, op_name("broadcast", name, member),
                           root=root)
    if output is tensor and direct(tensor):
        handle = member.runtime.submit(request, buf=to_numpy(tensor))
        return register([handle], lambda _: output, f"broadcast '{request.name}'")
    buf = np.array(to_numpy(tensor), copy=True)
    handle = member.runtime.submit(request, buf=buf)
    return register([handle], lambda _: copy_from(output, buf),
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
        if basics.rank() != ctx.root_rank:
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
    member = set_member(process_set, "alltoall")
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
    request = data_request("alltoall", tensor, op_name("alltoall", name, member),
                           splits=tuple(parts))
    handle = member.runtime.submit(request, send=to_numpy(tensor))

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        return (from_numpy(out, tensor, out.shape),
                torch.tensor(received, dtype=torch.int32))
    return register([handle], finish, f"alltoall '{request.name}' on all ranks")


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
    member = set_member(process_set, "reducescatter")
    handle, finish = _reducescatter_submit(tensor, op_name("reducescatter", name, member),
                                           op, prescale, postscale, member)
    return register([handle], lambda results: finish(results[0]),
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
    member = set_member(process_set, "grouped_reducescatter")
    base = op_name("reducescatter", name, member)
    started = [_reducescatter_submit(t, f"{base}.{i}", op, prescale, postscale, member)
               for i, t in enumerate(tensors)]
    return register([h for h, _ in started],
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
