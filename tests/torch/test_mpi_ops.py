"""The Horovod API of torch/mpi_ops.py at 2-4 ranks in one process (tests/torch/
hvd_threads.py: a thread a rank over tests/threadcomm.py's ThreadPeers, each with its
own world): init and the topology, allreduce (Average, Sum, Min, Max, Product, scale
factors, in place, async with poll and synchronize, fused), grouped allreduce,
allgather, broadcast, reducescatter, the gradients of the autograd
Functions, a process set, and the errors: ranks that disagree on a shape, a dtype, an
op or a root (an error on every rank that names the mismatch and each rank's value), a
name in flight twice, a bad handle, a bad argument, and every call before init.

Horovod's test/parallel/test_torch.py was the guide to which behaviours to check."""
from __future__ import annotations

import time

import pytest
import torch

import ina_collectives.torch as hvd
from ina_collectives.errors import OperationError
from ina_collectives.torch import mpi_ops
from tests.threadcomm import ThreadPeers, run_ranks
from tests.torch.hvd_threads import (  # noqa: F401
    SETTINGS,
    attempt,
    mismatch,
    on_hvd,
    per_thread_world,
)

pytestmark = pytest.mark.usefixtures("per_thread_world")


def rank_tensor(r: int, shape=(3, 4), dtype=torch.float32, offset: int = 0) -> torch.Tensor:
    """Rank r's input: small integers (every sum, product and mean exact), distinct per
    element and per rank."""
    n = 1
    for d in shape:
        n *= d
    values = (torch.arange(n) % 7) + 2 * r + 1 + offset
    return values.reshape(shape).to(dtype)



# -- before init, init, topology -----------------------------------------------------------

def test_every_call_before_init_says_hvd_init_is_needed():
    assert not hvd.is_initialized()
    x = torch.ones(3)
    calls = [hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
             hvd.cross_size, hvd.is_homogeneous, hvd.mpi_threads_supported,
             lambda: hvd.allreduce(x), lambda: hvd.allreduce_async(x),
             lambda: hvd.allreduce_(x), lambda: hvd.grouped_allreduce([x]),
             lambda: hvd.allgather(x), lambda: hvd.broadcast(x, 0),
             lambda: hvd.broadcast_(x, 0), lambda: hvd.alltoall(x), hvd.barrier,
             lambda: hvd.add_process_set([0]), lambda: hvd.stats(), hvd.join,
             lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(x)],
                                                              lr=0.1))]
    for call in calls:
        with pytest.raises(ValueError, match=r"has not been initialized; use hvd.init\(\)"):
            call()
    assert x.tolist() == [1.0, 1.0, 1.0]  # (allreduce_ and broadcast_ left it alone)
    # A handle is looked up first: none exists before init either.
    with pytest.raises(ValueError, match="unknown handle 1 "):
        hvd.synchronize(1)
    with pytest.raises(ValueError, match="unknown handle 1 "):
        hvd.poll(1)
    hvd.shutdown()  # idempotent: nothing to stop
    assert not hvd.is_initialized()


def test_init_gives_each_rank_its_place_is_idempotent_and_can_follow_shutdown():
    def rank(comm):
        hvd.init(comm, **SETTINGS)
        hvd.init(comm, **SETTINGS)  # a second call while initialized does nothing
        try:
            place = (hvd.is_initialized(), hvd.rank(), hvd.size(), hvd.local_rank(),
                     hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
                     hvd.is_homogeneous(), list(hvd.global_process_set.ranks))
            first = hvd.allreduce(torch.tensor([1.0 + comm.Get_rank()]), op=hvd.Sum)
        finally:
            hvd.shutdown()
        after = hvd.is_initialized()
        hvd.shutdown()  # idempotent
        hvd.init(comm, **SETTINGS)
        try:
            again = hvd.allreduce(torch.tensor([10.0 * comm.Get_rank()]), op=hvd.Sum)
            # Unnamed operations are numbered from 0 again in a new world.
            handle = hvd.allreduce_async(torch.ones(1))
            name = hvd.handle_table._handles[handle].handles[0].request.name
            hvd.synchronize(handle)
        finally:
            hvd.shutdown()
        return place, first.item(), after, again.item(), name

    for r, (place, first, after, again, name) in enumerate(
            run_ranks(3, rank, timeout=30, kind=ThreadPeers)):
        assert place == (True, r, 3, r, 3, 0, 1, True, [0, 1, 2])
        assert first == 6.0 and after is False and again == 30.0
        assert name == "allreduce.noname.1", name  # (the second unnamed allreduce)


