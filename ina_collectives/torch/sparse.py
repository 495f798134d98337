"""Sparse COO tensors reduced exactly: every rank's indices and values gathered, then
summed where indices meet (coalesced). What the Horovod API's ``sparse_allreduce_async``
and its DistributedOptimizer with sparse gradients, and the torch.distributed backend's
``all_reduce`` of a sparse tensor (DDP with ``nn.Embedding(sparse=True)``) share.

Hot rows (Libra): a tensor of one sparse dimension reduced again and again under one
name (a DistributedOptimizer's embedding gradient) has its most touched rows, counted
over every rank, summed as a dense allreduce, through the switch where it serves; the
other rows, and every row of any other tensor, go as below (``submit_sparse``). Which
rows, and when, the runtime decides (``runtime/hot_rows.py``: ``HotRows``, one per name);
this module splits the tensor by its answer and brings it what the ranks sent.

Three allgathers through the group's runtime, submitted together: each rank's layout
(its tensor's size, whether its indices lie inside it, and for hot rows which of them
it touched and how long its last call took), its indices (nnz x sparse
dims, int64) and its values (nnz x dense dims). The negotiation compares what it always
compares (the values' dtype and trailing dims, the indices' width); the layout rows
are compared here, on every rank alike, so ranks whose tables differ, or a rank whose
indices fall outside its table, raise ValueError on every rank naming them. A rank with
no entries (nnz 0) simply adds none. Hot rows add one allreduce of their dense block.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ..collectives.ops import Op, as_op
from ..runtime.background import BackgroundRuntime, Handle
from ..runtime.hot_rows import HotRows, locate, no_rows
from .staging import Sum, data_request, from_numpy, submit_allreduce, to_numpy


def check_sparse(tensor: Any, op: Op | str, what: str) -> torch.Tensor:
    """``tensor`` if it is a sparse COO tensor that ``op`` can reduce here; else
    TypeError or ValueError naming what is wrong."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what} takes a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if as_op(op) not in (Op.SUM, Op.AVERAGE):
        raise ValueError(f"{what}: op {op!r} is not Sum or Average (the only reductions of "
                         f"sparse tensors)")
    if not tensor.is_floating_point():
        raise TypeError(f"{what}: dtype {tensor.dtype}: sparse tensors are reduced in "
                        f"floating point here")
    return tensor


