"""Sparse COO tensors reduced exactly: every rank's indices and values gathered, then
summed where indices meet (coalesced). What the Horovod API's ``sparse_allreduce_async``
and its DistributedOptimizer with sparse gradients, and the torch.distributed backend's
``all_reduce`` of a sparse tensor (DDP with ``nn.Embedding(sparse=True)``) share.

Hot rows (Libra): a tensor of one sparse dimension reduced again and again under one
name (a DistributedOptimizer's embedding gradient) has its most touched rows, counted
over every rank, summed as a dense allreduce, through the switch where it serves; the
other rows, and every row of any other tensor, go as below (``submit_sparse``).

Three allgathers through the group's runtime, submitted together: each rank's layout
(its tensor's size and whether its indices lie inside it), its indices (nnz x sparse
dims, int64) and its values (nnz x dense dims). The negotiation compares what it always
compares (the values' dtype and trailing dims, the indices' width); the layout rows
are compared here, on every rank alike, so ranks whose tables differ, or a rank whose
indices fall outside its table, raise ValueError on every rank naming them. A rank with
no entries (nnz 0) simply adds none.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..runtime.background import BackgroundRuntime, Handle
from .staging import Average, Sum, data_request, from_numpy, submit_allreduce, to_numpy


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


@dataclass
class Table:
    """What the ranks know alike of one sparse tensor (by name): how often each row was
    touched over every rank, the hot rows elected from that, and the traffic so far."""

    counts: np.ndarray                   # touches per row, summed over the ranks
    hot: np.ndarray                      # the hot rows, ascending (int64)
    calls: int = 0
    rows_touched: int = 0                # over the calls: distinct rows with entries
    hot_rows_touched: int = 0            # of those, hot ones
    bytes_through_allreduce: int = 0     # this rank's hot blocks (the switch's, if it serves)
    bytes_gathered: int = 0              # this rank's share of the exact gather

    def report(self) -> dict[str, Any]:
        touched = max(self.rows_touched, 1)
        return {"calls": self.calls, "hot_rows": int(self.hot.size),
                "hot_share_of_touched_rows": round(self.hot_rows_touched / touched, 4),
                "bytes_through_allreduce": self.bytes_through_allreduce,
                "bytes_gathered": self.bytes_gathered}


# The tables of each runtime (a process set's, a group's), by tensor name.
_tables: weakref.WeakKeyDictionary[BackgroundRuntime, dict[str, Table]] = (
    weakref.WeakKeyDictionary())


def table_stats(runtime: BackgroundRuntime) -> dict[str, dict[str, Any]]:
    """stats()["sparse"]: per sparse tensor name, its hot set and traffic."""
    return {name: t.report() for name, t in _tables.get(runtime, {}).items()}


def elect(counts: np.ndarray, calls: int, most: int, n: int, row_bytes: int) -> np.ndarray:
    """The hot rows: the ``most`` rows touched most over the ranks in ``calls`` calls
    (``counts``), ascending; none where they would not pay. By bytes: each hot row's
    entries would otherwise reach every other rank by the gather ((n - 1) x its entries
    per rank x (8 + row_bytes) received per rank), and summed densely they cost one row
    each way through the switch; the set pays when what it saves exceeds what it costs.
    The same counts on every rank give the same rows on every rank."""
    if calls == 0:
        return np.zeros(0, np.int64)
    ranked = np.argsort(-counts, kind="stable")[:most]
    hot = np.sort(ranked[counts[ranked] > 0])
    entries_per_rank = counts[hot].sum() / calls / n
    saved = (n - 1) * entries_per_rank * (8 + row_bytes)
    return hot if saved > hot.size * row_bytes else np.zeros(0, np.int64)


def submit_sparse(runtime: BackgroundRuntime, tensor: torch.Tensor, name: str, op: str,
                  hot_rows: int = 0, reelect: int = 1
                  ) -> tuple[list[Handle], Callable[[list[Any]], torch.Tensor]]:
    """Submit the reduction of ``tensor`` (checked with check_sparse) under ``name``:
    the runtime's handles, and the step that makes the coalesced result (a new sparse
    tensor of ``tensor``'s size, dtype and device) from their results.

    ``hot_rows`` > 0 (a tensor of one sparse dimension whose name stays the same from
    call to call, as a DistributedOptimizer's gradients'): the rows most touched over the
    ranks so far, at most ``hot_rows``, elected again every ``reelect`` calls, are summed
    as a dense allreduce (through the switch where it serves: Libra's hot parameters);
    the other rows go by the exact gather. Every rank elects from the same counts, so
    every rank splits alike."""
    t = tensor.detach().coalesce()
    size = tuple(t.shape)
    indices = t.indices().t().contiguous()                 # nnz x sparse dims
    values = t.values().contiguous()                       # nnz x dense dims
    inside = bool(((indices >= 0) & (indices < torch.tensor(size[:t.sparse_dim()]))).all())
    layout = torch.tensor([[int(inside), t.sparse_dim(), *size]], dtype=torch.int64)
    table = None
    if hot_rows > 0 and t.sparse_dim() == 1 and inside:
        tables = _tables.setdefault(runtime, {})
        table = tables.get(name)
        if table is None or table.counts.size != size[0]:
            table = tables[name] = Table(np.zeros(size[0], np.int64), np.zeros(0, np.int64))
        if table.calls % reelect == 0 or table.calls == 1:  # (1: the first counts)
            table.hot = elect(table.counts, table.calls, hot_rows, runtime.size,
                              int(np.prod(size[1:])) * values.element_size())
        table.calls += 1
    hot = table.hot if table is not None else np.zeros(0, np.int64)
    rows = indices[:, 0].numpy() if t.sparse_dim() == 1 else np.zeros(0, np.int64)
    at = np.minimum(np.searchsorted(hot, rows), max(hot.size - 1, 0))
    is_hot = (hot[at] == rows) if hot.size else np.zeros(rows.size, bool)
    cold = torch.from_numpy(~is_hot) if hot.size else None
    parts = [(f"{name}.layout", layout),
             (f"{name}.indices", indices[cold] if cold is not None else indices),
             (f"{name}.values", values[cold] if cold is not None else values)]
    handles = [runtime.submit(data_request("allgather", part, part_name),
                              send=np.ascontiguousarray(to_numpy(part)))
               for part_name, part in parts]
    if hot.size:
        block = torch.zeros((hot.size, *values.shape[1:]), dtype=values.dtype)
        block[torch.from_numpy(at[is_hot])] = values[torch.from_numpy(is_hot)]
        touched = torch.zeros(hot.size, dtype=torch.int32)
        touched[torch.from_numpy(at[is_hot])] = 1
        hot_parts = [submit_allreduce(runtime, block, block, f"{name}.hot", Sum),
                     submit_allreduce(runtime, touched, touched, f"{name}.touched", Sum)]
        handles += [h for h, _ in hot_parts]
        table.bytes_through_allreduce += block.numel() * block.element_size()
    if table is not None:
        table.bytes_gathered += sum(p.numel() * p.element_size() for _, p in parts[1:])

    def finish(results: list[Any]) -> torch.Tensor:
        (rows_meta, _), (all_indices, _), (all_values, _) = results[:3]
        rows_meta = rows_meta.reshape(-1, layout.shape[1])
        outside = [r for r in range(rows_meta.shape[0]) if not rows_meta[r, 0]]
        if outside:
            raise ValueError(f"sparse allreduce '{name}': rank(s) {outside} passed indices "
                             f"outside their tensor's size")
        if not (rows_meta[:, 1:] == rows_meta[0, 1:]).all():
            shapes = "; ".join(f"rank {r}: {tuple(rows_meta[r, 2:].tolist())} with "
                               f"{rows_meta[r, 1]} sparse dims"
                               for r in range(rows_meta.shape[0]))
            raise ValueError(f"sparse allreduce '{name}': the ranks' tensors differ: "
                             f"{shapes}")
        gathered_indices = torch.from_numpy(all_indices.reshape(-1, t.sparse_dim()))
        gathered_values = from_numpy(all_values, values,
                                     (gathered_indices.shape[0], *values.shape[1:]))
        if hot.size:
            (_, finish_block), (_, finish_touched) = hot_parts
            summed = finish_block(results[3])
            counted = finish_touched(results[4]).numpy()
            present = torch.from_numpy(counted > 0)
            gathered_indices = torch.cat([gathered_indices,
                                          torch.from_numpy(hot[counted > 0]).reshape(-1, 1)])
            gathered_values = torch.cat([gathered_values, summed[present]])
        if table is not None:  # every rank counts the same touches
            np.add.at(table.counts, all_indices.reshape(-1), 1)
            if hot.size:
                table.counts[hot] += counted
                table.hot_rows_touched += int((counted > 0).sum())
            table.rows_touched += int(np.unique(gathered_indices[:, 0].numpy()).size)
        # (Every rank's indices were checked inside the size above.)
        result = torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, size,
                                         device=tensor.device,
                                         check_invariants=False).coalesce()
        if op == Average:
            result = result / rows_meta.shape[0]
        return result

    return handles, finish
