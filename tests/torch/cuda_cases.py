"""What each rank of the CUDA test job runs (tests/torch/test_cuda.py: a rank function,
``mpirun.run(2, cuda_cases.cuda_apis, params)``). Every rank puts its tensors on
``p["device"]`` ("cuda": GPU rank % count, so two ranks may share one GPU; "cpu" runs the
same code without one)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.integration.ddp_cases import _free_port
from tests.integration.torch_cases import _np, torch_input


def _device(comm: Any, p: dict) -> torch.device:
    if p["device"] == "cuda":
        return torch.device("cuda", comm.rank % torch.cuda.device_count())
    return torch.device(p["device"])


def _train(model: torch.nn.Module, device: torch.device, steps: int) -> list[Any]:
    """SGD on the same data everywhere, each rank its slice: the final parameters."""
    r, n = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    mine = slice(r * 64 // n, (r + 1) * 64 // n)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine].to(device)), y[mine].to(device))
        loss.backward()
        optimizer.step()
    return [_np(q.detach().cpu()) for q in model.parameters()]


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 4)).to(device)


def _group(comm: Any, backend: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(_free_port() if comm.rank == 0 else 0, root=0))
    dist.init_process_group(backend, rank=comm.rank, world_size=comm.size)


def cuda_apis(comm: Any, p: dict) -> dict[str, Any]:
    """Each API with tensors on the device: the Horovod API's allreduce of every float
    dtype (several 4 MiB windows each) in place and out of place; DDP on backend "ina";
    DDP on gloo with the hook; DDP on the CPU for reference. The results (on the host),
    the devices they came back on, and the engines that served."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ina_collectives as ina
    import ina_collectives.torch as hvd
    import ina_collectives.torch.distributed as ina_dist
    from ina_collectives.torch.hooks import allreduce_hook
    device = _device(comm, p)
    out: dict[str, Any] = {"device": str(device)}
    hvd.init()
    for dtype in ("float32", "float16", "bfloat16"):
        x = torch_input(dtype, tuple(p["shape"]), comm.rank).to(device)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
        out[f"allreduce/{dtype}"] = (_np(y.cpu()), str(y.device))
        hvd.allreduce_(x, op=hvd.Average, name=f"average.{dtype}")
        out[f"allreduce_/{dtype}"] = (_np(x.cpu()), str(x.device))
    out["hvd_engines"] = dict(hvd.stats()["engines"])
    hvd.shutdown()

    _group(comm, "ina")
    out["ddp_ina"] = _train(DDP(_model(device)), device, p["steps"])
    out["ddp_ina_engines"] = dict(ina_dist.stats()["engines"])
    out["ddp_cpu"] = _train(DDP(_model(torch.device("cpu"))), torch.device("cpu"),
                            p["steps"])
    dist.destroy_process_group()

    _group(comm, "gloo")
    model = DDP(_model(device))
    model.register_comm_hook(None, allreduce_hook)
    out["hook_gloo"] = _train(model, device, p["steps"])
    out["hook_engines"] = dict(ina.stats()["engines"])
    dist.destroy_process_group()
    return out

