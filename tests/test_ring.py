"""The ring's segmentation, and the ring on one rank (ina_collectives.collectives.ring)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from ina_collectives.collectives.ops import Op
from ina_collectives.collectives.ring import Ring, segment_bounds
from ina_collectives.collectives.waiting import Deadline


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


@pytest.mark.parametrize("op", list(Op))
def test_one_rank_reduces_to_its_own_array(op):
    ring = Ring(MPI.COMM_SELF, chunk_bytes=64)
    buf = np.arange(100, dtype=np.float64)
    ring.allreduce(buf, op, Deadline(5.0))
    np.testing.assert_array_equal(buf, np.arange(100, dtype=np.float64))
