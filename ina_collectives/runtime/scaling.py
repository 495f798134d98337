"""Horovod's scaling of a reduction: the prescale, the reduction, then the postscale or
AVERAGE's division by the number of ranks, each as Horovod rounds it."""
from __future__ import annotations

from typing import Callable, Hashable

import numpy as np

from ..collectives.chooser import Collectives, Following
from ..collectives.ops import Op
from .negotiation import OpRequest


def collective_op(req: OpRequest, dtype: np.dtype, quorum_active: bool) -> Op:
    """The op the collectives are asked for: AVERAGE as a SUM that ``reduce`` divides
    afterwards, except in quorum mode, where a switch-served chunk is divided by the
    workers it counted, which only the engine knows (docs/quorum.md)."""
    if req.op is Op.AVERAGE and not (req.postscale == 1.0 and dtype.kind == "f"
                                     and quorum_active):
        return Op.SUM
    return req.op


def reduce(collectives: Collectives, buffer: np.ndarray, req: OpRequest, size: int,
           part: tuple[int, int] | None = None, key: Hashable = None, present: int = 0,
           prescaled: bool = False,
           following: Callable[[], Following | None] | None = None) -> None:
    """Reduce ``buffer`` in place over all ``size`` ranks with Horovod's semantics:
    prescale, reduce, postscale (Average: divided by the number of ranks). ``part``: only
    buffer[part[0]:part[1]] is wanted on this rank (a reducescatter: the ring's
    reduce-scatter, (n-1)/n of the bytes where an allreduce moves them all each way; the
    other ranks' parts are given too). ``key``: what the call is known by, alike on every
    rank (AllreduceCall.key). ``present``: the ranks whose input counts (0: all): the
    others pass zeros, and Average divides by those counted (AllreduceCall.present).
    ``prescaled``: ``ahead`` made the buffer ready already. ``following``: the caller's
    next allreduce made ready (Collectives.allreduce_flat)."""
    op = (collective_op(req, buffer.dtype, collectives.quorum_active()) if prescaled
          else ahead(collectives, buffer, req))
    if op is Op.AVERAGE:  # divided by the engine
        collectives.allreduce_flat(None, buffer, op, req.switch_bits, key, present,
                                   following)
        return
    if part is None:
        collectives.allreduce_flat(None, buffer, op, req.switch_bits, key, present,
                                   following)
    else:
        row = buffer.size // max(req.shape[0], 1)
        bounds = [(a * row, b * row) for a, b in
                  (split_rows(req.shape[0], size, r) for r in range(size))]
        collectives.reduce_scatter_flat(buffer, op, bounds)
        buffer = buffer[part[0]:part[1]]
    average = req.op is Op.AVERAGE
    if present:
        size = present.bit_count()
    if average and req.postscale == 1.0:
        # A true division, not Horovod's multiplication by (float)(1 / size): one
        # rounding fewer, and what Horovod's own tests expect at 3 ranks.
        divide(buffer, size)
        return
    post = req.postscale / (size if average else 1)
    if post != 1.0:
        scale(buffer, post)


def ahead(collectives: Collectives, buffer: np.ndarray, req: OpRequest) -> Op:
    """What ``reduce`` does before its call: the buffer prescaled; the op the call takes."""
    if req.prescale != 1.0:
        scale(buffer, req.prescale)
    return collective_op(req, buffer.dtype, collectives.quorum_active())


def split_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of part ``index``: as even as possible, the first parts larger
    (torch.tensor_split's rule)."""
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def scale(buffer: np.ndarray, factor: float) -> None:
    """buffer *= factor as Horovod's CPU ScaleBuffer does: floats in their own dtype,
    float16 in float32 math rounded once (not by a factor rounded to float16 first),
    integers in float64, truncated toward zero."""
    if buffer.dtype == np.float16:
        buffer[...] = buffer.astype(np.float32) * np.float32(factor)
    elif buffer.dtype.kind == "f":
        np.multiply(buffer, buffer.dtype.type(factor), out=buffer)
    else:
        buffer[...] = np.trunc(buffer * factor)


def divide(buffer: np.ndarray, n: int) -> None:
    """buffer /= n: floats correctly rounded (float16 through float32), integers
    truncated toward zero, exactly."""
    if n == 1:
        return
    if buffer.dtype == np.float16:
        buffer[...] = buffer.astype(np.float32) / np.float32(n)
    elif buffer.dtype.kind == "f":
        np.divide(buffer, buffer.dtype.type(n), out=buffer)
    else:
        inexact_negative = (buffer < 0) & (buffer % n != 0)
        np.floor_divide(buffer, n, out=buffer, casting="unsafe")
        buffer[inexact_negative] += 1
