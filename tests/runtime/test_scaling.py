"""runtime/scaling.py: Horovod's prescale, postscale and AVERAGE, and which op the
collectives are asked for."""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives.collectives.ops import Op
from ina_collectives.runtime import scaling
from ina_collectives.runtime.negotiation import OpRequest


class Recorder:
    """Stands in for Collectives: records the op asked for, adds a second rank's copy."""

    def __init__(self, quorum: bool = False):
        self.quorum, self.asked = quorum, []

    def quorum_active(self) -> bool:
        return self.quorum

    def allreduce_flat(self, send, buf, op, bits, key=None, present=0, following=None):
        self.asked.append(op)
        self.present = present
        buf += buf if op is not Op.AVERAGE else 0

    def reduce_scatter_flat(self, buf, op, bounds):
        self.asked.append((op, bounds))
        buf += buf


def request(op: str, dtype: str = "float32", prescale: float = 1.0, postscale: float = 1.0,
            shape: tuple = (4,)) -> OpRequest:
    return OpRequest("allreduce", "t", dtype, dtype, shape, op, prescale=prescale,
                     postscale=postscale)


def test_average_is_a_sum_divided_after_unless_the_engine_divides_in_quorum_mode():
    req = request("average")
    assert scaling.collective_op(req, req.wire, quorum_active=False) is Op.SUM
    assert scaling.collective_op(req, req.wire, quorum_active=True) is Op.AVERAGE
    ints = request("average", "int32")
    assert scaling.collective_op(ints, ints.wire, quorum_active=True) is Op.SUM
    scaled = request("average", postscale=2.0)
    assert scaling.collective_op(scaled, scaled.wire, quorum_active=True) is Op.SUM
    assert scaling.collective_op(request("max"), np.dtype("float32"), True) is Op.MAX


@pytest.mark.parametrize("op, pre, post, want", [
    ("sum", 1.0, 1.0, 2.0), ("average", 1.0, 1.0, 1.0), ("sum", 3.0, 1.0, 6.0),
    ("average", 1.0, 4.0, 4.0), ("sum", 0.5, 2.0, 2.0)])
def test_reduce_applies_horovods_scaling_around_the_reduction(op, pre, post, want):
    buf = np.ones(4, np.float32)
    scaling.reduce(Recorder(), buf, request(op, prescale=pre, postscale=post), size=2)
    np.testing.assert_array_equal(buf, np.full(4, want, np.float32))


def test_a_call_some_ranks_are_absent_from_averages_over_those_present():
    """Quorum mode's running ahead: the absent ranks pass zeros and are not counted, so
    Average divides by the ranks present (here 2 of 3), in the engine or after it."""
    for quorum in (False, True):
        collectives = Recorder(quorum)
        buf = np.ones(4, np.float32)
        scaling.reduce(collectives, buf, request("average"), size=3, present=0b011)
        assert collectives.present == 0b011
        if not quorum:  # (in quorum mode the engine divides: the Recorder does not)
            np.testing.assert_array_equal(buf, np.full(4, 1.0, np.float32))


def test_a_reducescatter_reduces_every_part_and_scales_this_ranks():
    collectives = Recorder()
    buf = np.arange(6, dtype=np.float64)
    req = request("average", "float64", shape=(3, 2))
    scaling.reduce(collectives, buf, req, size=2, part=(4, 6))
    assert collectives.asked == [(Op.SUM, [(0, 4), (4, 6)])]
    np.testing.assert_array_equal(buf, [0, 2, 4, 6, 4, 5])  # only rank 1's rows divided


def test_split_rows_follows_tensor_split():
    assert [scaling.split_rows(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [scaling.split_rows(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2),
                                                              (2, 2)]


def test_scale_truncates_integers_and_rounds_float16_once():
    ints = np.array([5, -5, 7], np.int32)
    scaling.scale(ints, 0.5)
    np.testing.assert_array_equal(ints, [2, -2, 3])
    half = np.array([0.1], np.float16)
    scaling.scale(half, 3.0)
    assert half[0] == np.float16(np.float32(np.float16(0.1)) * np.float32(3.0))
