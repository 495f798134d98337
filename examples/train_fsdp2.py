"""The training demo with FSDP2 (torch.distributed.fsdp.fully_shard) on backend "ina":
parameters, gradients and optimizer state are sharded over a DeviceMesh; each layer's
parameters are all-gathered for its forward and backward, its gradients reduce-scattered,
and training ends where one process training on the same data ends. Backend "ina" runs
the reduce-scatters round the ring and the all-gathers through MPI: the switch would
move all of a layer's gradients each way, the ring (n-1)/n of them (docs/netsim.md).

    ina-run -np 4 -- python examples/train_fsdp2.py
    ina-run --launcher torchrun -np 4 -- python examples/train_fsdp2.py

Same model, data and check as examples/train_mlp.py (the Horovod API's demo) and
examples/train_ddp.py: rank 0 prints the loss per epoch and the engines that served the
group's calls, then trains the same model on one process with the same global batches
and exits 1 unless the final losses agree within --tolerance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_ddp import mpi_rendezvous  # noqa: E402
from train_mlp import (  # noqa: E402
    check_against_one_process,
    demo_arguments,
    global_batches,
    make_data,
    make_model,
)

import ina_collectives.torch.distributed as ina_dist  # noqa: E402 - registers "ina"


def train(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must divide among {size} ranks")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    model = make_model(x.shape[1], args.hidden, int(y.max()) + 1)
    for layer in model:  # each linear layer its own unit: gathered only while it runs
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"{size} ranks, backend {dist.get_backend()}, FSDP2 over mesh "
              f"{mesh.mesh.tolist()}", flush=True)
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(x.shape[0], args.batch, epoch):
            mine = batch.chunk(size)[rank]
            optimizer.zero_grad()
            # FSDP2 averages the gradients over the ranks: with equal slices, the mean
            # loss of each slice gives the global batch's mean gradient.
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            optimizer.step()
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


def main() -> int:
    parser = demo_arguments(__doc__, epochs=3, samples=8192, hidden=512)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the cores
    mpi_rendezvous()
    dist.init_process_group("ina")
    x, y = make_data(args.samples, args.features, 10)
    loss = train(args, x, y)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return check_against_one_process(args, x, y, loss) if rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
