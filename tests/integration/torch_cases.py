"""What each rank of a Horovod-API test job runs: rank functions of (comm, params), each
run on every rank as a test names it (``mpirun.run(3, torch_cases.torch_quorum, params)``,
tests/integration/mpirun.py); each returns plain values (tensors as NumPy arrays) for
tests/integration/test_horovod.py to check against what it computes itself from
``torch_input``.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from tests.integration.mpirun import error
from tests.integration.rank_cases import deaf_from_the_stream

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
          "bfloat16"]
OPS = ["sum", "average", "min", "max", "product"]


def torch_input(dtype: str, shape: tuple[int, ...], rank: int, seed: int = 0) -> torch.Tensor:
    """Small values, exact in every dtype and through the switch's fixed point: floats are
    multiples of 1/4 in [-4, 4]; integers small enough that a product of 4 ranks fits."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    count = int(np.prod(shape))
    if dtype in ("uint8",):
        values = torch.randint(0, 4, (count,), generator=g)
    elif dtype.startswith("int"):
        values = torch.randint(-4, 5, (count,), generator=g)
    else:
        values = torch.randint(-16, 17, (count,), generator=g).to(torch.float64) / 4
    return values.to(getattr(torch, dtype)).reshape(shape)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).detach().numpy().copy()


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # recorded for the test to judge
        return error(exc)


def torch_ops(comm: Any, p: dict) -> dict[str, Any]:
    """Every dtype x op through allreduce and its variants, and every other collective."""
    import ina_collectives.torch as hvd
    hvd.init(**p.get("settings", {}))
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"size": n, "rank": r}
    shape = tuple(p["shape"])
    for dtype in DTYPES:
        for op in OPS:
            x = torch_input(dtype, shape, r, seed=OPS.index(op))
            out[f"allreduce/{dtype}/{op}"] = _np(hvd.allreduce(x, op=op, name=f"{dtype}.{op}"))
        x = torch_input(dtype, shape, r)
        before = x.clone()
        y = hvd.allreduce_(x, op=hvd.Sum)
        out[f"allreduce_/{dtype}"] = (_np(y), y is x)
        h = hvd.allreduce_async(before, op=hvd.Sum)
        out[f"allreduce_async/{dtype}"] = _np(hvd.synchronize(h))
        out[f"input_kept/{dtype}"] = bool(torch.equal(before, torch_input(dtype, shape, r)))
        g = [torch_input(dtype, (3 + i,), r, seed=10 + i) for i in range(3)]
        out[f"grouped/{dtype}"] = [_np(t) for t in hvd.grouped_allreduce(g, op=hvd.Sum)]
        rows = torch_input(dtype, (r + 1, 2), r, seed=20)
        out[f"allgather/{dtype}"] = _np(hvd.allgather(rows))
        b = torch_input(dtype, (4, 3), r, seed=30)
        out[f"broadcast/{dtype}"] = _np(hvd.broadcast(b, root_rank=n - 1))
        hvd.broadcast_(b, root_rank=0)
        out[f"broadcast_/{dtype}"] = _np(b)
        a = torch_input(dtype, (n * (n + 1) // 2, 2), r, seed=40)
        splits = list(range(1, n + 1))   # uneven: i + 1 rows to rank i
        got, received = hvd.alltoall(a, splits=splits)
        out[f"alltoall/{dtype}"] = (_np(got), received.tolist())
        if dtype != "uint8":
            s = torch_input(dtype, (2 * n + 1, 2), r, seed=50)
            out[f"reducescatter/{dtype}"] = _np(hvd.reducescatter(s, op=hvd.Sum))
    x = torch_input("float32", shape, r)
    out["scaled"] = _np(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
    out["fp16_compressed"] = _np(hvd.allreduce(x, op=hvd.Average,
                                               compression=hvd.Compression.fp16))
    out["fp16_compressed_dtype"] = str(hvd.allreduce(x, compression=hvd.Compression.fp16).dtype)
    strided = torch_input("float32", (shape[0], 4), r, seed=60).t()  # not contiguous
    out["non_contiguous"] = (_np(hvd.allreduce(strided, op=hvd.Sum)), list(strided.shape))
    g = [torch_input("float32", (4,), r, seed=70), torch_input("int32", (3,), r, seed=71)]
    out["grouped_"] = [_np(t) for t in hvd.grouped_allreduce_(g, op=hvd.Sum)] + [
        g[0].data_ptr() == hvd.grouped_allreduce_(g, op=hvd.Min)[0].data_ptr()]
    h = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Sum)
    out["grouped_async"] = [_np(t) for t in hvd.synchronize(h)]
    h = hvd.allgather_async(torch.full((r + 1,), float(r)))
    out["allgather_async"] = _np(hvd.synchronize(h))
    h = hvd.broadcast_async_(b, root_rank=n - 1)
    out["broadcast_async_"] = (_np(hvd.synchronize(h)), b.data_ptr())
    out["broadcast_object"] = hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=1)
    out["allgather_object"] = hvd.allgather_object(("rank", r, "x" * r))
    # barrier: the last rank writes a file before it; everyone sees it after.
    marker = os.path.join(p["tmp"], "before_barrier")
    if r == n - 1:
        time.sleep(0.3)
        with open(marker, "w") as f:
            f.write("written")
    hvd.barrier()
    out["after_barrier_sees_file"] = os.path.exists(marker)
    out["stats"] = hvd.stats()
    import ina_collectives
    out["summaries"] = (hvd.summary(), ina_collectives.summary())  # (no ina.init())
    hvd.shutdown()
    return out


def torch_async(comm: Any, p: dict) -> dict[str, Any]:
    """poll() is False while a peer has not submitted; many small async allreduces are
    fused into fewer reductions."""
    import ina_collectives.torch as hvd
    hvd.init(**p.get("settings", {}))
    r = hvd.rank()
    out: dict[str, Any] = {}
    if r == 0:
        h = hvd.allreduce_async(torch.ones(8), name="late", op=hvd.Sum)
        time.sleep(0.2)
        out["poll_before_peer"] = hvd.poll(h)
        comm.Barrier()
    else:
        comm.Barrier()  # only now does this rank submit "late"
        h = hvd.allreduce_async(torch.ones(8), name="late", op=hvd.Sum)
    out["late"] = _np(hvd.synchronize(h))
    before = hvd.stats()
    handles = [hvd.allreduce_async(torch.full((100,), float(i)), name=f"small.{i}", op=hvd.Sum)
               for i in range(64)]
    out["small"] = [_np(hvd.synchronize(h)) for h in handles]
    after = hvd.stats()
    out["reductions"] = after["calls"] - before["calls"]
    out["fused_calls"] = after["fused calls"] - before["fused calls"]
    out["poll_unknown"] = _attempt(lambda: hvd.poll(123456))
    out["sync_twice"] = _attempt(lambda: hvd.synchronize(handles[0]))
    hvd.shutdown()
    return out


def torch_autograd(comm: Any, p: dict) -> dict[str, Any]:
    """Gradients through every differentiable collective: loss = sum(w * op(x)) with a
    rank-specific weight w, so each gradient says where it came from."""
    import ina_collectives.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}

    def grad_of(fn: Any, x: torch.Tensor) -> np.ndarray:
        x = x.clone().requires_grad_(True)
        y = fn(x)
        w = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) + 100 * r
        (w * y).sum().backward()
        return _np(x.grad)

    x = torch.ones(6)
    out["allreduce_sum"] = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x)
    out["allreduce_avg"] = grad_of(lambda t: hvd.allreduce(t), x)
    out["grouped"] = grad_of(lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1], x)
    out["allgather"] = grad_of(lambda t: hvd.allgather(t), torch.ones(r + 1, 2))
    out["broadcast"] = grad_of(lambda t: hvd.broadcast(t, root_rank=1), x)
    out["alltoall"] = grad_of(lambda t: hvd.alltoall(t, splits=[1] * (n - 1) + [2])[0],
                              torch.ones(n + 1))
    out["reducescatter"] = grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum),
                                   torch.ones(2 * n))
    out["reducescatter_scaled"] = grad_of(lambda t: hvd.reducescatter(
        t, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0), torch.ones(2 * n))
    out["grouped_allgather"] = grad_of(
        lambda t: hvd.grouped_allgather([t, 3 * t])[1], torch.ones(r + 1, 2))
    out["grouped_reducescatter"] = grad_of(
        lambda t: hvd.grouped_reducescatter([t, 3 * t], op=hvd.Sum)[1], torch.ones(2 * n))
    hvd.shutdown()
    return out


