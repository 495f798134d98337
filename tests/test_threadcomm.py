"""The thread communicator of the multi-rank unit tests (tests/threadcomm.py) does what
mpi4py's does for the calls the library makes."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from tests.threadcomm import RankFailed, run_ranks


def test_the_collectives_give_every_rank_mpis_results():
    def rank(comm):
        r, n = comm.Get_rank(), comm.Get_size()
        out = {}
        x = np.array([r + 1, 10 * (r + 1)], np.int64)
        for name, op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
            got = np.empty_like(x)
            comm.Iallreduce(x, got, op).Wait()
            out[name] = got.tolist()
        inplace = x.copy()
        comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM)
        out["in place"] = inplace.tolist()
        buf = np.full(3, r, np.int16)
        comm.Bcast(buf, root=n - 1)
        out["bcast"] = buf.tolist()
        gathered = np.empty((n, 2), np.int32)
        comm.Allgather(np.array([r, r * r], np.int32), gathered)
        out["allgather"] = gathered.tolist()
        counts = [q + 1 for q in range(n)]
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        flat = np.zeros(sum(counts), np.float32)
        comm.Iallgatherv(np.full(r + 1, r, np.float32), [flat, counts, displs,
                                                         MPI.FLOAT]).Wait()
        out["allgatherv"] = flat.tolist()
        dup = comm.Dup()
        out["dup"] = dup.allreduce(r, op=MPI.SUM)
        out["objects"] = (comm.allgather({"r": r}), comm.bcast(f"from {r}", root=1))
        comm.Barrier()
        return out

    results = run_ranks(3, rank)
    assert all(r == results[0] for r in results), results
    got = results[0]
    assert got["sum"] == [6, 60] and got["max"] == [3, 30] and got["min"] == [1, 10]
    assert got["in place"] == [6, 60] and got["bcast"] == [2, 2, 2]
    assert got["allgather"] == [[0, 0], [1, 1], [2, 4]]
    assert got["allgatherv"] == [0, 1, 1, 2, 2, 2]
    assert got["dup"] == 3
    assert got["objects"] == ([{"r": 0}, {"r": 1}, {"r": 2}], "from 1")


def test_ranks_whose_calls_differ_are_told():
    def rank(comm):
        if comm.Get_rank() == 0:
            comm.Barrier()
        else:
            comm.Bcast(np.zeros(1), root=0)

    with pytest.raises(RankFailed, match="the ranks' calls differ"):
        run_ranks(2, rank, timeout=1)


def test_a_bcast_into_a_buffer_of_another_type_is_refused_as_mpi_refuses_it():
    """MPI requires the same type signature on every rank: a float64 buffer does not
    take a float32 broadcast (mpi4py would not convert it either)."""
    def rank(comm):
        buf = np.zeros(4, np.float32 if comm.Get_rank() == 0 else np.float64)
        comm.Bcast(buf, root=0)

    with pytest.raises(RankFailed) as refused:
        run_ranks(2, rank, timeout=5)
    assert str(refused.value.__cause__) == (
        "rank 1's bcast buffer is 4 x float64, root 0's 4 x float32: MPI's type "
        "signatures differ")