def test_init_refuses_a_process_sets_argument_it_cannot_take():
    with pytest.raises(TypeError, match="takes ProcessSet objects, got list"):
        hvd.init(process_sets=[[0, 1]])
    with pytest.raises(ValueError, match="give a list of ProcessSet or 'dynamic'"):
        hvd.init(process_sets="static")
    assert not hvd.is_initialized()


# -- allreduce -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_sum_and_average_are_exact_on_every_rank_and_leave_the_input(n):
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16]

    def body(hvd, r):
        out = []
        for dtype in dtypes:
            x = rank_tensor(r, (2, 5), dtype)
            kept = x.clone()
            summed = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
            assert torch.equal(x, kept) and summed is not x
            out.append(("sum", dtype, summed))
            if dtype.is_floating_point:
                out.append(("average", dtype, hvd.allreduce(x, name=f"avg.{dtype}")))
                out.append(("average=True", dtype,
                            hvd.allreduce(x, average=True, name=f"avgflag.{dtype}")))
                out.append(("average=False", dtype,
                            hvd.allreduce(x, average=False, name=f"sumflag.{dtype}")))
        return out

    for results in on_hvd(n, body):
        assert len(results) == 5 + 3 * 3
        for kind, dtype, got in results:
            total = sum(rank_tensor(q, (2, 5), torch.float64) for q in range(n))
            want = total / n if kind.startswith("average=T") or kind == "average" else total
            assert got.dtype == dtype and got.shape == (2, 5), (kind, dtype)
            assert torch.equal(got.double(), want), (kind, dtype, got)


def test_allreduce_min_max_product_and_the_scale_factors():
    def body(hvd, r):
        x = rank_tensor(r, (6,), torch.float64)
        return {"min": hvd.allreduce(x, op=hvd.Min),
                "max": hvd.allreduce(x, op=hvd.Max),
                "product": hvd.allreduce(x, op=hvd.Product),
                "int max": hvd.allreduce(rank_tensor(r, (6,), torch.int32), op=hvd.Max),
                "scaled sum": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                            postscale_factor=4.0),
                "scaled average": hvd.allreduce(x, prescale_factor=3.0)}

    inputs = [rank_tensor(q, (6,), torch.float64) for q in range(3)]
    want = {"min": torch.minimum(torch.minimum(inputs[0], inputs[1]), inputs[2]),
            "max": torch.maximum(torch.maximum(inputs[0], inputs[1]), inputs[2]),
            "product": inputs[0] * inputs[1] * inputs[2],
            "int max": inputs[2].int(),
            "scaled sum": 2.0 * sum(inputs),
            "scaled average": sum(inputs)}  # 3 x the mean of 3 ranks
    for results in on_hvd(3, body):
        for key, got in results.items():
            assert torch.equal(got, want[key]), (key, got, want[key])


def test_allreduce_in_place_returns_the_tensor_itself_with_the_reduction():
    def body(hvd, r):
        x = rank_tensor(r, (4, 3))
        same = hvd.allreduce_(x, op=hvd.Sum)
        y = rank_tensor(r, (4, 3))
        averaged = hvd.allreduce_(y)
        # A non-contiguous view reduced in place: its own elements only.
        base = rank_tensor(r, (3, 4))
        view = base.t()
        hvd.allreduce_(view, op=hvd.Sum)
        return same is x, x, averaged is y, y, base

    total = rank_tensor(0, (4, 3)) + rank_tensor(1, (4, 3))
    for same, x, averaged, y, base in on_hvd(2, body):
        assert same and averaged
        assert torch.equal(x, total) and torch.equal(y, total / 2)
        assert torch.equal(base, rank_tensor(0, (3, 4)) + rank_tensor(1, (3, 4)))