def torch_grouped_and_scaled(comm: Any, p: dict) -> dict[str, Any]:
    """grouped_allgather, grouped_reducescatter and reducescatter's scale factors."""
    import ina_collectives.torch as hvd
    hvd.init(**p.get("settings", {}))
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for dtype in ("int32", "float16", "float32", "float64"):
        xs = [torch_input(dtype, (r + 1, 2), r, 60), torch_input(dtype, (2, 3), r, 61)]
        out[f"grouped_allgather/{dtype}"] = [_np(t) for t in hvd.grouped_allgather(xs)]
        handle = hvd.grouped_allgather_async(xs, name=f"gag.{dtype}")
        out[f"grouped_allgather_async/{dtype}"] = [_np(t) for t in hvd.synchronize(handle)]
        ys = [torch_input(dtype, (2 * n + 1, 2), r, 62), torch_input(dtype, (n,), r, 63)]
        out[f"grouped_reducescatter/{dtype}"] = [
            _np(t) for t in hvd.grouped_reducescatter(ys, op=hvd.Sum)]
        if dtype != "int32":
            out[f"reducescatter_scaled/{dtype}"] = _np(hvd.reducescatter(
                ys[0], op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0))
    hvd.shutdown()
    return out


def gradient_like(rank: int) -> np.ndarray:
    """Normal values (not the small binary fractions of torch_input, which any width
    sums exactly)."""
    return np.random.default_rng(70 + rank).standard_normal(70_000).astype(np.float32)


