"""torch/distributed.py's process group ("ina") at 2-3 ranks in one process (a thread a
rank, tests/torch/ina_groups.py): its Work objects as torch's DistributedTest expects
them (wait, is_completed, get_future, the deprecated result, is_success and exception),
allreduce of every op and dtype, allgather, broadcast, barrier, reduce_scatter, scatter,
gather, and the errors: a call whose shape, dtype, op or kind differs across ranks fails
on every rank naming each rank's, an unsupported op or dtype is refused naming it, a
call another rank never makes fails within the group's timeout. The peers are the
threads' ThreadPeers, and gloo's made from a shared HashStore (the library's own path
without MPI) where a test says so."""
from __future__ import annotations

import datetime
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ina_collectives.torch import distributed as ina_dist
from tests.torch.ina_groups import on_groups, settled, thread_peers


@pytest.fixture(autouse=True)
def _peers(monkeypatch):
    thread_peers(monkeypatch)


def reduce_opts(name: str) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, name)
    return opts


def failure(work) -> BaseException:
    """What ``work.wait()`` raised (AssertionError if it did not)."""
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        return exc
    raise AssertionError("wait() returned: the call did not fail")


# -- Work ----------------------------------------------------------------------------------

def test_a_work_completes_in_place_and_its_future_holds_the_reduced_tensor():
    def body(pg, r):
        t = torch.full((5,), float(r + 1))
        work = pg.allreduce([t])
        assert isinstance(work, dist.Work)
        assert work.wait() is True
        assert work.is_completed()
        (value,) = work.get_future().value()
        # The future chains, as DDP's hooks use it.
        doubled = settled(work.get_future().then(lambda f: f.value()[0] * 2))
        return t.clone(), value.data_ptr() == t.data_ptr(), doubled

    for t, same, doubled in on_groups(3, body):
        assert t.tolist() == [6.0] * 5
        assert same  # the caller's tensor, reduced in place
        assert doubled.tolist() == [12.0] * 5


def test_a_work_is_not_completed_until_every_rank_has_made_the_call():
    checked = threading.Event()

    def body(pg, r):
        t = torch.full((3,), float(r))
        if r == 1:
            assert checked.wait(10)
            pg.allreduce([t]).wait()
            return t.tolist(), None
        work = pg.allreduce([t])
        seen = []
        for _ in range(5):
            time.sleep(0.04)
            seen.append(work.is_completed() or work.get_future().done())
        checked.set()
        work.wait()
        return t.tolist(), (seen, work.is_completed())

    first, second = on_groups(2, body)
    assert first[0] == second[0] == [1.0] * 3
    seen, completed = first[1]
    assert seen == [False] * 5 and completed


def test_wait_on_a_call_another_rank_never_makes_fails_within_the_groups_timeout():
    def body(pg, r):
        if r == 1:
            return None
        work = pg.allreduce([torch.ones(3)])
        start = time.monotonic()
        error = failure(work)
        return error, time.monotonic() - start, work.is_completed()

    (error, elapsed, completed), _ = on_groups(2, body, seconds=1.5)
    assert isinstance(error, dist.DistBackendError), repr(error)
    assert "waited 1.5 s for all 2 ranks to enter allreduce #1" in str(error), error
    assert 1.0 < elapsed < 6.0, elapsed
    assert completed  # failed: done


def test_wait_with_a_timeout_returns_within_that_timeout():
    done = threading.Event()

    def body(pg, r):
        if r == 1:
            assert done.wait(20)
            return None
        work = pg.allreduce([torch.ones(3)])
        start = time.monotonic()
        try:
            error = failure_within(work, datetime.timedelta(seconds=0.3))
        finally:
            done.set()
        return error, time.monotonic() - start

    def failure_within(work, timeout):
        try:
            work.wait(timeout)
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    (error, elapsed), _ = on_groups(2, body, seconds=20.0)
    assert isinstance(error, dist.DistBackendError), repr(error)
    assert elapsed < 10, f"wait(timeout=0.3 s) returned after {elapsed:.1f} s (the group waits 20)"


def test_a_works_result_is_its_output_tensors():
    def body(pg, r):
        t = torch.full((2,), float(r))
        work = pg.allreduce([t])
        work.wait()
        return [x.tolist() for x in work.result()]

    assert on_groups(2, body) == [[[1.0, 1.0]]] * 2


