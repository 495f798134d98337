"""The training demo with DistributedDataParallel on the torch.distributed backend "ina":
the gradients' buckets are reduced through the (software) switch, and training ends
where one process training on the same data ends.

    ina-run -np 4 -- python examples/train_ddp.py
    ina-run -np 2 -- python examples/train_ddp.py --hook fp16   # DDP's fp16 comm hook
    ina-run -np 2 -- python examples/train_ddp.py --hook ina    # gloo, buckets by the switch

Same model, data and check as examples/train_mlp.py (the Horovod API's demo): rank 0
prints the loss per epoch and the engines that served the group's calls, then trains
the same model on one process with the same global batches and exits 1 unless the final
losses agree within --tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ina_collectives.torch.hooks import allreduce_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import (  # noqa: E402
    check_against_one_process,
    demo_arguments,
    global_batches,
    make_data,
    make_model,
)

import ina_collectives.torch.distributed as ina_dist  # noqa: E402 - registers "ina"


def mpi_rendezvous() -> None:
    """Under ina-run or mpiexec the ranks are MPI's; torch's rendezvous needs an address
    that every rank agrees on: rank 0 picks a free port and tells the others."""
    if "MASTER_PORT" in os.environ:
        return
    import socket

    from mpi4py import MPI
    port = 0
    if MPI.COMM_WORLD.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(MPI.COMM_WORLD.bcast(port, root=0))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = (str(MPI.COMM_WORLD.rank),
                                                    str(MPI.COMM_WORLD.size))


def train(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must divide among {size} ranks")
    model = DistributedDataParallel(make_model(x.shape[1], args.hidden, int(y.max()) + 1))
    if args.hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "ina":  # the process group stays gloo: only the buckets take the switch
        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"{size} ranks, backend {dist.get_backend()}, comm hook {args.hook}",
              flush=True)
    return train_epochs(args, model, optimizer, x, y, model.module)


def train_epochs(args: argparse.Namespace, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 evaluated: torch.nn.Module) -> float:
    """The demos' loop: each rank trains on its slice of every global batch (the mean
    loss of equal slices: the data-parallel wrapper averages the gradients), and after
    each epoch ``evaluated`` (the model without its wrapper) is scored on all the data;
    the last epoch's loss."""
    rank, size = dist.get_rank(), dist.get_world_size()
    loss = float("nan")
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(x.shape[0], args.batch, epoch):
            mine = batch.chunk(size)[rank]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            optimizer.step()
        loss = epoch_loss(evaluated, x, y, epoch)
    return loss


def epoch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epoch: int
               ) -> float:
    """The model's mean loss over all the data, each rank computing its share, summed
    over the group; rank 0 prints it with the engines that served the group so far."""
    rank, size = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        part = torch.arange(rank, x.shape[0], size)
        total = torch.nn.functional.cross_entropy(model(x[part]), y[part],
                                                  reduction="sum").reshape(1)
    dist.all_reduce(total)
    loss = float(total) / x.shape[0]
    if rank == 0:
        print(f"epoch {epoch}: loss {loss:.5f}, engines {ina_dist.stats()['engines']}",
              flush=True)
    return loss


def demo_main(args: argparse.Namespace,
              train: Callable[[argparse.Namespace, torch.Tensor, torch.Tensor], float]
              ) -> int:
    """Run a demo's ``train`` on backend "ina" (under ina-run, mpiexec or torchrun) and
    check it against one process: the exit code."""
    torch.set_num_threads(1)  # the ranks share the cores
    mpi_rendezvous()
    dist.init_process_group("gloo" if getattr(args, "hook", "") == "ina" else "ina")
    x, y = make_data(args.samples, args.features, 10)
    loss = train(args, x, y)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return check_against_one_process(args, x, y, loss) if rank == 0 else 0


def main() -> int:
    parser = demo_arguments(__doc__, epochs=3, samples=8192, hidden=512)
    parser.add_argument("--hook", choices=("none", "fp16", "ina"), default="none",
                        help="a DDP communication hook (fp16: default_hooks' compression; "
                             "ina: the process group is gloo and the hook sends the "
                             "gradient buckets through the switch)")
    return demo_main(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