def torch_switch16(comm: Any, p: dict) -> dict[str, Any]:
    """Compression.switch16 on allreduce, grouped_allreduce and DistributedOptimizer,
    beside the same calls without it, in a job of 32-bit values."""
    import ina_collectives.torch as hvd
    hvd.init(switch_min_bytes=0)
    r = hvd.rank()
    x = torch.from_numpy(gradient_like(r))
    out = {"plain": _np(hvd.allreduce(x, name="plain")),
           "switch16": _np(hvd.allreduce(x, name="s16", compression=hvd.Compression.switch16)),
           "grouped": [_np(t) for t in hvd.grouped_allreduce(
               [x, x[:5000] * 3], name="g16", compression=hvd.Compression.switch16)]}
    model, data, target = optimizer_problem(r)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.switch16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.zero_grad()
    loss_of(model, data, target).backward()
    opt.step()
    out["params"] = [_np(q.detach()) for q in model.parameters()]
    out["switch"] = hvd.stats()["switch"]
    hvd.shutdown()
    return out


def torch_quorum(comm: Any, p: dict) -> dict[str, Any]:
    """hvd.set_quorum between allreduces (Average and Sum), back to sync, then ranks
    that ask for different quorums."""
    import ina_collectives.torch as hvd
    hvd.init(switch_min_bytes=0)
    r = hvd.rank()
    x = torch.from_numpy(gradient_like(r))
    out: dict[str, Any] = {"sync": _np(hvd.allreduce(x, name="sync"))}
    hvd.set_quorum(2)
    out["average"] = _np(hvd.allreduce(x, name="quorum.average"))
    out["last"] = hvd.stats()["switch"]["quorum"]["last_call"]
    out["sum"] = _np(hvd.allreduce(x, op=hvd.Sum, name="quorum.sum"))
    hvd.set_quorum(0)
    out["back"] = _np(hvd.allreduce(x, name="back"))
    out["report"] = hvd.stats()["switch"]["quorum"]
    out["disagree"] = _attempt(lambda: hvd.set_quorum(1 + r % 2))
    out["after"] = _np(hvd.allreduce(x, name="after"))
    hvd.shutdown()
    return out


def torch_process_sets(comm: Any, p: dict) -> dict[str, Any]:
    """Collectives restricted to process sets: even and odd ranks, each set its own job
    at the switch; the errors Horovod raises; a set registered at init."""
    import ina_collectives.torch as hvd
    statics = [hvd.ProcessSet([1, 2])]
    hvd.init(process_sets=statics, **p.get("settings", {}))
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"static": (statics[0].process_set_id, statics[0].size(),
                                      statics[0].rank())}
    even = hvd.add_process_set(range(0, n, 2))
    odd = hvd.add_process_set(hvd.ProcessSet(list(range(1, n, 2))))
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    out["ids"] = (even.process_set_id, odd.process_set_id)
    out["mine"] = (mine.ranks, mine.size(), mine.rank(), mine.included(), other.included())
    x = torch_input("float32", (3000,), r, 70)
    out["allreduce"] = _np(hvd.allreduce(x, op=hvd.Sum, process_set=mine))
    out["grouped_allreduce"] = [_np(t) for t in hvd.grouped_allreduce(
        [x, 2 * x], op=hvd.Sum, process_set=mine)]
    out["allgather"] = _np(hvd.allgather(torch.full((r + 1,), float(r)), process_set=mine))
    out["broadcast"] = _np(hvd.broadcast(torch.full((3,), float(r)), mine.ranks[-1],
                                         process_set=mine))
    out["alltoall"] = _np(hvd.alltoall(torch.arange(2.0 * len(mine.ranks)) + 10 * r,
                                       process_set=mine))
    out["reducescatter"] = _np(hvd.reducescatter(torch.ones(4 * len(mine.ranks)) * (r + 1),
                                                 op=hvd.Sum, process_set=mine))
    hvd.barrier(process_set=mine)
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=mine.ranks[0],
                                         process_set=mine)
    out["objects"] = hvd.allgather_object(r * r, process_set=mine)
    out["static_allreduce"] = (_np(hvd.allreduce(torch.ones(2), op=hvd.Sum,
                                                 process_set=statics[0]))
                               if statics[0].included() else None)
    out["stats"] = hvd.stats(process_set=mine)
    # Horovod's errors.
    out["not_member"] = _attempt(lambda: hvd.allreduce(x, process_set=other))
    out["root_outside"] = _attempt(lambda: hvd.broadcast(x, other.ranks[0],
                                                         process_set=mine))
    out["duplicate_set"] = _attempt(lambda: hvd.add_process_set(list(range(0, n, 2))))
    out["disagree"] = _attempt(lambda: hvd.add_process_set([0, 1] if r == 0 else [1, 2]))
    out["bad_rank"] = _attempt(lambda: hvd.add_process_set([0, n]))
    out["not_a_set"] = _attempt(lambda: hvd.allreduce(x, process_set=[0, 1]))
    out["remove_global"] = hvd.remove_process_set(hvd.global_process_set)
    # A DistributedOptimizer over the even set: odd ranks step on their own gradients.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   process_set=even)
    loss = (model(torch.full((3, 4), float(r + 1))) ** 2).sum()
    loss.backward()
    opt.step()
    out["weights"] = _np(model.weight)
    out["removed"] = (hvd.remove_process_set(odd), hvd.remove_process_set(even),
                      hvd.remove_process_set(even), even.process_set_id)
    out["after_remove"] = _attempt(lambda: hvd.allreduce(x, process_set=even))
    out["global_still"] = _np(hvd.allreduce(torch.ones(2), op=hvd.Sum))
    hvd.shutdown()
    return out


