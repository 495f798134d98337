"""The training demo with FSDP2 (torch.distributed.fsdp.fully_shard) on backend "ina":
parameters, gradients and optimizer state are sharded over a DeviceMesh; each layer's
parameters are all-gathered for its forward and backward, its gradients reduce-scattered,
and training ends where one process training on the same data ends. Backend "ina" runs
the reduce-scatters round the ring and the all-gathers through MPI: the switch would
move all of a layer's gradients each way, the ring (n-1)/n of them (docs/netsim-workloads.md).

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
from train_ddp import demo_main, train_epochs  # noqa: E402
from train_mlp import demo_arguments, make_model  # noqa: E402


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
    return train_epochs(args, model, optimizer, x, y, model)


def main() -> int:
    return demo_main(demo_arguments(__doc__, epochs=3, samples=8192, hidden=512).parse_args(),
                     train)


if __name__ == "__main__":
    sys.exit(main())