def layout_row(inside: bool, size: tuple[int, ...], sparse_dims: int, elapsed: float,
               touched: np.ndarray) -> np.ndarray:
    """A rank's row of the layout gather (int64): its length, whether its indices lie
    inside its size, its sparse dims, its size, its last call's time (µs) and which hot
    rows it touched (a bitmap, 64 rows a word)."""
    bits = np.packbits(touched.astype(bool), bitorder="little")
    words = np.zeros((bits.size + 7) // 8 * 8, np.uint8)
    words[:bits.size] = bits
    body = [int(inside), sparse_dims, len(size), *size, int(elapsed * 1e6), touched.size]
    return np.concatenate([np.array([len(body) + 1 + words.size // 8, *body], np.int64),
                           words.view(np.int64)])


def parse_layouts(gathered: np.ndarray) -> list[dict[str, Any]]:
    """The ranks' layout rows (layout_row) from their concatenation."""
    rows, at = [], 0
    while at < gathered.size:
        width = int(gathered[at])
        row = gathered[at + 1:at + width]
        dims = int(row[2])
        size = tuple(int(v) for v in row[3:3 + dims])
        nbits = int(row[4 + dims])
        bits = np.unpackbits(row[5 + dims:].view(np.uint8), bitorder="little")[:nbits]
        rows.append({"inside": bool(row[0]), "sparse_dims": int(row[1]), "size": size,
                     "elapsed": int(row[3 + dims]) / 1e6, "touched": bits})
        at += width
    return rows


# The hot rows of each runtime (a process set's, a group's), by tensor name.
_tables: weakref.WeakKeyDictionary[BackgroundRuntime, dict[str, HotRows]] = (
    weakref.WeakKeyDictionary())


def table_stats(runtime: BackgroundRuntime) -> dict[str, dict[str, Any]]:
    """stats()["sparse"]: per sparse tensor name, its hot set and traffic."""
    return {name: t.report() for name, t in _tables.get(runtime, {}).items()}


def submit_sparse(runtime: BackgroundRuntime, tensor: torch.Tensor, name: str, op: Op | str,
                  hot_rows: int = 0, reelect: int = 1
                  ) -> tuple[list[Handle], Callable[[list[Any]], torch.Tensor]]:
    """Submit the reduction of ``tensor`` (checked with check_sparse) under ``name``:
    the runtime's handles, and the step that makes the coalesced result (a new sparse
    tensor of ``tensor``'s size, dtype and device) from their results.

    ``hot_rows`` > 0 (a tensor of one sparse dimension whose name stays the same from
    call to call, as a DistributedOptimizer's gradients'): every ``reelect`` calls (a
    period; the first is exact, to time the gather), the rows most touched over the
    ranks so far, at most ``hot_rows``, are elected where they pay by bytes and summed
    as a dense allreduce (through the switch where it serves: Libra's hot parameters);
    the other rows go by the exact gather. A period with hot rows that was slower than
    the exact gather's is set aside (HotRows.choose). Every rank decides from the same
    counts and times, so every rank splits alike."""
    started = time.perf_counter()
    t = tensor.detach().coalesce()
    size = tuple(t.shape)
    indices = t.indices().t().contiguous()                 # nnz x sparse dims
    values = t.values().contiguous()                       # nnz x dense dims
    inside = bool(((indices >= 0) & (indices < torch.tensor(size[:t.sparse_dim()]))).all())
    table = None
    hot, previous_hot = no_rows(), False
    if hot_rows > 0 and t.sparse_dim() == 1:
        # Used whatever this rank's input (bad input is named in finish): every rank
        # must submit the same operations, the hot block included.
        tables = _tables.setdefault(runtime, {})
        table = tables.get(name)
        if table is None:
            table = tables[name] = HotRows.of_rows(size[0])
        hot, previous_hot = table.start_call(hot_rows, runtime.size,
                                             int(np.prod(size[1:])) * values.element_size(),
                                             reelect)
    rows = indices[:, 0].numpy() if t.sparse_dim() == 1 else no_rows()
    at, is_hot = locate(hot, rows)
    cold = torch.from_numpy(~is_hot) if hot.size else None
    touched = np.zeros(hot.size, bool)
    touched[at[is_hot]] = True
    layout = torch.from_numpy(layout_row(inside, size, t.sparse_dim(),
                                         table.elapsed if table is not None else 0.0,
                                         touched))
    parts = [(f"{name}.layout", layout),
             (f"{name}.indices", indices[cold] if cold is not None else indices),
             (f"{name}.values", values[cold] if cold is not None else values)]
    handles = [runtime.submit(data_request("allgather", part, part_name),
                              send=np.ascontiguousarray(to_numpy(part)))
               for part_name, part in parts]
    if hot.size:
        block = torch.zeros((hot.size, *values.shape[1:]), dtype=values.dtype)
        block[torch.from_numpy(at[is_hot])] = values[torch.from_numpy(is_hot)]
        handle, finish_block = submit_allreduce(runtime, block, block, f"{name}.hot", Sum)
        handles.append(handle)
        table.bytes_through_allreduce += block.numel() * block.element_size()
    if table is not None:
        table.bytes_gathered += sum(p.numel() * p.element_size() for _, p in parts[1:])
        done_at = [started]

        def on_done(_: Handle) -> None:
            done_at[0] = max(done_at[0], time.perf_counter())
        for handle in handles:
            handle.add_done_callback(on_done)

    def finish(results: list[Any]) -> torch.Tensor:
        finishing = time.perf_counter()
        (all_layouts, _), (all_indices, _), (all_values, _) = results[:3]
        layouts = parse_layouts(np.asarray(all_layouts).reshape(-1))
        outside = [r for r, row in enumerate(layouts) if not row["inside"]]
        if outside:
            raise ValueError(f"sparse allreduce '{name}': rank(s) {outside} passed indices "
                             f"outside their tensor's size")
        if any((row["size"], row["sparse_dims"]) != (layouts[0]["size"],
                                                     layouts[0]["sparse_dims"])
               for row in layouts):
            shapes = "; ".join(f"rank {r}: {row['size']} with {row['sparse_dims']} "
                               f"sparse dims" for r, row in enumerate(layouts))
            raise ValueError(f"sparse allreduce '{name}': the ranks' tensors differ: "
                             f"{shapes}")
        gathered_indices = torch.from_numpy(all_indices.reshape(-1, t.sparse_dim()))
        gathered_values = from_numpy(all_values, values,
                                     (gathered_indices.shape[0], *values.shape[1:]))
        counted = None
        if hot.size:
            summed = finish_block(results[3])
            counted = np.sum([row["touched"] for row in layouts], axis=0, dtype=np.int64)
            present = torch.from_numpy(counted > 0)
            gathered_indices = torch.cat([gathered_indices,
                                          torch.from_numpy(hot[counted > 0]).reshape(-1, 1)])
            gathered_values = torch.cat([gathered_values, summed[present]])
        if table is not None:  # every rank counts the same touches and times
            # (every rank's size is this one, checked above)
            table.end_call(size[0], all_indices.reshape(-1), hot, counted,
                           max(row["elapsed"] for row in layouts), previous_hot, reelect)
        # (Every rank's indices were checked inside the size above.)
        result = torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, size,
                                         device=tensor.device,
                                         check_invariants=False).coalesce()
        if as_op(op) is Op.AVERAGE:
            result = result / len(layouts)
        if table is not None:  # the exchange and this step, not the caller's delay
            table.elapsed = done_at[0] - started + time.perf_counter() - finishing
        return result

    return handles, finish