def torch_process_sets_from_communicators(comm: Any, p: dict) -> dict[str, Any]:
    """Sets given to init as communicators, each rank its own (as Horovod's multi-comm
    test): every distinct one becomes a set; a set that repeats another is refused and
    leaves nothing initialized."""
    from mpi4py import MPI

    import ina_collectives.torch as hvd
    r = MPI.COMM_WORLD.rank
    halves = MPI.COMM_WORLD.Split(color=r % 2, key=r)
    out: dict[str, Any] = {}
    clone = hvd.ProcessSet(MPI.COMM_WORLD.Dup())
    out["refused"] = _attempt(lambda: hvd.init(process_sets=[hvd.ProcessSet(halves), clone]))
    out["initialized_after_refusal"] = hvd.is_initialized()
    half, first = hvd.ProcessSet(halves), hvd.ProcessSet([0])
    hvd.init(process_sets=[half, first])
    out["half"] = (half.process_set_id, half.ranks, half.rank())
    out["first"] = (first.process_set_id, first.ranks, first.included())
    out["sum"] = _np(hvd.allreduce(torch.full((4,), float(r)), op=hvd.Sum, process_set=half))
    hvd.shutdown()
    return out


def torch_name_reuse(comm: Any, p: dict) -> dict[str, Any]:
    """A name given again at once is a duplicate even when the first operation already
    finished; after another submission it is free (as Horovod, where finishing frees it);
    a step after an explicit synchronize() warns, as Horovod's does."""
    import warnings

    import ina_collectives.torch as hvd
    hvd.init()
    out: dict[str, Any] = {}
    handle = hvd.allreduce_async(torch.ones(3), name="again")
    while not hvd.poll(handle):
        time.sleep(0.01)
    out["at_once"] = _attempt(lambda: hvd.allreduce_async(torch.ones(3), name="again"))
    hvd.barrier()
    out["after_another"] = _np(hvd.synchronize(hvd.allreduce_async(
        torch.ones(3), name="again", op=hvd.Sum)))
    out["internal_error_is"] = [c.__name__ for c in hvd.HorovodInternalError.__mro__]
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["step_warning"] = [str(w.message) for w in caught]
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["skip_warning"] = [str(w.message) for w in caught]
    hvd.shutdown()
    return out


def torch_errors(comm: Any, p: dict) -> dict[str, Any]:
    """Ranks that disagree get RuntimeError on every rank, never a hang; local mistakes
    raise at once; afterwards the runtime still works."""
    import ina_collectives.torch as hvd
    out: dict[str, Any] = {"before_init": _attempt(hvd.size)}
    hvd.init()
    r = hvd.rank()
    out["shape"] = _attempt(lambda: hvd.allreduce(torch.ones(3 + (r == 1)), name="shape"))
    out["dtype"] = _attempt(lambda: hvd.allreduce(
        torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32), name="dtype"))
    out["op"] = _attempt(lambda: hvd.allreduce(torch.ones(3), name="op",
                                               op=hvd.Max if r == 1 else hvd.Sum))
    out["root"] = _attempt(lambda: hvd.broadcast(torch.ones(3), root_rank=r % 2, name="root"))
    out["root_range"] = _attempt(lambda: hvd.broadcast(torch.ones(3), root_rank=7))
    out["kind"] = _attempt(lambda: (hvd.allgather if r == 1 else hvd.allreduce)(
        torch.ones(3), name="kind"))
    out["gather_dims"] = _attempt(lambda: hvd.allgather(torch.ones(2, 2 + r), name="gd"))
    h = hvd.allreduce_async(torch.ones(3), name="twice")
    out["duplicate"] = _attempt(lambda: hvd.allreduce_async(torch.ones(3), name="twice"))
    hvd.synchronize(h)
    out["adasum"] = _attempt(lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum))
    out["complex"] = _attempt(lambda: hvd.allreduce(torch.ones(3, dtype=torch.complex64)))
    out["bool"] = _attempt(lambda: hvd.allreduce(torch.ones(3, dtype=torch.bool)))
    out["not_tensor"] = _attempt(lambda: hvd.allreduce([1.0, 2.0]))
    out["bad_op"] = _attempt(lambda: hvd.allreduce(torch.ones(3), op="median"))
    out["splits"] = _attempt(lambda: hvd.alltoall(torch.ones(5), splits=[1, 1]))
    out["uneven"] = _attempt(lambda: hvd.alltoall(torch.ones(hvd.size() + 1)))
    out["scatter_op"] = _attempt(lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max))
    out["nan"] = _np(hvd.allreduce(torch.tensor([float("nan"), 1.0]), op=hvd.Sum))
    out["still_works"] = _np(hvd.allreduce(torch.ones(3), op=hvd.Sum))
    hvd.shutdown()
    out["after_shutdown"] = _attempt(lambda: hvd.allreduce(torch.ones(3)))
    return out