def test_allreduce_of_a_non_contiguous_tensor_reduces_its_elements_in_their_places():
    def body(hvd, r):
        x = rank_tensor(r, (3, 5)).t()[1:]  # (4, 3), strided
        return hvd.allreduce(x, op=hvd.Sum)

    want = (rank_tensor(0, (3, 5)) + rank_tensor(1, (3, 5))).t()[1:]
    for got in on_hvd(2, body):
        assert got.shape == (4, 3) and torch.equal(got, want)


def test_allreduce_async_returns_a_handle_that_polls_true_then_synchronizes_once():
    def body(hvd, r):
        x = rank_tensor(r, (8,))
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="async")
        assert isinstance(handle, int)
        deadline = time.monotonic() + 10
        while not hvd.poll(handle):
            assert time.monotonic() < deadline, "poll never turned True"
            time.sleep(0.002)
        result = hvd.synchronize(handle)
        again = attempt(lambda: hvd.synchronize(handle))
        polled = attempt(lambda: hvd.poll(handle))
        y = rank_tensor(r, (8,))
        in_place = hvd.allreduce_async_(y, name="async_")
        returned = hvd.synchronize(in_place)  # no poll first: synchronize waits
        return result, x, again, polled, y, returned is y

    total = rank_tensor(0, (8,)) + rank_tensor(1, (8,))
    for r, (result, x, again, polled, y, same) in enumerate(on_hvd(2, body)):
        assert torch.equal(result, total) and torch.equal(x, rank_tensor(r, (8,)))
        assert again[0] == polled[0] == "ValueError"
        assert "already synchronized?" in again[1] and "already synchronized?" in polled[1]
        assert torch.equal(y, total / 2) and same


def test_many_async_allreduces_in_flight_each_come_back_exact_whatever_the_order():
    """Twelve named allreduces of several dtypes, sizes and ops, started before any is
    awaited (the runtime fuses those it can) and synchronized in reverse order: each
    result is its own exact reduction."""
    specs = [(f"t{i}", [torch.float32, torch.float64, torch.int32][i % 3], (1 + 7 * i,),
              [hvd.Sum, hvd.Average, hvd.Max][i % 3] if i % 3 != 2 else hvd.Sum)
             for i in range(12)]

    def body(hvd, r):
        handles = [hvd.allreduce_async(rank_tensor(r, shape, dtype, offset=i), op=op,
                                       name=name)
                   for i, (name, dtype, shape, op) in enumerate(specs)]
        results = {name: hvd.synchronize(h) for (name, *_), h in
                   reversed(list(zip(specs, handles)))}
        return results, hvd.stats()

    for results, stats in on_hvd(3, body, cycle_time=0.02):
        for i, (name, dtype, shape, op) in enumerate(specs):
            inputs = [rank_tensor(q, shape, torch.float64, offset=i) for q in range(3)]
            want = {hvd.Sum: sum(inputs), hvd.Average: sum(inputs) / 3,
                    hvd.Max: torch.maximum(torch.maximum(inputs[0], inputs[1]),
                                           inputs[2])}[op]
            assert results[name].dtype == dtype and torch.equal(results[name].double(),
                                                                want), name
        assert stats["calls"] <= 12  # (fused ones count once)
        assert stats["tensors fused"] >= 2 * stats["fused calls"]


def test_allreduces_submitted_together_are_fused_into_one_call_and_stay_exact():
    def body(hvd, r):
        before = hvd.stats()
        with mpi_ops.submitted_together():
            handles = [hvd.allreduce_async(rank_tensor(r, (5 + i,), offset=i), op=hvd.Sum,
                                           name=f"together.{i}") for i in range(4)]
        results = [hvd.synchronize(h) for h in handles]
        after = hvd.stats()
        return results, (after["fused calls"] - before["fused calls"],
                         after["tensors fused"] - before["tensors fused"])

    for results, fused in on_hvd(2, body):
        assert fused == (1, 4)
        for i, got in enumerate(results):
            assert torch.equal(got, rank_tensor(0, (5 + i,), offset=i) +
                               rank_tensor(1, (5 + i,), offset=i)), i


