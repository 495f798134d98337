"""Helpers that keep the ranks' models and optimizers in step, as Horovod's."""
from __future__ import annotations

import io
from typing import Any, Iterable

import numpy as np
import torch

from ..runtime.world import ProcessSet, global_process_set
from . import mpi_ops
from .optimizer import DistributedOptimizerMixin


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite, in place, every rank's parameters with root_rank's.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    (name, tensor) pairs. All broadcasts are started at once, then awaited."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise TypeError(f"broadcast_parameters takes a state_dict or (name, tensor) pairs, "
                        f"got {type(params).__name__}")
    handles = []
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"broadcast_parameters: expected (name, tensor) pairs, got "
                            f"{entry!r:.60}")
        name, p = entry
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: '{name}' is a {type(p).__name__}, not "
                            f"a tensor")
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(mpi_ops.broadcast_async_(target, root_rank, name=f"param.{name}"))
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank root_rank's optimizer state (hyperparameters and buffers, such as
    momentum; tensors, Python scalars and None alike), loaded through the optimizer's own
    load_state_dict.

    As Horovod, a rank whose optimizer has no state yet first creates it with one local
    step on zero gradients (of the parameters that require them), so that the state and
    the gradients exist afterwards even where root_rank has none to give."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not optimizer.state and not isinstance(optimizer, torch.optim.LBFGS):
        _initialize_state(optimizer)
    state = broadcast_object(optimizer.state_dict() if mpi_ops.rank() == root_rank else None,
                             root_rank, name="optimizer_state")
    if mpi_ops.rank() != root_rank:
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients, local to this rank: a DistributedOptimizer's own step
    would start allreduces that the other ranks, whose state may exist, never join."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    if isinstance(optimizer, DistributedOptimizerMixin):
        optimizer.local_step()  # the wrapped class's step, no allreduce
    else:
        optimizer.step()


def _dumps(obj: Any) -> np.ndarray:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # pickle that also carries tensors
    return np.frombuffer(buffer.getvalue(), np.uint8).copy()


def _loads(data: np.ndarray) -> Any:
    return torch.load(io.BytesIO(data.tobytes()), weights_only=False)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """root_rank's ``obj`` (anything picklable) on every rank of ``process_set``;
    returns it. ``root_rank`` is a global rank, as in Horovod."""
    base = name or "broadcast_object"
    payload = _dumps(obj) if mpi_ops.rank() == root_rank else np.empty(0, np.uint8)
    length = torch.tensor([payload.size], dtype=torch.int64)
    mpi_ops.broadcast_(length, root_rank, name=f"{base}.length", process_set=process_set)
    data = torch.from_numpy(payload) if mpi_ops.rank() == root_rank else torch.empty(
        int(length.item()), dtype=torch.uint8)
    mpi_ops.broadcast_(data, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if mpi_ops.rank() == root_rank else _loads(data.numpy())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The ranks' ``obj`` (anything picklable), as a list in rank order within
    ``process_set``."""
    base = name or "allgather_object"
    payload = torch.from_numpy(_dumps(obj))
    lengths = mpi_ops.allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                                name=f"{base}.lengths", process_set=process_set)
    data = mpi_ops.allgather(payload, name=f"{base}.data", process_set=process_set).numpy()
    offsets = np.concatenate(([0], np.cumsum(lengths.numpy())))
    return [_loads(data[offsets[r]:offsets[r + 1]]) for r in range(len(lengths))]