def test_a_failed_work_says_it_failed_through_is_success_and_exception():
    def body(pg, r):
        work = pg.allreduce([torch.ones(3 + r)])
        failure(work)
        return work.is_success(), work.exception()

    for success, exception in on_groups(2, body):
        assert success is False
        assert exception is not None


def test_a_successful_work_says_so_through_is_success_and_exception():
    def body(pg, r):
        work = pg.allreduce([torch.ones(3)])
        work.wait()
        return work.is_success(), work.exception()

    assert on_groups(2, body) == [(True, None)] * 2


# -- allreduce -----------------------------------------------------------------------------

INPUTS = [[1.0, -1.0, 2.0, 0.5], [2.0, 4.0, -2.0, 0.25], [3.0, 0.5, 2.0, 8.0]]
EXPECTED = {"SUM": np.sum, "AVG": np.mean, "PRODUCT": np.prod, "MIN": np.min,
            "MAX": np.max}


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_allreduce_computes_each_op_over_three_ranks(op):
    def body(pg, r):
        t = torch.tensor(INPUTS[r], dtype=torch.float64)
        pg.allreduce([t], reduce_opts(op)).wait()
        return t.tolist()

    expected = EXPECTED[op](np.array(INPUTS), axis=0).tolist()
    assert on_groups(3, body) == [expected] * 3


@pytest.mark.parametrize("op,ufunc", [("BAND", np.bitwise_and), ("BOR", np.bitwise_or),
                                      ("BXOR", np.bitwise_xor)])
def test_allreduce_computes_the_bitwise_ops_over_integers(op, ufunc):
    values = [[0b1011, 0b0110, -1], [0b1110, 0b0011, 5], [0b0111, 0b1111, 12]]

    def body(pg, r):
        t = torch.tensor(values[r], dtype=torch.int32)
        pg.allreduce([t], reduce_opts(op)).wait()
        return t.tolist()

    expected = ufunc.reduce(np.array(values, np.int32), axis=0).tolist()
    assert on_groups(3, body) == [expected] * 3


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_sums_every_supported_dtype_exactly_and_keeps_it(dtype):
    def body(pg, r):
        t = torch.arange(7, dtype=dtype) * (r + 1)
        pg.allreduce([t]).wait()  # (no opts: SUM, as torch's default)
        return t

    for t in on_groups(2, body):
        assert t.dtype == dtype
        assert t.tolist() == (torch.arange(7) * 3).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=str)
def test_allreduce_averages_floats_as_ddp_does(dtype):
    def body(pg, r):
        t = torch.tensor([1.0, 2.0, -3.0], dtype=dtype) * (2 * r + 1)  # x1, x3, x5
        pg.allreduce([t], reduce_opts("AVG")).wait()
        return t

    for t in on_groups(3, body):
        assert t.dtype == dtype and t.tolist() == [3.0, 6.0, -9.0]


def test_allreduce_of_several_and_non_contiguous_tensors_writes_each_in_place():
    def body(pg, r):
        a = torch.full((3,), float(r))
        b = (torch.arange(12.0).reshape(3, 4) * (r + 1)).t()  # a transposed view
        c = torch.full((2, 2), r + 1, dtype=torch.int64)
        pg.allreduce([a, b]).wait()
        pg.allreduce_coalesced([c], reduce_opts("MAX")).wait()
        return a.tolist(), b.is_contiguous(), b.clone(), c.tolist()

    for a, contiguous, b, c in on_groups(2, body):
        assert a == [1.0] * 3 and not contiguous
        assert torch.equal(b, (torch.arange(12.0).reshape(3, 4) * 3).t())
        assert c == [[2, 2], [2, 2]]


def test_dist_all_reduce_reaches_the_group_async_and_blocking():
    def body(pg, r):
        t = torch.full((4,), float(r + 1))
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg, async_op=True)
        work.wait()
        u = torch.full((2,), float(r))
        dist.all_reduce(u, op=dist.ReduceOp.MAX, group=pg)
        return t.tolist(), u.tolist()

    assert on_groups(3, body) == [([2.0] * 4, [2.0, 2.0])] * 3


# -- the other collectives ---------------------------------------------------------------------