def torch_dead_peer(comm: Any, p: dict) -> dict[str, Any]:
    """The last rank freezes (SIGSTOP): the others' pending operation fails within the
    timeout, naming what it waited for. Rank 0 then kills it."""
    import signal

    import ina_collectives.torch as hvd
    hvd.init(timeout=p["timeout"])
    pids = comm.allgather(os.getpid())
    hvd.allreduce(torch.ones(4), name="first")
    if hvd.rank() == hvd.size() - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    result = _attempt(lambda: hvd.allreduce(torch.ones(4), name="second"))
    later = _attempt(lambda: hvd.allreduce(torch.ones(4), name="third"))
    return {"abandoned": True, "error": result, "later": later,
            "seconds": time.monotonic() - start, "ranks_alive": comm.size - 1,
            "kill": pids[-1] if comm.rank == 0 else None}


def torch_join(comm: Any, p: dict) -> dict[str, Any]:
    """Rank r has r + 1 batches: joined ranks add zeros to the others' allreduces."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()
    sums = []
    for step in range(r + 1):
        sums.append(_np(hvd.allreduce(torch.full((5,), float(r + 1)), name=f"grad.{step}",
                                      op=hvd.Sum)))
    last = hvd.join()
    after = _np(hvd.allreduce(torch.ones(2), op=hvd.Sum))
    hvd.shutdown()
    return {"sums": sums, "last": last, "after": after}


def torch_init(comm: Any, p: dict) -> dict[str, Any]:
    """init(comm=[ranks]), idempotent init, shutdown and init again, topology."""
    import ina_collectives.torch as hvd
    out: dict[str, Any] = {"initialized_before": hvd.is_initialized()}
    out["bad_type"] = _attempt(lambda: hvd.init(comm="world"))
    out["bad_ranks"] = _attempt(lambda: hvd.init(comm=[0, 0]))
    sub = _attempt(lambda: hvd.init(comm=[0, 1]))
    out["subset"] = sub
    if hvd.is_initialized():
        hvd.init(comm=[0, 1])  # idempotent
        out["sub_size_rank"] = (hvd.size(), hvd.rank())
        out["sub_sum"] = _np(hvd.allreduce(torch.ones(3), op=hvd.Sum))
        hvd.shutdown()
    comm.Barrier()
    hvd.init()
    out["world"] = (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(),
                    hvd.cross_size(), hvd.cross_rank(), hvd.mpi_threads_supported())
    out["world_sum"] = _np(hvd.allreduce(torch.ones(3), op=hvd.Sum))
    out["homogeneous"] = hvd.is_homogeneous()
    hvd.shutdown()
    hvd.shutdown()  # idempotent
    out["initialized_after"] = hvd.is_initialized()
    return out


def optimizer_problem(rank: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small model (initialised differently per rank) and this rank's batch."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(100 + rank)
    return model, torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def torch_optimizer(comm: Any, p: dict) -> dict[str, Any]:
    """broadcast_parameters, broadcast_optimizer_state, then steps of a DistributedOptimizer
    (SGD with momentum) with the options in p; returns every parameter after each step."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()
    model, x, y = optimizer_problem(r)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r == 0:  # momentum buffers only on the root: broadcast_optimizer_state carries them
        loss_of(model, x, y).backward()
        base.step()
        base.zero_grad()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(base, root_rank=0)
    out: dict[str, Any] = {"initial": [_np(t) for t in model.state_dict().values()],
                           "momentum": [_np(s["momentum_buffer"]) for s in base.state.values()
                                        if s.get("momentum_buffer") is not None]}
    compression = getattr(hvd.Compression, p.get("compression", "none"))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression,
                                   backward_passes_per_step=p.get("passes", 1),
                                   gradient_predivide_factor=p.get("predivide", 1.0))
    out["isinstance"] = isinstance(opt, torch.optim.SGD)
    out["steps"] = []
    for _ in range(p.get("steps", 2)):
        opt.zero_grad()
        for _ in range(p.get("passes", 1)):
            loss_of(model, x, y).backward()
        opt.step()
        out["steps"].append([_np(t) for t in model.parameters()])
    opt.zero_grad()
    for _ in range(p.get("passes", 1)):
        loss_of(model, x, y).backward()
    out["too_many_passes"] = _attempt(lambda: loss_of(model, x, y).backward())
    opt.synchronize()
    model2, x2, y2 = optimizer_problem(r)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters())
    loss_of(model2, x2, y2).backward()
    out["zero_grad_early"] = _attempt(opt2.zero_grad)
    opt2.synchronize()
    out["unnamed"] = _attempt(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1),
        named_parameters=list(model2.named_parameters())[:1]))
    hvd.shutdown()
    return out


class SlowBackward(torch.nn.Module):
    """Tanh whose backward takes 20 ms more: the layers' gradients become ready apart,
    as a real model's do, not all in one of the runtime's cycles."""

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._Function.apply(torch.tanh(x))