def test_grouped_allreduce_reduces_each_tensor_fused_in_one_call():
    def body(hvd, r):
        tensors = [rank_tensor(r, shape) for shape in [(3,), (2, 2), (5, 1)]]
        kept = [t.clone() for t in tensors]
        before = hvd.stats()
        summed = hvd.grouped_allreduce(tensors, op=hvd.Sum)
        after = hvd.stats()
        assert all(torch.equal(t, k) for t, k in zip(tensors, kept))
        averaged = hvd.synchronize(hvd.grouped_allreduce_async(tensors, name="grouped"))
        in_place = hvd.grouped_allreduce_(tensors, op=hvd.Max)
        empty = attempt(lambda: hvd.grouped_allreduce_async([]))
        return (summed, averaged, in_place, tensors,
                (after["fused calls"] - before["fused calls"],
                 after["tensors fused"] - before["tensors fused"]), empty)

    shapes = [(3,), (2, 2), (5, 1)]
    for summed, averaged, in_place, tensors, fused, empty in on_hvd(2, body):
        assert fused == (1, 3)
        for i, shape in enumerate(shapes):
            total = rank_tensor(0, shape) + rank_tensor(1, shape)
            assert torch.equal(summed[i], total) and torch.equal(averaged[i], total / 2)
            assert in_place[i] is tensors[i] and torch.equal(tensors[i], rank_tensor(1, shape))
        assert empty == ("ValueError", "grouped_allreduce needs at least one tensor")


# -- allgather, broadcast, reducescatter --------------------------------------------------

def test_allgather_concatenates_the_ranks_tensors_of_different_lengths_in_rank_order():
    def body(hvd, r):
        x = rank_tensor(r, (r + 1, 2), torch.int64)
        gathered = hvd.allgather(x)
        from_async = hvd.synchronize(hvd.allgather_async(x.double(), name="ag.async"))
        grouped = hvd.grouped_allgather([x, rank_tensor(r, (1,), torch.float32)])
        scalar = attempt(lambda: hvd.allgather_async(torch.tensor(1.0)))
        return gathered, from_async, grouped, scalar

    want = torch.cat([rank_tensor(q, (q + 1, 2), torch.int64) for q in range(3)])
    ones = torch.cat([rank_tensor(q, (1,), torch.float32) for q in range(3)])
    for gathered, from_async, grouped, scalar in on_hvd(3, body):
        assert gathered.dtype == torch.int64 and torch.equal(gathered, want)
        assert from_async.dtype == torch.float64 and torch.equal(from_async, want.double())
        assert torch.equal(grouped[0], want) and torch.equal(grouped[1], ones)
        assert scalar == ("ValueError", "allgather needs a tensor of at least one dimension "
                          "(it concatenates along the first)")


def test_allgather_of_a_0d_tensor_says_it_needs_a_dimension():
    def body(hvd, r):
        return (attempt(lambda: hvd.allgather(torch.tensor(1.0))),
                attempt(lambda: hvd.grouped_allgather([torch.tensor(1.0)])))

    message = ("ValueError", "allgather needs a tensor of at least one dimension (it "
               "concatenates along the first)")
    for alone, grouped in on_hvd(2, body):
        assert alone == message, alone
        assert grouped == message, grouped


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_gives_every_rank_the_roots_tensor(root):
    def body(hvd, r):
        x = rank_tensor(r, (2, 3), torch.float64)
        copied = hvd.broadcast(x, root_rank=root)
        untouched = torch.equal(x, rank_tensor(r, (2, 3), torch.float64))
        y = rank_tensor(r, (4,), torch.int32)
        same = hvd.broadcast_(y, root) is y
        z = rank_tensor(r, (3,))
        from_async = hvd.synchronize(hvd.broadcast_async(z, root, name="b.async"))
        w = rank_tensor(r, (3,))
        hvd.synchronize(hvd.broadcast_async_(w, root, name="b.async_"))
        bad_root = attempt(lambda: hvd.broadcast(x, root_rank=0.0))
        return copied, untouched, y, same, from_async, z, w, bad_root

    for r, (copied, untouched, y, same, from_async, z, w, bad_root) in enumerate(
            on_hvd(3, body)):
        assert torch.equal(copied, rank_tensor(root, (2, 3), torch.float64)) and untouched
        assert same and torch.equal(y, rank_tensor(root, (4,), torch.int32))
        assert torch.equal(from_async, rank_tensor(root, (3,)))
        assert torch.equal(z, rank_tensor(r, (3,)))  # (broadcast_async: a new tensor)
        assert torch.equal(w, rank_tensor(root, (3,)))
        assert bad_root == ("TypeError", "root_rank must be an int, got 0.0")