def test_allgather_gives_every_rank_every_ranks_tensor_in_rank_order():
    def body(pg, r):
        mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
        outputs = [torch.empty(2, 3) for _ in range(3)]
        pg.allgather([outputs], [mine]).wait()
        flat = torch.empty(3 * 2, dtype=torch.int16)
        pg._allgather_base(flat, torch.tensor([r, -r], dtype=torch.int16)).wait()
        return outputs, flat.tolist()

    for outputs, flat in on_groups(3, body):
        for r, out in enumerate(outputs):
            assert torch.equal(out, torch.arange(6.0).reshape(2, 3) + 10 * r), r
        assert flat == [0, 0, 1, -1, 2, -2]


def test_broadcast_gives_every_rank_the_roots_tensors():
    def body(pg, r):
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        a = torch.full((4,), float(r))
        b = torch.tensor([1.5, r], dtype=torch.bfloat16)
        work = pg.broadcast([a, b], opts)
        work.wait()
        return a.tolist(), b.tolist(), work.get_future().done()

    assert on_groups(3, body) == [([1.0] * 4, [1.5, 1.0], True)] * 3


def test_a_barrier_completes_once_the_last_rank_enters_it():
    checked, looked = threading.Event(), threading.Barrier(2)
    entered: list[float] = []

    def body(pg, r):
        if r == 2:
            assert checked.wait(10)
            entered.append(time.monotonic())
            pg.barrier().wait()
            return None
        work = pg.barrier()
        time.sleep(0.1)
        before = work.is_completed()
        looked.wait(10)  # (both ranks looked before rank 2 may enter)
        if r == 0:
            checked.set()
        work.wait()
        return before, time.monotonic(), work.is_completed()

    first, second, _ = on_groups(3, body)
    for before, ended, completed in (first, second):
        assert before is False and completed
        assert ended >= entered[0]


def test_reduce_scatter_scatter_and_gather():
    n = 3

    def body(pg, r):
        part = torch.empty(2)
        pg.reduce_scatter([part], [[torch.full((2,), float(10 * r + j)) for j in range(n)]]
                          ).wait()
        scatter_opts = dist.ScatterOptions()
        scatter_opts.rootRank = 2
        row = torch.empty(2, dtype=torch.int32)
        rows = [[torch.full((2,), 7 * j, dtype=torch.int32) for j in range(n)]]
        pg.scatter([row], rows if r == 2 else [], scatter_opts).wait()
        gather_opts = dist.GatherOptions()
        gather_opts.rootRank = 0
        gathered = [[torch.empty(2) for _ in range(n)]] if r == 0 else []
        pg.gather(gathered, [torch.full((2,), float(r))], gather_opts).wait()
        return part.tolist(), row.tolist(), [g.tolist() for g in gathered[0]] if r == 0 \
            else None

    results = on_groups(n, body)
    for r, (part, row, gathered) in enumerate(results):
        assert part == [float(sum(10 * q + r for q in range(n)))] * 2, r  # 30, 33, 36
        assert row == [7 * r] * 2, r
    assert results[0][2] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_over_gloo_peers_made_from_a_shared_store():
    """The library's own peers without MPI (TorchPeers: gloo over the store), as under
    torchrun; alltoall needs their point-to-point traffic."""
    store = dist.HashStore()

    def body(pg, r):
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        received = [torch.empty(2) for _ in range(3)]
        pg.alltoall(received, [torch.full((2,), float(10 * r + j)) for j in range(3)]
                    ).wait()
        return type(pg._comm).__name__, t.tolist(), [x.tolist() for x in received]

    for r, (peers, t, received) in enumerate(on_groups(3, body, store=store)):
        assert peers == "TorchPeers"
        assert t == [6.0] * 3
        assert received == [[float(10 * q + r)] * 2 for q in range(3)], r


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,message", [
    ("shape", "ranks disagree on the length of allreduce #1: rank 0: 4 x float32 SUM; "
              "rank 1: 5 x float32 SUM; rank 2: 6 x float32 SUM"),
    ("dtype", "ranks disagree on the dtype of allreduce #1: rank 0: 4 x float32 SUM; "
              "rank 1: 4 x float64 SUM; rank 2: 4 x float32 SUM"),
    ("op", "ranks disagree on the op of allreduce #1: rank 0: 4 x float32 SUM; "
           "rank 1: 4 x float32 MAX; rank 2: 4 x float32 SUM"),
])
def test_a_call_that_differs_across_ranks_fails_on_every_rank_naming_each(case, message):
    def body(pg, r):
        shape = 4 + r if case == "shape" else 4
        dtype = torch.float64 if case == "dtype" and r == 1 else torch.float32
        op = "MAX" if case == "op" and r == 1 else "SUM"
        t = torch.ones(shape, dtype=dtype)
        error = failure(pg.allreduce([t], reduce_opts(op)))
        # The group goes on: the next call is served.
        u = torch.full((2,), float(r))
        pg.allreduce([u]).wait()
        return error, t.tolist(), u.tolist()

    for r, (error, t, u) in enumerate(on_groups(3, body)):
        assert isinstance(error, dist.DistBackendError), repr(error)
        assert message in str(error), error
        assert t == [1.0] * len(t), r  # left as it was
        assert u == [3.0, 3.0]