def fusion_problem(rank: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A model whose first gradients in backward (the last layer's, 4 KiB) and last ones
    (the first layer's bias, 1 KiB) are too small for a 64 KiB switch_min_bytes alone,
    and this rank's batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), SlowBackward(),
                                torch.nn.Linear(256, 256), SlowBackward(),
                                torch.nn.Linear(256, 4))
    g = torch.Generator().manual_seed(200 + rank)
    return model, torch.randn(32, 64, generator=g), torch.randn(32, 4, generator=g)


def torch_optimizer_fusion(comm: Any, p: dict) -> dict[str, Any]:
    """p["steps"] steps of a DistributedOptimizer on fusion_problem: the engines that
    served them (stats before the first and after the last) and the parameters."""
    import ina_collectives.torch as hvd
    hvd.init(comm, switch_min_bytes=p["min_bytes"])
    model, x, y = fusion_problem(hvd.rank())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    before = hvd.stats()["engines"]
    for _ in range(p["steps"]):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    after = hvd.stats()["engines"]
    out = {"engines": {e: c - before.get(e, 0) for e, c in after.items()
                       if c - before.get(e, 0)},
           "params": [_np(t) for t in model.parameters()]}
    hvd.shutdown()
    return out


def torch_half_scaling(comm: Any, p: dict) -> dict[str, Any]:
    """float16 allreduces with prescale/postscale factors, through every variant."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()
    f, g = p["factors"]
    x = lambda seed: torch_input("float16", (17, 3), r, seed)  # noqa: E731
    out: dict[str, Any] = {}
    out["allreduce/pre"] = _np(hvd.allreduce(x(0), op=hvd.Sum, prescale_factor=f))
    out["allreduce/post"] = _np(hvd.allreduce(x(1), op=hvd.Sum, postscale_factor=f))
    out["allreduce/average"] = _np(hvd.allreduce(x(2), prescale_factor=f, postscale_factor=g))
    out["allreduce_"] = _np(hvd.allreduce_(x(3), op=hvd.Sum, prescale_factor=f,
                                           postscale_factor=g))
    kept = x(4)
    out["allreduce_async"] = _np(hvd.synchronize(hvd.allreduce_async(
        kept, op=hvd.Sum, prescale_factor=f, postscale_factor=g)))
    out["input_kept"] = bool(torch.equal(kept, x(4)))
    out["allreduce_async_"] = _np(hvd.synchronize(hvd.allreduce_async_(
        x(5), op=hvd.Average, prescale_factor=f, postscale_factor=g)))
    out["grouped"] = [_np(t) for t in hvd.grouped_allreduce(
        [x(6), x(7)], op=hvd.Sum, prescale_factor=f, postscale_factor=g)]
    out["grouped_"] = [_np(t) for t in hvd.grouped_allreduce_(
        [x(8), x(9)], op=hvd.Sum, prescale_factor=f, postscale_factor=g)]
    hvd.shutdown()
    return out


def torch_alltoall_forms(comm: Any, p: dict) -> dict[str, Any]:
    """alltoall returns the output alone without splits, (output, splits) with them."""
    import ina_collectives.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    plain = hvd.alltoall(x)
    out["plain"] = (type(plain).__name__, _np(plain))
    pair = hvd.alltoall(x, splits=[2] * n)
    out["pair"] = (type(pair).__name__, _np(pair[0]), pair[1].tolist())
    t = x.clone().requires_grad_(True)
    y = hvd.alltoall(t)
    (y * (torch.arange(2 * n, dtype=torch.float32) + 10 * r)).sum().backward()
    out["grad"] = _np(t.grad)
    hvd.shutdown()
    return out


def torch_optimizer_unnamed(comm: Any, p: dict) -> dict[str, Any]:
    """DistributedOptimizer without named_parameters over two parameter groups."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()
    model, x, y = optimizer_problem(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1))
    names = opt._parameter_names
    out: dict[str, Any] = {"names": [names[q] for q in model.parameters()],
                           "all_names": hvd.allgather_object(sorted(names.values()))}
    opt.zero_grad()
    loss_of(model, x, y).backward()
    opt.step()
    out["params"] = [_np(t) for t in model.parameters()]
    hvd.shutdown()
    return out


class _CountingOptimizer(torch.optim.Optimizer):
    """State of Python scalars, None and a tensor, as some optimizers keep."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for q in group["params"]:
                state = self.state[q]
                state["count"] = state.get("count", 0) + 1
                state["scale"] = 0.5 * state["count"]
                state["nothing"] = None
                state["buffer"] = torch.full_like(q, float(state["count"]))


def torch_optimizer_state(comm: Any, p: dict) -> dict[str, Any]:
    """broadcast_optimizer_state: scalar and None state entries; a fresh optimizer's
    state and gradients created as Horovod does (frozen parameters keep no gradient)."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()
    out: dict[str, Any] = {}
    model = torch.nn.Linear(2, 2)
    counting = _CountingOptimizer(model.parameters(), lr=0.1 + r)
    for _ in range(3 if r == 0 else 0):
        counting.step()
    hvd.broadcast_optimizer_state(counting, root_rank=0)
    out["counting"] = [(s["count"], s["scale"], s["nothing"], _np(s["buffer"]).tolist())
                       for s in counting.state.values()]
    out["lr"] = counting.param_groups[0]["lr"]
    frozen = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    trained = torch.nn.Parameter(torch.rand(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, trained], lr=0.01, momentum=0.9),
                                   named_parameters=[("frozen", frozen), ("trained", trained)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["frozen_grad"] = None if frozen.grad is None else _np(frozen.grad)
    out["trained_grad"] = None if trained.grad is None else _np(trained.grad)
    out["momentum"] = [k for s in opt.state.values() for k in s]
    hvd.shutdown()
    return out


def sparse_input(rank: int, rows: int = 40, dim: int = 3) -> torch.Tensor:
    """A rank's sparse gradient-like tensor: some rows of a rows x dim table, uncoalesced
    (a row may repeat), rank 1's empty."""
    if rank == 1:
        return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64),
                                       torch.zeros((0, dim)), (rows, dim),
                                       check_invariants=True)
    g = torch.Generator().manual_seed(10 + rank)
    index = torch.randint(0, rows, (12,), generator=g)
    return torch.sparse_coo_tensor(index.reshape(1, -1), torch.randn(12, dim, generator=g),
                                   (rows, dim), check_invariants=True)