def test_reducescatter_keeps_each_rank_its_part_of_the_reduction():
    def body(hvd, r):
        x = rank_tensor(r, (4, 2))
        return hvd.reducescatter(x, op=hvd.Sum), hvd.reducescatter(x)

    total = rank_tensor(0, (4, 2)) + rank_tensor(1, (4, 2))
    for r, (summed, averaged) in enumerate(on_hvd(2, body)):
        assert torch.equal(summed, total[2 * r:2 * r + 2])
        assert torch.equal(averaged, total[2 * r:2 * r + 2] / 2)


# -- gradients ---------------------------------------------------------------------------------

def test_the_gradients_of_allreduce_allgather_and_broadcast_are_horovods():
    """allreduce: the same allreduce of the gradient; allgather: the average of the
    output's gradient over the ranks, this rank's rows of it; broadcast: the average
    gradient on the root, zeros elsewhere."""
    def body(hvd, r):
        x = rank_tensor(r, (3,)).requires_grad_()
        (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
        summed_grad = x.grad.clone()
        x.grad = None
        (hvd.allreduce(x) * (r + 1)).sum().backward()
        averaged_grad = x.grad.clone()

        g = rank_tensor(r, (r + 1, 2)).requires_grad_()
        weights = torch.arange(12.0).reshape(6, 2) * (r + 1)  # 3 ranks' 1 + 2 + 3 rows
        (hvd.allgather(g) * weights).sum().backward()

        b = rank_tensor(r, (2,)).requires_grad_()
        (hvd.broadcast(b, root_rank=1) * (r + 1)).sum().backward()
        return summed_grad, averaged_grad, g.grad, b.grad

    weights = torch.arange(12.0).reshape(6, 2) * 2  # the mean of 1, 2 and 3 times it
    for r, (summed, averaged, gathered, broadcast) in enumerate(on_hvd(3, body)):
        assert torch.equal(summed, torch.full((3,), 6.0))  # 1 + 2 + 3
        assert torch.equal(averaged, torch.full((3,), 2.0))  # (1 + 2 + 3) / 3
        start = sum(q + 1 for q in range(r))
        assert torch.equal(gathered, weights[start:start + r + 1]), r
        assert torch.equal(broadcast, torch.full((2,), 2.0) if r == 1 else torch.zeros(2))


# -- a process set ---------------------------------------------------------------------------

def test_a_process_set_reduces_over_its_members_and_refuses_the_others():
    def body(hvd, r):
        ps = hvd.add_process_set([0, 2])
        out = {"size": ps.size(), "rank": ps.rank(), "included": ps.included()}
        if r in (0, 2):
            out["sum"] = hvd.allreduce(rank_tensor(r, (3,)), op=hvd.Sum, process_set=ps)
            out["gathered"] = hvd.allgather(torch.tensor([r]), process_set=ps)
            out["from 2"] = hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=ps)
        else:
            out["outside"] = attempt(lambda: hvd.allreduce(torch.ones(1), process_set=ps))
        out["all"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum)
        out["removed"] = hvd.remove_process_set(ps)
        return out

    for r, out in enumerate(on_hvd(3, body)):
        assert out["size"] == 2 and out["removed"] is True and out["all"].item() == 3.0
        assert out["rank"] == {0: 0, 1: -1, 2: 1}[r] and out["included"] is (r != 1)
        if r == 1:
            assert out["outside"][0] == "ValueError"
            assert "rank 1 is not in ProcessSet" in out["outside"][1], out["outside"]
        else:
            assert torch.equal(out["sum"], rank_tensor(0, (3,)) + rank_tensor(2, (3,)))
            assert out["gathered"].tolist() == [0, 2] and out["from 2"].tolist() == [2]


