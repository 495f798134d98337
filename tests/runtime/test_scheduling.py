"""runtime/scheduling.py: what a cycle runs of the ready allreduces, as pure functions
(docs/ordering.md)."""
from __future__ import annotations

import numpy as np

from ina_collectives.runtime import scheduling
from ina_collectives.runtime.negotiation import OpRequest, Ready


def ready(name: str, count: int, dtype: str = "float32", priority: int = 0,
          op: str = "sum", prescale: float = 1.0) -> Ready:
    request = OpRequest("allreduce", name, dtype, dtype, (count,), op, prescale=prescale,
                        priority=priority)
    return Ready(name, {0: request})


def test_a_request_carries_an_op_and_a_numpy_dtype():
    req = ready("g", 4, "float16", op="average").any_request()
    assert req.wire == np.dtype("float16") and req.op.name == "AVERAGE"
    assert req.describe() == "allreduce 'g' float16[4] average"


def test_cut_keeps_small_tensors_whole_and_cuts_large_ones_at_sub_block_multiples():
    small, large = ready("small", 100), ready("large", 1000)
    pieces, counts = scheduling.cut([small, large], limit=1024, block=32, first=7)
    assert counts == {"small": 1, "large": 4}
    # 1024 bytes = 256 float32, a multiple of 32: pieces of 256, the last shorter
    assert [(p.item.name, p.start, p.stop, p.order) for p in pieces] == [
        ("small", 0, 100, 7), ("large", 0, 256, 8), ("large", 256, 512, 8),
        ("large", 512, 768, 8), ("large", 768, 1000, 8)]
    # no limit: whole; an empty tensor is one piece
    pieces, counts = scheduling.cut([large, ready("empty", 0)], 0, 32, 0)
    assert counts == {"large": 1, "empty": 1} and pieces[1].size == 0


def test_cut_rounds_a_partition_down_to_the_sub_block_but_never_below_it():
    pieces, _ = scheduling.cut([ready("t", 100)], limit=40, block=32, first=0)
    assert [p.size for p in pieces] == [32, 32, 32, 4]
    ints, _ = scheduling.cut([ready("i", 30, "int32")], limit=40, block=32, first=0)
    assert [p.size for p in ints] == [10, 10, 10]  # integers align to elements


def test_order_is_by_priority_then_readiness_unless_fifo():
    pieces, _ = scheduling.cut([ready("late", 8, priority=5), ready("soon", 8, priority=1),
                                ready("tie", 8, priority=1)], 0, 32, 0)
    assert [p.item.name for p in scheduling.order(pieces, fifo=False)] == [
        "soon", "tie", "late"]
    assert [p.item.name for p in scheduling.order(pieces, fifo=True)] == [
        "late", "soon", "tie"]


def test_layout_puts_fused_float_pieces_at_sub_block_multiples():
    pieces, _ = scheduling.cut([ready("a", 5), ready("b", 40), ready("c", 1)], 0, 32, 0)
    assert scheduling.layout(pieces[:1], 32) == ([0], 5)       # alone: no padding
    assert scheduling.layout(pieces, 32) == ([0, 32, 96], 97)
    ints, _ = scheduling.cut([ready("x", 5, "int64"), ready("y", 3, "int64")], 0, 32, 0)
    assert scheduling.layout(ints, 32) == ([0, 5], 8)


def test_fusion_groups_share_dtype_op_and_scale_and_respect_the_threshold():
    items = [ready("a", 64), ready("b", 64, "float64"), ready("c", 64),
             ready("d", 64, op="average"), ready("e", 64, prescale=2.0), ready("f", 64)]
    pieces, _ = scheduling.cut(items, 0, 32, 0)
    groups = scheduling.fusion_groups(pieces, threshold=1 << 20, partition_bytes=0)
    assert [[p.item.name for p in g] for g in groups] == [
        ["a", "c", "f"], ["b"], ["d"], ["e"]]
    # a threshold of two float32 tensors of 64: a new group after each two
    groups = scheduling.fusion_groups(pieces, threshold=512, partition_bytes=0)
    assert [[p.item.name for p in g] for g in groups][0] == ["a", "c"]
    # partition_bytes lowers the threshold where it is smaller
    groups = scheduling.fusion_groups(pieces, threshold=1 << 20, partition_bytes=256)
    assert [[p.item.name for p in g] for g in groups][0] == ["a"]


def test_take_runs_at_least_one_group_and_carries_the_rest_past_the_budget():
    pieces, _ = scheduling.cut([ready(n, 64) for n in "abcd"], 0, 32, 0)
    groups = [[p] for p in pieces]  # 256 bytes each
    run, carry = scheduling.take(groups, budget=512, block=32)
    assert [g[0].item.name for g in run] == ["a", "b"] and [p.item.name for p in carry] == [
        "c", "d"]
    run, carry = scheduling.take(groups, budget=1, block=32)
    assert len(run) == 1 and len(carry) == 3
    run, carry = scheduling.take(groups, budget=0, block=32)
    assert len(run) == 4 and carry == []
