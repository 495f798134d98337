"""What each rank of a torch.distributed test job runs (backend "ina"): rank functions of
(comm, params), under mpiexec or torchrun (``mpirun.run(3, ddp_cases.ddp_quorum, params)``,
tests/integration/mpirun.py); they return plain values for
tests/integration/test_torch_distributed.py to check against what it computes itself."""
from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from tests.integration.torch_cases import _attempt, _np, torch_input

DTYPES = ["uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def _start(comm: Any, **options: Any) -> None:
    """init_process_group("ina"): under torchrun from its environment, under MPI with a
    rendezvous address rank 0 picks."""
    import ina_collectives.torch.distributed  # noqa: F401 - registers the backend
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group("ina", **options)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(_free_port() if comm.rank == 0 else 0, root=0))
    dist.init_process_group("ina", rank=comm.rank, world_size=comm.size, **options)


def ddp_quorum(comm: Any, p: dict) -> dict[str, Any]:
    """ina_collectives.set_quorum on the default group, then all_reduce AVG and SUM."""
    import numpy as np

    import ina_collectives as ina
    _start(comm)
    r = dist.get_rank()
    x = torch.from_numpy(np.random.default_rng(70 + r).standard_normal(70_000)
                         .astype(np.float32))
    ina.set_quorum(p["quorum"])
    out: dict[str, Any] = {}
    for op in ("AVG", "SUM"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = _np(t)
    out["counted"] = ina.last_call_counted()
    out["report"] = ina.stats()["switch"]["quorum"]
    dist.destroy_process_group()
    return out


def ddp_ops(comm: Any, p: dict) -> dict[str, Any]:
    """Every collective and dtype, against values computed by the test."""
    import ina_collectives.torch.distributed as ina_dist
    _start(comm)
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (
            ["AVG"] if dtype.startswith(("float", "bfloat")) else ["BAND", "BOR", "BXOR"])
        for op in ops:
            t = torch_input(dtype, (5, 3), r, seed=ops.index(op))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce/{dtype}/{op}"] = _np(t)
        t = torch_input(dtype, (4,), r, 1)
        work = dist.all_reduce(t, async_op=True)
        out[f"async/{dtype}"] = _np(work.get_future().wait()[0])
        gathered = [torch.empty(2, 2, dtype=getattr(torch, dtype)) for _ in range(n)]
        dist.all_gather(gathered, torch_input(dtype, (2, 2), r, 2))
        out[f"all_gather/{dtype}"] = [_np(g) for g in gathered]
        flat = torch.empty(2 * n, dtype=getattr(torch, dtype))
        dist.all_gather_into_tensor(flat, torch_input(dtype, (2,), r, 3))
        out[f"all_gather_into_tensor/{dtype}"] = _np(flat)
        lists = [[torch.empty(2, dtype=getattr(torch, dtype)),
                  torch.empty(1, 3, dtype=getattr(torch, dtype))] for _ in range(n)]
        dist.all_gather_coalesced(lists, [torch_input(dtype, (2,), r, 60),
                                          torch_input(dtype, (1, 3), r, 61)])
        out[f"all_gather_coalesced/{dtype}"] = [[_np(a), _np(b)] for a, b in lists]
        b = torch_input(dtype, (3,), r, 4)
        dist.broadcast(b, src=n - 1)
        out[f"broadcast/{dtype}"] = _np(b)
        scattered = torch.empty(2, dtype=getattr(torch, dtype))
        dist.reduce_scatter(scattered, [torch_input(dtype, (2,), r, 10 + q) for q in range(n)])
        out[f"reduce_scatter/{dtype}"] = _np(scattered)
        single = torch.empty(2, dtype=getattr(torch, dtype))
        dist.reduce_scatter_tensor(single, torch_input(dtype, (2 * n,), r, 5))
        out[f"reduce_scatter_tensor/{dtype}"] = _np(single)
        # Uneven splits: rank r sends q + 1 rows to rank q.
        send = torch_input(dtype, (n * (n + 1) // 2,), r, 6)
        received = torch.empty(n * (r + 1), dtype=getattr(torch, dtype))
        dist.all_to_all_single(received, send, [r + 1] * n, [q + 1 for q in range(n)])
        out[f"all_to_all_single/{dtype}"] = _np(received)
        outs = [torch.empty(2, dtype=getattr(torch, dtype)) for _ in range(n)]
        dist.all_to_all(outs, [torch_input(dtype, (2,), r, 20 + q) for q in range(n)])
        out[f"all_to_all/{dtype}"] = [_np(o) for o in outs]
        rows = [torch.empty(2, dtype=getattr(torch, dtype)) for _ in range(n)]
        dist.gather(torch_input(dtype, (2,), r, 30), rows if r == n - 1 else None, dst=n - 1)
        out[f"gather/{dtype}"] = [_np(g) for g in rows] if r == n - 1 else None
        mine = torch.empty(3, dtype=getattr(torch, dtype))
        dist.scatter(mine, [torch_input(dtype, (3,), q, 40) for q in range(n)] if r == 0
                     else None, src=0)
        out[f"scatter/{dtype}"] = _np(mine)
    dist.barrier()
    out["stats"] = ina_dist.stats()
    import ina_collectives
    out["package_stats"] = ina_collectives.stats()  # without ina.init(): the default group's
    out["package_summary"] = ina_collectives.summary()
    dist.destroy_process_group()
    return out


def ddp_mismatch(comm: Any, p: dict) -> dict[str, Any]:
    """Ranks that disagree get torch's DistBackendError on every rank, naming each rank's
    call; the group goes on working."""
    _start(comm)
    r = dist.get_rank()
    out = {
        "shape": _attempt(lambda: dist.all_reduce(torch.ones(3 + (r == 1)))),
        "dtype": _attempt(lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32))),
        "op": _attempt(lambda: dist.all_reduce(
            torch.ones(3), op=dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM)),
        "kind": _attempt(lambda: dist.broadcast(torch.ones(3), src=0) if r == 1
                         else dist.all_reduce(torch.ones(3))),
        "premul": _attempt(lambda: dist.all_reduce(
            torch.ones(3), op=dist._make_nccl_premul_sum(2.0))),
        "bool_broadcast": _attempt(lambda: dist.broadcast(torch.ones(3, dtype=torch.bool),
                                                          src=0)),
        "bool_gather": _attempt(lambda: dist.all_gather_into_tensor(
            torch.empty(6, dtype=torch.bool), torch.ones(3, dtype=torch.bool))),
        "bool_scatter": _attempt(lambda: dist.reduce_scatter_tensor(
            torch.empty(3, dtype=torch.bool), torch.ones(6, dtype=torch.bool))),
    }
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = _np(t)
    dist.destroy_process_group()
    return out


def ddp_train(comm: Any, p: dict) -> dict[str, Any]:
    """DDP on a small model; with p["kill_after_steps"] rank 0 SIGKILLs the switch then
    and training goes on (the exact path). Returns the final parameters."""
    import ina_collectives.torch.distributed as ina_dist
    _start(comm)
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    engines = []
    for step in range(p["steps"]):
        if step == p.get("kill_after_steps") and r == 0:
            os.kill(p["switch_pid"], signal.SIGKILL)
        mine = slice(r * 64 // n, (r + 1) * 64 // n)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
        engines.append(dict(ina_dist.stats()["engines"]))
    params = [_np(q) for q in model.parameters()]
    dist.destroy_process_group()
    return {"params": params, "engines": engines, "threads": threading.active_count()}


def _sparse_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(),
                               torch.nn.Linear(32, 1))


def _sparse_batches(rank: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3 + rank)
    return [torch.randint(0, 50, (6, 4), generator=g) for _ in range(steps)]


def ddp_sparse_embedding(comm: Any, p: dict) -> dict[str, Any]:
    """DDP with an nn.Embedding(sparse=True) on backend "ina": its sparse gradients
    reduced exactly; the final parameters (sparse_embedding_alone gives one process's)."""
    _start(comm)
    model = torch.nn.parallel.DistributedDataParallel(_sparse_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for index in _sparse_batches(dist.get_rank(), p.get("steps", 5)):
        optimizer.zero_grad()
        model(index).pow(2).mean().backward()
        optimizer.step()
    params = [_np(q.detach()) for q in model.parameters()]
    dist.destroy_process_group()
    return {"params": params}


def sparse_embedding_alone(world: int, steps: int = 5) -> list[Any]:
    """What ddp_sparse_embedding's ranks end with, in one process: each step's gradient
    the mean of the ranks' gradients, as DDP averages them."""
    model = _sparse_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_sparse_batches(r, steps) for r in range(world)]
    for step in range(steps):
        optimizer.zero_grad()
        sum(model(b[step]).pow(2).mean() for b in batches).div(world).backward()
        optimizer.step()
    return [_np(q.detach()) for q in model.parameters()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_subgroups(comm: Any, p: dict) -> dict[str, Any]:
    """new_group: a subgroup of ranks 0 and 2 (a job of its own) and one of every rank."""
    import ina_collectives.torch.distributed as ina_dist
    _start(comm)
    r = dist.get_rank()
    pair = dist.new_group([0, 2])
    everyone = dist.new_group(list(range(dist.get_world_size())))
    out: dict[str, Any] = {}
    if r in (0, 2):
        t = torch.full((100000,), float(r + 1))
        dist.all_reduce(t, group=pair)
        out["pair"] = _np(t[:3])
        out["pair_stats"] = ina_dist.stats(pair)["engines"]
    t = torch.full((4,), float(r))
    dist.all_reduce(t, group=everyone, op=dist.ReduceOp.MAX)
    out["everyone"] = _np(t)
    dist.destroy_process_group()
    return out


def ddp_p2p(comm: Any, p: dict) -> dict[str, Any]:
    """send/recv, isend/irecv around a ring, every dtype; batch_isend_irecv; a receive
    whose tensor is larger than what came, and one that nobody sends (a group with a
    2-second timeout)."""
    import datetime
    _start(comm)
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        got = torch.empty(4, 3, dtype=getattr(torch, dtype))
        sending = dist.isend(torch_input(dtype, (4, 3), r, 50), right, tag=7)
        dist.recv(got, left, tag=7)
        sending.wait()
        out[f"ring/{dtype}"] = _np(got)
    back = torch.empty(5)
    ops = [dist.P2POp(dist.isend, torch.full((5,), float(r)), left),
           dist.P2POp(dist.irecv, back, right)]
    out["batch"] = _attempt(lambda: [w.wait() for w in dist.batch_isend_irecv(ops)])
    out["batch_got"] = _np(back)
    anyone = torch.empty(2)
    if r == 0:
        out["any_source"] = []
        for _ in range(n - 1):
            sender = dist.recv(anyone)
            out["any_source"].append((sender, _np(anyone).tolist()))
    else:
        dist.send(torch.full((2,), float(r)), 0)
    dist.barrier()
    short = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=2))
    if r == 0:
        out["too_large"] = _attempt(lambda: dist.recv(torch.empty(9), 1, group=short))
        out["never_sent"] = _attempt(lambda: dist.recv(torch.empty(3), 1, tag=99,
                                                       group=short))
    elif r == 1:
        dist.send(torch.ones(4), 0, group=short)
    out["bad_tag"] = _attempt(lambda: dist.send(torch.ones(1), right, tag=-1))
    out["bad_peer"] = _attempt(lambda: short.send([torch.ones(1)], n, 0))
    # The root's rows do not fit the output: the root refuses at once, the others' wait
    # ends with the short group's bound.
    rows = [torch.ones(3) for _ in range(n)] if r == 0 else None
    out["scatter_misfit"] = _attempt(lambda: dist.scatter(torch.empty(2), rows, src=0,
                                                          group=short))
    dist.barrier()
    dist.destroy_process_group()
    # The others' gate of the scatter timed out with its allgather still posted (the root
    # never made it): MPI_Finalize could wait on it, so every rank leaves without it.
    out["abandoned"] = True
    return out