# -- ranks that disagree ---------------------------------------------------------------------

def test_ranks_that_disagree_get_an_error_on_every_rank_naming_the_mismatch():
    """Each mismatch fails the operation on every rank, before any data moves, with the
    kind of mismatch, the operation's name and each rank's value (the ranks listed in
    the order their requests arrived: hvd_threads.mismatch); the next operation runs as
    usual."""
    def body(hvd, r):
        f32, f64 = torch.float32, torch.float64
        cases = {
            "shape": lambda: hvd.allreduce(torch.ones(3 + r), name="shape"),
            "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=[f32, f64][r]), name="dtype"),
            "op": lambda: hvd.allreduce(torch.ones(3), op=[hvd.Sum, hvd.Max][r], name="op"),
            "async shape": lambda: hvd.synchronize(
                hvd.allreduce_async_(torch.ones(2, 2 + r), name="async shape")),
            "grouped": lambda: hvd.grouped_allreduce(
                [torch.ones(2), torch.ones(1 + 2 * r)], name="grouped"),
            "allgather dtype": lambda: hvd.allgather(
                torch.ones(2, dtype=[f32, torch.int32][r]), name="allgather dtype"),
            "allgather shape": lambda: hvd.allgather(torch.ones(2, 1 + r),
                                                     name="allgather shape"),
            "broadcast shape": lambda: hvd.broadcast(torch.ones(2 + r), 0,
                                                     name="broadcast shape"),
            "broadcast root": lambda: hvd.broadcast(torch.ones(2), r, name="broadcast root"),
        }
        errors = {key: attempt(call) for key, call in cases.items()}
        return errors, hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item()

    want = {
        "shape": "Mismatched shape of allreduce 'shape': rank 0: (3,), rank 1: (4,)",
        "dtype": "Mismatched dtype of allreduce 'dtype': rank 0: float32, rank 1: float64",
        "op": "Mismatched reduction op of allreduce 'op': rank 0: sum, rank 1: max",
        "async shape": ("Mismatched shape of allreduce 'async shape': rank 0: (2, 2), "
                        "rank 1: (2, 3)"),
        "grouped": "Mismatched shape of allreduce 'grouped.1': rank 0: (1,), rank 1: (3,)",
        "allgather dtype": ("Mismatched dtype of allgather 'allgather dtype': rank 0: "
                            "float32, rank 1: int32"),
        "allgather shape": ("Mismatched shape beyond the first dimension of allgather "
                            "'allgather shape': rank 0: (1,), rank 1: (2,)"),
        "broadcast shape": ("Mismatched shape of broadcast 'broadcast shape': rank 0: "
                            "(2,), rank 1: (3,)"),
        "broadcast root": ("Mismatched root rank of broadcast 'broadcast root': rank 0: 0, "
                           "rank 1: 1"),
    }
    for errors, after in on_hvd(2, body):
        assert after == 3.0
        for key, message in want.items():
            kind, got = errors[key]
            assert kind == "OperationError", (key, kind, got)
            assert mismatch(got) == mismatch(message), (key, got)
    assert issubclass(OperationError, RuntimeError) and hvd.HorovodInternalError is \
        OperationError


def test_a_name_in_flight_twice_is_refused_on_that_rank_and_the_first_completes():
    def body(hvd, r):
        first = hvd.allreduce_async(rank_tensor(r, (2,)), op=hvd.Sum, name="twice")
        refused = attempt(lambda: hvd.allreduce_async(torch.ones(2), name="twice"))
        refused_bcast = attempt(lambda: hvd.broadcast_async(torch.ones(2), 0, name="twice"))
        result = hvd.synchronize(first)
        # Free again once another operation was submitted after it finished.
        hvd.allreduce(torch.ones(1), name="between")
        again = hvd.allreduce(rank_tensor(r, (2,)), op=hvd.Sum, name="twice")
        return refused, refused_bcast, result, again

    total = rank_tensor(0, (2,)) + rank_tensor(1, (2,))
    for refused, refused_bcast, result, again in on_hvd(2, body):
        for kind, message in (refused, refused_bcast):
            assert kind == "ValueError"
            assert "an operation named 'twice' is already in flight on this rank" in message
        assert torch.equal(result, total) and torch.equal(again, total)