def torch_sparse(comm: Any, p: dict) -> dict[str, Any]:
    """Sparse COO tensors through the Horovod API: sparse_allreduce_async (Sum and
    Average, a rank with no entries), allreduce of a sparse tensor, bad input, and the
    DistributedOptimizer with an nn.Embedding(sparse=True) (sparse and sparse_as_dense)."""
    import ina_collectives.torch as hvd
    hvd.init(comm)
    r = hvd.rank()
    out: dict[str, Any] = {}
    x = sparse_input(r)
    out["sum"] = _np(hvd.sparse_allreduce_async(x, name="s", op=hvd.Sum)().to_dense())
    avg = hvd.sparse_allreduce_async(x, name="a", op=hvd.Average)()
    out["average"] = _np(avg.to_dense())
    out["coalesced"] = bool(avg.is_coalesced())
    out["allreduce"] = _np(hvd.allreduce(x, op=hvd.Sum).to_dense())
    # Bad input: tables of different sizes, an index out of range, a dense tensor.
    out["shapes"] = _attempt(lambda: hvd.sparse_allreduce_async(sparse_input(r, rows=40 + r),
                                                                name="bad1")())
    wild = torch.sparse_coo_tensor([[0, 99 if r == 0 else 1]], torch.ones(2, 3), (40, 3),
                                   check_invariants=False)
    out["range"] = _attempt(lambda: hvd.sparse_allreduce_async(wild, name="bad2")())
    out["dense"] = _attempt(lambda: hvd.sparse_allreduce_async(torch.ones(3), name="bad3"))
    out["op"] = _attempt(lambda: hvd.sparse_allreduce_async(x, name="bad4", op=hvd.Max))
    out["after"] = _np(hvd.allreduce(torch.ones(3), op=hvd.Sum))
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        table = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(table.parameters()),
                                                              lr=0.1),
                                       named_parameters=[(f"emb{sparse_as_dense}",
                                                          table.weight)],
                                       sparse_as_dense=sparse_as_dense)
        index = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]] if r == 0 else [[1, 3, 4], [4, 7, 9]])
        opt.zero_grad()
        (table(index) * (r + 1)).sum().backward()
        opt.step()
        out[f"weight_{sparse_as_dense}"] = _np(table.weight.detach())
    hvd.shutdown()
    return out


def torch_switch_dies_after_the_last_result(comm: Any, p: dict) -> dict[str, Any]:
    """The Horovod API's runtime: rank 1's results stop reaching it from the second call's
    stream on (its socket takes datagrams from a dead address only), rank 0 returns from that
    call and SIGKILLs the switch. Rank 1 must get rank 0's bits, through the rescue its
    TROUBLE row starts in the next negotiation, which rank 0's idle cycles make."""
    import signal

    import ina_collectives.torch as hvd
    from ina_collectives.runtime import world
    hvd.init(comm, switch_min_bytes=0, switch_silence=1.5, timeout=30)
    r = hvd.rank()
    n = p["count"]
    x = torch.arange(n, dtype=torch.float32) * (r + 1)
    # The first call's input is the second's: the second repeats it, so it goes
    # predicted (docs/protocol.md, One round trip) and its prediction holds, with no
    # opening, of which rank 1 hears nothing either.
    first = hvd.allreduce(x.clone(), op=hvd.Sum, name="first")
    if r == 1:  # from the stream on
        deaf_from_the_stream(world.require().runtime.collectives.offload.link)
    hvd.barrier()
    start = time.monotonic()
    second = hvd.allreduce(x, op=hvd.Sum, name="second")
    seconds = time.monotonic() - start
    if r == 0:
        os.kill(p["switch_pid"], signal.SIGKILL)
    third = hvd.allreduce(torch.full((n,), 2.0), op=hvd.Sum, name="third")
    out = {"first": _np(first), "second": _np(second), "third": _np(third),
           "seconds": seconds, "switch": hvd.stats()["switch"],
           "engines": hvd.stats()["engines"]}
    hvd.shutdown()
    return out