def fsdp2_train(comm: Any, p: dict) -> dict[str, Any]:
    """FSDP2 (fully_shard over init_device_mesh) trains an MLP for a few steps, and a
    DTensor is sharded and replicated again on the same mesh; backend p["backend"]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ina_collectives.torch.distributed as ina_dist
    backend = p.get("backend", "ina")
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise RuntimeError("fsdp2_train runs under torchrun")
    dist.init_process_group(backend)
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(p.get("steps", 4)):
        x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    params = [_np(q.full_tensor().detach()) for q in model.parameters()]
    whole = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()]).to_local()
    out = {"losses": losses, "params": params, "local_rows": sharded.to_local().shape[0],
           "replicated": _np(replicated), "group_name": mesh.get_group().group_name}
    if backend == "ina":
        out["engines"] = dict(ina_dist.stats()["engines"])
    dist.destroy_process_group()
    return out


def dist_overlap(comm: Any, p: dict) -> dict[str, Any]:
    """torch.distributed's DistributedOptimizer (torch/overlap.py) on backend "ina": the
    same model trained from the same start on the same batches with overlap off and on;
    the parameters of both, the updates pending before synchronize, the engines."""
    import ina_collectives
    from ina_collectives.torch.overlap import DistributedOptimizer
    _start(comm)
    r = dist.get_rank()
    g = torch.Generator().manual_seed(200 + r)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g))
               for _ in range(p["steps"])]
    out: dict[str, Any] = {}
    for overlap in (False, True):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 5))
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model,
                                   overlap=overlap)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if overlap:  # the last step's updates wait for a forward: before and after
            out["before_synchronize"] = [_np(q) for q in model.parameters()]
            opt.synchronize()
        out["overlap" if overlap else "plain"] = [_np(q) for q in model.parameters()]
        out["isinstance"] = isinstance(opt, torch.optim.Adam)
    out["engines"] = ina_collectives.stats()["engines"]
    dist.destroy_process_group()
    return out


def _hook_model(seed: int, dtype: torch.dtype, hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 4)).to(dtype)


def _hook_train(model: torch.nn.Module, steps: int, accumulate: bool) -> list[Any]:
    """SGD on the same data everywhere, each rank its slice; with ``accumulate`` each step
    is two half-batches, the first under no_sync. The final parameters."""
    r, n = dist.get_rank(), dist.get_world_size()
    dtype = next(model.parameters()).dtype
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 16, generator=g).to(dtype), torch.randn(64, 4, generator=g)
    mine = slice(r * 64 // n, (r + 1) * 64 // n)
    for _ in range(steps):
        optimizer.zero_grad()
        if accumulate:
            half = (mine.stop - mine.start) // 2
            first, second = slice(mine.start, mine.start + half), slice(mine.start + half,
                                                                       mine.stop)
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x[first]).float(), y[first]).backward()
            torch.nn.functional.mse_loss(model(x[second]).float(), y[second]).backward()
        else:
            torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine]).backward()
        optimizer.step()
    return [_np(q.float()) for q in model.parameters()]


def ddp_hook(comm: Any, p: dict) -> dict[str, Any]:
    """DDP on p["backend"] with ina_collectives.torch.hooks.allreduce_hook (p["hook"]):
    a float32 model (gradient_as_bucket_view, static_graph), then a float16 one (no_sync
    accumulation) and a bfloat16 one; with p["nan"], one more step where rank 1's input holds a
    NaN: the gradients every rank ends with. Also the stats the array API reports."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ina_collectives as ina
    from ina_collectives.torch.hooks import allreduce_hook
    dist.init_process_group(p["backend"])
    out: dict[str, Any] = {}
    for dtype in p.get("dtypes", ["float32", "float16", "bfloat16"]):
        plain = dtype == "float32"
        model = DDP(_hook_model(0, getattr(torch, dtype)), gradient_as_bucket_view=plain,
                    static_graph=plain)
        if p["hook"]:
            model.register_comm_hook(None, allreduce_hook)
        # (no_sync accumulation on the float16 model: torch's reducer asserts on no_sync
        # in a static graph's first iteration, with or without a hook.)
        out[dtype] = _hook_train(model, p.get("steps", 6), accumulate=dtype == "float16")
    if p.get("nan"):
        model = DDP(_hook_model(1, torch.float32))
        model.register_comm_hook(None, allreduce_hook)
        x = torch.ones(8, 16)
        if dist.get_rank() == 1:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        out["nan_grads"] = [_np(q.grad) for q in model.parameters()]
    if p["hook"]:
        out["stats"] = ina.stats()
        out["summary"] = ina.summary()
    if p.get("bad_state"):  # a state neither None nor a ProcessGroup: refused, naming it
        def bad_state() -> None:
            model = DDP(_hook_model(0, torch.float32))
            model.register_comm_hook("group", allreduce_hook)
            model(torch.ones(8, 16)).sum().backward()
        out["state"] = _attempt(bad_state)
    dist.destroy_process_group()
    return out
