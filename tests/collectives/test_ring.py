"""The ring's segmentation, and the ring on one rank (ina_collectives.collectives.ring)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from ina_collectives.collectives.engine import AllreduceCall
from ina_collectives.collectives.ops import Op
from ina_collectives.collectives.ring import Ring, RingEngine, segment_bounds
from ina_collectives.collectives.waiting import Deadline
from ina_collectives.settings import Settings


@given(count=st.integers(0, 10_000), parts=st.integers(1, 70))
def test_segments_cover_the_range_in_order_with_sizes_within_one(count, parts):
    bounds = segment_bounds(count, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_parts_than_elements_leaves_empty_segments_last():
    assert segment_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert segment_bounds(0, 3) == [(0, 0)] * 3
    assert segment_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]  # the larger ones first


@pytest.mark.parametrize("op", list(Op))
def test_one_rank_reduces_to_its_own_array(op):
    ring = Ring(MPI.COMM_SELF, chunk_bytes=64)
    buf = np.arange(100, dtype=np.float64)
    ring.allreduce(buf, op, Deadline(5.0))
    np.testing.assert_array_equal(buf, np.arange(100, dtype=np.float64))


def test_one_rank_keeps_integers_and_empty_buffers_as_they_are():
    ring = Ring(MPI.COMM_SELF, chunk_bytes=8)
    ints = np.array([-(2**31), 0, 2**31 - 1], np.int32)
    ring.allreduce(ints, Op.AVERAGE, Deadline(5.0))
    assert ints.tolist() == [-(2**31), 0, 2**31 - 1]
    empty = np.empty(0, np.float32)
    ring.allreduce(empty, Op.SUM, Deadline(5.0))
    assert empty.size == 0


def test_the_engine_copies_the_input_then_reduces_in_place():
    engine = RingEngine(MPI.COMM_SELF, Settings(ring_min_bytes=0))
    send, recv = np.arange(5, dtype=np.float32), np.full(5, -1, np.float32)
    engine.run(AllreduceCall(send, recv, Op.SUM), Deadline(5.0))
    assert recv.tolist() == [0, 1, 2, 3, 4] and send.tolist() == [0, 1, 2, 3, 4]
