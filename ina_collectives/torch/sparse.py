"""Sparse COO tensors reduced exactly: every rank's indices and values gathered, then
summed where indices meet (coalesced). What the Horovod API's ``sparse_allreduce_async``
and its DistributedOptimizer with sparse gradients, and the torch.distributed backend's
``all_reduce`` of a sparse tensor (DDP with ``nn.Embedding(sparse=True)``) share.

Three allgathers through the group's runtime, submitted together: each rank's layout
(its tensor's size and whether its indices lie inside it), its indices (nnz x sparse
dims, int64) and its values (nnz x dense dims). The negotiation compares what it always
compares (the values' dtype and trailing dims, the indices' width); the layout rows
are compared here, on every rank alike, so ranks whose tables differ, or a rank whose
indices fall outside its table, raise ValueError on every rank naming them. A rank with
no entries (nnz 0) simply adds none.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..runtime.background import BackgroundRuntime, Handle
from .staging import Average, Sum, data_request, from_numpy, to_numpy


def check_sparse(tensor: Any, op: str, what: str) -> torch.Tensor:
    """``tensor`` if it is a sparse COO tensor that ``op`` can reduce here; else
    TypeError or ValueError naming what is wrong."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what} takes a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if op not in (Sum, Average):
        raise ValueError(f"{what}: op {op!r} is not Sum or Average (the only reductions of "
                         f"sparse tensors)")
    if not tensor.is_floating_point():
        raise TypeError(f"{what}: dtype {tensor.dtype}: sparse tensors are reduced in "
                        f"floating point here")
    return tensor


def submit_sparse(runtime: BackgroundRuntime, tensor: torch.Tensor, name: str, op: str
                  ) -> tuple[list[Handle], Callable[[list[Any]], torch.Tensor]]:
    """Submit the exact sparse reduction of ``tensor`` (checked with check_sparse) under
    ``name``: the runtime's handles, and the step that makes the coalesced result (a
    new sparse tensor of ``tensor``'s size, dtype and device) from their results."""
    t = tensor.detach().coalesce()
    size = tuple(t.shape)
    indices = t.indices().t().contiguous()                 # nnz x sparse dims
    values = t.values().contiguous()                       # nnz x dense dims
    inside = bool(((indices >= 0) & (indices < torch.tensor(size[:t.sparse_dim()]))).all())
    layout = torch.tensor([[int(inside), t.sparse_dim(), *size]], dtype=torch.int64)
    parts = [(f"{name}.layout", layout), (f"{name}.indices", indices),
             (f"{name}.values", values)]
    handles = [runtime.submit(data_request("allgather", part, part_name),
                              send=np.ascontiguousarray(to_numpy(part)))
               for part_name, part in parts]

    def finish(results: list[Any]) -> torch.Tensor:
        (rows, _), (all_indices, _), (all_values, _) = results
        rows = rows.reshape(-1, layout.shape[1])
        outside = [r for r in range(rows.shape[0]) if not rows[r, 0]]
        if outside:
            raise ValueError(f"sparse allreduce '{name}': rank(s) {outside} passed indices "
                             f"outside their tensor's size")
        if not (rows[:, 1:] == rows[0, 1:]).all():
            shapes = "; ".join(f"rank {r}: {tuple(rows[r, 2:].tolist())} with "
                               f"{rows[r, 1]} sparse dims" for r in range(rows.shape[0]))
            raise ValueError(f"sparse allreduce '{name}': the ranks' tensors differ: "
                             f"{shapes}")
        gathered_indices = torch.from_numpy(all_indices.reshape(-1, t.sparse_dim()))
        gathered_values = from_numpy(all_values, values,
                                     (gathered_indices.shape[0], *values.shape[1:]))
        # (Every rank's indices were checked inside the size above.)
        result = torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, size,
                                         device=tensor.device,
                                         check_invariants=False).coalesce()
        if op == Average:
            result = result / rows.shape[0]
        return result

    return handles, finish