def torch_two_calls_a_cycle(comm: Any, p: dict) -> dict[str, Any]:
    """The Horovod API's runtime with two calls in one cycle (a grouped allreduce of a
    float32 and a float64 tensor: two fusion groups). Both open through the switch and
    end with no vote. Then the same with rank 1 deaf from the first call's stream on:
    rank 0 holds every result of it and opens the second, which rank 1 never reaches;
    both take the error path when their waits end, rank 1 completes the first call from
    rank 0's kept window, and the second takes the ring on both. (Every call opens:
    switch_predict off; torch_switch_dies_after_the_last_result has a predicted one.)"""

    import ina_collectives.torch as hvd
    from ina_collectives.runtime import world
    hvd.init(comm, switch_min_bytes=0, switch_silence=1.5, timeout=30, switch_predict=False)
    r = hvd.rank()
    n = p["count"]
    ina = world.require().runtime.collectives.offload

    def pair(scale: float) -> list[torch.Tensor]:
        return [torch.arange(n, dtype=torch.float32) * (r + 1) * scale,
                torch.arange(n, dtype=torch.float64) * (r + 1) * scale]

    before = dict(ina.switch_state())
    clean = hvd.grouped_allreduce(pair(1.0), op=hvd.Sum, name="clean")
    state = ina.switch_state()
    out: dict[str, Any] = {
        "clean": [_np(t) for t in clean],
        "clean_opened": state["opened_calls"] - before["opened_calls"],
        "clean_vote_free": state["vote_free_calls"] - before["vote_free_calls"]}
    if r == 1:  # from the next stream on (its opening still gets through)
        deaf_from_the_stream(ina.link)
    hvd.barrier()
    deaf = hvd.grouped_allreduce(pair(2.0), op=hvd.Sum, name="deaf")
    out.update(deaf=[_np(t) for t in deaf], switch=hvd.stats()["switch"],
               engines=hvd.stats()["engines"])
    hvd.shutdown()
    return out


def skewed_sparse(rank: int, step: int, rows: int = 100, dim: int = 4) -> torch.Tensor:
    """A rank's sparse gradient at ``step``: 20 lookups, most of them of a few rows."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    hot = torch.randint(0, 6, (14,), generator=g)
    cold = torch.randint(0, rows, (6,), generator=g)
    index = torch.cat([hot, cold]).reshape(1, -1)
    return torch.sparse_coo_tensor(index, torch.randn(20, dim, generator=g), (rows, dim),
                                   check_invariants=True)


def torch_sparse_hot(comm: Any, p: dict) -> dict[str, Any]:
    """The same sparse tensor name reduced p["steps"] times with hot rows on: the hot
    rows' sums go through the switch, the rest are gathered; each step's dense result."""
    import ina_collectives.torch as hvd
    hvd.init(comm, switch_min_bytes=0, sparse_hot_rows=p["hot_rows"], sparse_reelect_calls=2)
    r = hvd.rank()
    out: dict[str, Any] = {"results": [], "nnz": []}
    for step in range(p["steps"]):
        result = hvd.sparse_allreduce_async(skewed_sparse(r, step), name="emb", op=hvd.Sum)()
        out["results"].append(_np(result.to_dense()))
        out["nnz"].append(int(result._nnz()))
    if p.get("bad"):  # the next calls are a trial of the hot rows: rank 1's input is bad
        good = skewed_sparse(r, 99)
        wild = torch.sparse_coo_tensor([[0, 100 + r]], torch.ones(2, 4), (100, 4),
                                       check_invariants=False)
        bigger = skewed_sparse(r, 98, rows=101 if r == 1 else 100)
        for key, x in (("outside", wild if r == 1 else good),
                       ("shapes", bigger), ("after", good)):
            out[key] = _attempt(
                lambda x=x: _np(hvd.sparse_allreduce_async(x, name="emb", op=hvd.Sum)()
                                .to_dense()))
    stats = hvd.stats()
    out["sparse"], out["engines"] = stats["sparse"], stats["engines"]
    hvd.shutdown()
    return out


def torch_overlap(comm: Any, p: dict) -> dict[str, Any]:
    """The same model trained twice from the same start on the same batches: with the
    plain DistributedOptimizer, and with overlap=model (each module's update at its next
    forward). The parameters of both after every step, and the engines that served."""
    import ina_collectives.torch as hvd
    hvd.init()
    r = hvd.rank()

    def model_and_optimizer(overlap: bool) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        inner = (torch.optim.Adam(model.parameters(), lr=1e-2) if p["optimizer"] == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return model, hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(),
            overlap=model if overlap else None)

    g = torch.Generator().manual_seed(100 + r)
    batches = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(p["steps"])]
    out: dict[str, Any] = {}
    for overlap in (False, True):
        model, opt = model_and_optimizer(overlap)
        steps = []
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if not overlap:
                steps.append([_np(q) for q in model.parameters()])
        if overlap:
            pending = len(opt.in_flight())
            opt.synchronize()
            out["pending_before_synchronize"] = pending
        out["overlap" if overlap else "plain"] = [_np(q) for q in model.parameters()]
        out["steps_" + ("overlap" if overlap else "plain")] = len(batches)
    stats = hvd.stats()
    out["engines"] = stats["engines"]
    out["resent"] = sum(stats["transport"].get(k, 0) for k in (
        "retransmitted", "nack_resent", "result_requests"))
    return out

