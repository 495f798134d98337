"""The engine choice (ina_collectives.collectives) on one rank: why each engine declines
a call, which engine serves it, the reasons recorded, and the chooser's argument checks."""
from __future__ import annotations

import socket

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives import Collectives
from ina_collectives.collectives.engine import AllreduceCall
from ina_collectives.collectives.ina_engine import InaEngine
from ina_collectives.collectives.mpi_engine import MpiEngine
from ina_collectives.collectives.ops import Op
from ina_collectives.collectives.ring import RingEngine
from ina_collectives.settings import Settings


def call(dtype="float32", size=16, op=Op.SUM):
    return AllreduceCall(None, np.zeros(size, dtype), op)


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ring_declines_small_arrays_mpi_reduces_and_dtypes_it_lacks():
    ring = RingEngine(MPI.COMM_SELF, Settings(ring_min_bytes=1024))
    assert ring.declines(call(size=1024 // 4)) is None
    assert "below ring_min_bytes (1024)" in ring.declines(call(size=10))
    assert "complex64 is left to MPI" in ring.declines(call("complex64", 1000))


def test_mpi_declines_what_it_cannot_reduce():
    mpi = MpiEngine(MPI.COMM_SELF)
    assert mpi.declines(call("complex128")) is None
    assert "no MPI reduction for object" in mpi.declines(call("object"))


def test_ina_with_no_aggregator_answering_is_unavailable_with_the_reason():
    settings = Settings(switch=f"127.0.0.1:{closed_port()}", switch_join_timeout=0.3)
    engine = InaEngine(MPI.COMM_SELF, settings)
    try:
        reason = engine.declines(call(size=1 << 20))
        assert reason.startswith("ina: aggregator unavailable (rank 0: ")
        assert engine.link is None
    finally:
        engine.close()


def test_ina_declines_what_the_switch_cannot_sum():
    engine = InaEngine.__new__(InaEngine)  # the rules alone, no link
    engine.unavailable, engine.settings = None, Settings(switch_min_bytes=1024)
    assert engine.declines(call(size=1024)) is None
    assert engine.declines(call("float64", 1024, Op.AVERAGE)) is None
    assert "int32 is not a float" in engine.declines(call("int32", 1024))
    assert "op MAX is not SUM or AVERAGE" in engine.declines(call(size=1024, op=Op.MAX))
    assert "below switch_min_bytes (1024)" in engine.declines(call(size=8))


@pytest.fixture
def one_rank():
    coll = Collectives(MPI.COMM_SELF, Settings(ring_min_bytes=64))
    yield coll
    coll.free()


def test_the_chooser_records_which_engine_served_and_why_others_declined(one_rank):
    small = one_rank.allreduce(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(small, np.arange(4, dtype=np.float32))
    assert one_rank.stats.last == {"engine": "mpi", "bytes": 16,
                                   "passed_over": ["ring: below ring_min_bytes (64)"]}
    big = np.arange(100, dtype=np.float64)
    out = one_rank.allreduce(big, op="average")
    np.testing.assert_array_equal(out, big)
    snap = one_rank.stats.snapshot()
    assert snap["engines"] == {"mpi": 1, "ring": 1} and snap["calls"] == 2
    assert snap["fallback_reasons"] == {"ring: below ring_min_bytes (64)": 1}
    one_rank.allreduce(np.ones(3, np.complex64))
    assert one_rank.stats.last["engine"] == "mpi"


def test_the_chooser_checks_its_arguments(one_rank):
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="AVERAGE is not defined for dtype int32"):
        one_rank.allreduce(np.ones(8, np.int32), op=Op.AVERAGE)
    with pytest.raises(TypeError, match="dtype object"):
        one_rank.allreduce(np.array([None] * 3))
    with pytest.raises(ValueError, match="out has shape"):
        one_rank.allreduce(x, out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="out has dtype"):
        one_rank.allreduce(x, out=np.empty(8, np.float64))
    with pytest.raises(ValueError, match="unknown op 'median'"):
        one_rank.allreduce(x, op="median")
    with pytest.raises(ValueError, match="MIN, MAX, AVERAGE; use ina_collectives.mpi"):
        one_rank.allreduce(x, op=MPI.MAXLOC)
    assert one_rank.stats.calls == 0  # nothing reached an engine


def test_non_contiguous_and_in_place_calls(one_rank):
    x = np.arange(20, dtype=np.float32)[::2]
    np.testing.assert_array_equal(one_rank.allreduce(x), x)
    y = np.arange(10, dtype=np.float64)
    assert one_rank.allreduce(y, out=y) is y
    np.testing.assert_array_equal(y, np.arange(10, dtype=np.float64))
