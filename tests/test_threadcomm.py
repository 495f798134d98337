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


def test_split_and_create_group_make_communicators_of_some_ranks_as_mpi_does():
    """Split by color, ordered by key; Split_type(COMM_TYPE_SHARED) keeps every rank (one
    process is one node); Create_group is collective over its members alone, and a second
    one of the same ranks and tag is another communicator."""
    def rank(comm):
        r = comm.Get_rank()
        halves = comm.Split(r % 2, key=-r)  # (key -r: the highest rank first)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=r)
        out = {"half": (halves.Get_rank(), halves.Get_size(), halves.allgather(r)),
               "node": (node.Get_rank(), node.Get_size())}
        group = comm.Get_group().Incl([1, 3])
        if r in (1, 3):
            first = comm.Create_group(group, tag=5)
            second = comm.Create_group(group, tag=5)
            out["group"] = (first.Get_rank(), first.Get_size(), first.allgather(r),
                            second.allreduce(r))
        return out

    results = run_ranks(4, rank)
    assert [got["half"] for got in results] == [
        (1, 2, [2, 0]), (1, 2, [3, 1]), (0, 2, [2, 0]), (0, 2, [3, 1])]
    assert [got["node"] for got in results] == [(r, 4) for r in range(4)]
    assert [got.get("group") for got in results] == [
        None, (0, 2, [1, 3], 4), None, (1, 2, [1, 3], 4)]


def test_a_rank_that_stops_leaves_the_others_calls_open_on_every_communicator():
    """After stop(), rank 1's calls reach nobody, on its communicator and on one it made
    before: the others' requests stay open (their bounded waits end them), and rank 1's
    own never complete."""
    def rank(comm):
        dup = comm.Dup()
        if comm.Get_rank() == 1:
            comm.stop()
        request = dup.Ibarrier()
        seen = [request.Test() for _ in range(3)]
        with pytest.raises(RuntimeError, match="waited 0.2 s"):
            request.Wait(0.2)
        return seen

    assert run_ranks(2, rank, timeout=10) == [[False] * 3, [False] * 3]