def test_bad_handles_and_bad_arguments_are_refused_with_what_is_wrong():
    def body(hvd, r):
        x = torch.ones(2)
        return {
            "unknown": attempt(lambda: hvd.synchronize(123456)),
            "unknown poll": attempt(lambda: hvd.poll(-1)),
            "not a handle": attempt(lambda: hvd.synchronize("allreduce.noname.0")),
            "not a tensor": attempt(lambda: hvd.allreduce([1.0, 2.0])),
            "dtype": attempt(lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64))),
            "both ops": attempt(lambda: hvd.allreduce(x, average=True, op=hvd.Sum)),
            "op": attempt(lambda: hvd.allreduce(x, op="median")),
            "adasum": attempt(lambda: hvd.allreduce(x, op=hvd.Adasum)),
            "name": attempt(lambda: hvd.allreduce_async(x, name="")),
            "process set": attempt(lambda: hvd.allreduce(x, process_set=[0, 1])),
            "timeline": attempt(lambda: hvd.start_timeline("/tmp/timeline.json")),
        }

    for errors in on_hvd(2, body):
        assert errors["unknown"] == ("ValueError",
                                     "unknown handle 123456 (already synchronized?)")
        assert errors["unknown poll"] == ("ValueError",
                                          "unknown handle -1 (already synchronized?)")
        assert errors["not a handle"][0] == "ValueError"
        assert errors["not a tensor"] == ("TypeError", "allreduce takes a torch.Tensor, "
                                                       "got list")
        assert errors["dtype"][0] == "TypeError"
        assert "dtype torch.complex64 is not supported" in errors["dtype"][1]
        assert errors["both ops"] == ("ValueError",
                                      "give op or the deprecated average, not both")
        assert errors["op"][0] == "ValueError" and "unknown op 'median'" in errors["op"][1]
        assert errors["adasum"][0] == "NotImplementedError"
        assert errors["name"] == ("ValueError", "name must be a non-empty string, got ''")
        assert errors["process set"][0] == "TypeError"
        assert "process_set must be a ProcessSet" in errors["process set"][1]
        assert errors["timeline"][0] == "NotImplementedError"


def test_a_tensor_a_rank_never_submits_fails_on_the_others_naming_it_within_the_bound():
    """Rank 1 never submits 'lonely' (it waits, then shuts down): rank 0's allreduce
    raises a HorovodInternalError naming the tensor and the missing rank once the stall
    bound (stall_shutdown_time, 1 s here) has passed, not when rank 1 leaves."""
    def body(hvd, r):
        if r == 1:
            time.sleep(2.5)
            return None
        start = time.monotonic()
        got = attempt(lambda: hvd.allreduce(torch.ones(2), name="lonely"))
        return got, time.monotonic() - start

    (got, seconds), _ = on_hvd(2, body, barrier=False, stall_warning_time=0.5,
                               stall_shutdown_time=1.0)
    assert got == ("OperationError", "stalled: allreduce 'lonely' float32[2] average was "
                   "submitted by rank(s) [0], but rank(s) [1] never submitted it"), got
    assert 0.9 < seconds < 2.4, seconds  # (rank 1 left after 2.5 s)


def test_a_rank_that_shuts_down_fails_the_others_pending_operation_saying_so():
    def body(hvd, r):
        if r == 1:
            time.sleep(0.5)
            return None
        return attempt(lambda: hvd.allreduce(torch.ones(2), name="left behind"))

    got, _ = on_hvd(2, body, barrier=False)
    assert got == ("OperationError",
                   "rank 1 shut the runtime down before this operation could run"), got