def test_ranks_making_different_collectives_fail_naming_both():
    def body(pg, r):
        t = torch.ones(3)
        work = pg.allreduce([t]) if r == 0 else pg.broadcast([t], dist.BroadcastOptions())
        return failure(work)

    for error in on_groups(2, body):
        assert isinstance(error, dist.DistBackendError), repr(error)
        assert "rank 0: 3 x float32 SUM; rank 1: broadcast 'c10d.0' float32[3] root 0" \
            in str(error), error


def test_unsupported_ops_and_dtypes_are_refused_at_the_call_naming_them():
    def body(pg, r):
        t = torch.ones(3)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist._make_nccl_premul_sum(2.0)
        with pytest.raises(ValueError, match="backend 'ina' does not support reduce op "
                                             "PREMUL_SUM"):
            pg.allreduce([t], opts)
        with pytest.raises(ValueError, match="all_reduce with BXOR needs integer"):
            pg.allreduce([t], reduce_opts("BXOR"))
        with pytest.raises(ValueError, match="reduce_scatter with BAND is not supported"):
            pg.reduce_scatter([torch.empty(1)], [[torch.ones(1)] * 2], reduce_opts("BAND"))
        with pytest.raises(TypeError, match="all_reduce: dtype torch.complex64 is not "
                                            "supported; supported: uint8, "):
            pg.allreduce([torch.ones(2, dtype=torch.complex64)])
        with pytest.raises(TypeError, match="broadcast takes a torch.Tensor, got list"):
            pg.broadcast([[1.0, 2.0]], dist.BroadcastOptions())
        with pytest.raises(ValueError, match=r"allgather: expected one tensor per rank "
                                             r"\(2\), got 3"):
            pg.allgather([[torch.empty(3)] * 3], [t])
        # Nothing reached the runtime: the ranks' next call still meets.
        pg.allreduce([t]).wait()
        return t.tolist()

    assert on_groups(2, body) == [[2.0] * 3] * 2


def test_bitwise_or_of_bool_tensors():
    def body(pg, r):
        t = torch.tensor([r == 0, False, True])
        pg.allreduce([t], reduce_opts("BOR")).wait()
        return t.tolist()

    assert on_groups(2, body) == [[True, False, True]] * 2


def test_a_shut_down_group_refuses_collectives():
    def body(pg, r):
        pg.allreduce([torch.ones(1)]).wait()
        pg.shutdown()
        with pytest.raises(RuntimeError, match="the process group of backend 'ina' has "
                                               "been shut down"):
            pg.allreduce([torch.ones(2)])
        with pytest.raises(RuntimeError, match="has been shut down"):
            pg.broadcast([torch.ones(2)], dist.BroadcastOptions())
        return True

    assert on_groups(2, body) == [True, True]


def test_a_shut_down_group_refuses_a_barrier_as_it_refuses_other_calls():
    def body(pg, r):
        pg.shutdown()
        with pytest.raises(RuntimeError, match="has been shut down"):
            pg.barrier()
        return True

    assert on_groups(2, body) == [True, True]


def test_the_group_names_its_backend_and_counts_its_calls():
    def body(pg, r):
        for _ in range(3):
            pg.allreduce([torch.ones(4)]).wait()
        stats = pg.stats()
        return pg.getBackendName(), pg.rank(), pg.size(), stats["calls"]

    assert on_groups(2, body) == [(ina_dist.BACKEND, r, 2, 3) for r in range(2)]
    assert ina_dist.BACKEND == "ina"
