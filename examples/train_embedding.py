"""Training demo with sparse gradients: a click model shaped like DLRM (two embedding
tables with sparse gradients, a dense bottom layer, a top MLP) trained on generated click
data with DistributedDataParallel on backend "ina" or with the Horovod API, ending where
one process training on the same data ends.

    ina-run -np 4 -- python examples/train_embedding.py --api ddp
    ina-run -np 4 -- python examples/train_embedding.py --api horovod
    INA_SPARSE_HOT_ROWS=1024 ina-run -np 4 -- python examples/train_embedding.py --api horovod

Each sample is a user and an item, drawn from Zipf distributions (a few users and items
are most of the traffic, as in real click logs), and a few dense features; its label is
a click from a fixed random teacher. The embeddings' gradients are sparse COO tensors
(``nn.Embedding(sparse=True)``): they are reduced by the exact sparse exchange, and with
the Horovod API and ``INA_SPARSE_HOT_ROWS`` set their most touched rows are summed
densely through the switch (docs/netsim-workloads.md, "Embedding gradients"); the dense layers'
gradients go through the switch like any float allreduce. Rank 0 prints the loss per
epoch and how the calls were served, then trains the same model on one process with the
same global batches and exits 1 unless the final losses agree within --tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import compare_losses, global_batches  # noqa: E402


class ClickData:
    """Generated click logs: users, items, dense features and the clicks' labels."""

    def __init__(self, samples: int, users: int, items: int, dense: int, zipf: float):
        rng = np.random.default_rng(1234)

        def draw(rows: int) -> torch.Tensor:
            # Zipf over the table's rows (rank r drawn with weight r^-s), row ids shuffled.
            weights = np.arange(1, rows + 1, dtype=np.float64) ** -zipf
            ids = rng.choice(rows, size=samples, p=weights / weights.sum())
            return torch.from_numpy(rng.permutation(rows)[ids])

        self.users, self.items = draw(users), draw(items)
        self.dense = torch.from_numpy(rng.standard_normal((samples, dense), np.float32))
        g = torch.Generator().manual_seed(4321)
        teacher_u = torch.randn(users, 8, generator=g)
        teacher_i = torch.randn(items, 8, generator=g)
        teacher_d = torch.randn(dense, generator=g)
        score = ((teacher_u[self.users] * teacher_i[self.items]).sum(1) / 8 ** 0.5
                 + self.dense @ teacher_d / dense ** 0.5
                 + 0.5 * torch.randn(samples, generator=g))
        self.clicks = (score > 0).float()

    def __len__(self) -> int:
        return int(self.clicks.shape[0])

    def batch(self, index: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return (self.users[index], self.items[index], self.dense[index]), self.clicks[index]


class ClickModel(torch.nn.Module):
    """DLRM's shape, small: an embedding per categorical feature, a bottom layer for the
    dense ones, their pairwise dot products and the vectors into a top MLP."""

    def __init__(self, users: int, items: int, dense: int, dim: int, hidden: int):
        super().__init__()
        torch.manual_seed(0)
        self.user = torch.nn.Embedding(users, dim, sparse=True)
        self.item = torch.nn.Embedding(items, dim, sparse=True)
        for table in (self.user, self.item):
            torch.nn.init.normal_(table.weight, std=0.1)
        self.bottom = torch.nn.Sequential(torch.nn.Linear(dense, dim), torch.nn.ReLU())
        self.top = torch.nn.Sequential(torch.nn.Linear(3 * dim + 3, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        u, i, d = self.user(users), self.item(items), self.bottom(dense)
        dots = torch.stack([(u * i).sum(1), (u * d).sum(1), (i * d).sum(1)], dim=1)
        return self.top(torch.cat([u, i, d, dots], dim=1)).squeeze(1)


def make_model(args: argparse.Namespace) -> ClickModel:
    return ClickModel(args.users, args.items, args.dense, args.dim, args.hidden)


def loss_of(model: torch.nn.Module, data: ClickData, index: torch.Tensor,
            reduction: str = "mean") -> torch.Tensor:
    inputs, clicks = data.batch(index)
    return torch.nn.functional.binary_cross_entropy_with_logits(model(*inputs), clicks,
                                                                reduction=reduction)


def train_epochs(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any,
                 data: ClickData, rank: int, size: int, all_sum: Any, engines: Any,
                 evaluated: torch.nn.Module) -> float:
    """Each rank trains on its slice of every global batch; after each epoch the loss of
    ``evaluated`` over all the data (each rank scoring its share, ``all_sum`` adding
    them). The last epoch's loss."""
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must divide among {size} ranks")
    loss = float("nan")
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(len(data), args.batch, epoch):
            optimizer.zero_grad()
            loss_of(model, data, batch.chunk(size)[rank]).backward()
            optimizer.step()
        with torch.no_grad():
            part = torch.arange(rank, len(data), size)
            total = all_sum(loss_of(evaluated, data, part, "sum").reshape(1))
        loss = float(total) / len(data)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss:.5f}, engines {engines()}", flush=True)
    return loss


def with_ddp(args: argparse.Namespace, data: ClickData) -> tuple[int, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from train_ddp import mpi_rendezvous

    import ina_collectives.torch.distributed as ina_dist

    mpi_rendezvous()
    dist.init_process_group("ina")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(args)
    wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"{size} ranks, DDP on backend {dist.get_backend()}", flush=True)

    def all_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    loss = train_epochs(args, wrapped, optimizer, data, rank, size, all_sum,
                        lambda: ina_dist.stats()["engines"], model)
    dist.destroy_process_group()
    return rank, loss


def with_horovod(args: argparse.Namespace, data: ClickData) -> tuple[int, float]:
    import ina_collectives.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = make_model(args)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                         named_parameters=model.named_parameters())
    if rank == 0:
        print(f"{size} ranks, Horovod API, hot rows "
              f"{os.environ.get('INA_SPARSE_HOT_ROWS', '0')}", flush=True)

    def all_sum(t: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(t, op=hvd.Sum, name="eval_loss")

    loss = train_epochs(args, model, optimizer, data, rank, size, all_sum,
                        lambda: hvd.stats()["engines"], model)
    if rank == 0:
        for name, table in hvd.stats()["sparse"].items():
            print(f"sparse {name}: {table}", flush=True)
    hvd.shutdown()
    return rank, loss


def single_process(args: argparse.Namespace, data: ClickData) -> float:
    """The same training on one process: the same initial model and global batches (the
    ranks average their slices' mean losses: the batch's mean when the slices are equal)."""
    model = make_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(len(data), args.batch, epoch):
            optimizer.zero_grad()
            loss_of(model, data, batch).backward()
            optimizer.step()
    with torch.no_grad():
        return float(loss_of(model, data, torch.arange(len(data))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("ddp", "horovod"), default="ddp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--users", type=int, default=100_000, help="rows of the user table")
    parser.add_argument("--items", type=int, default=20_000, help="rows of the item table")
    parser.add_argument("--zipf", type=float, default=1.1,
                        help="exponent of the Zipf distributions users and items follow")
    parser.add_argument("--dense", type=int, default=8, help="dense features")
    parser.add_argument("--dim", type=int, default=32, help="embedding width")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="largest relative difference of the final loss from the "
                             "single-process run's")
    args = parser.parse_args()
    small = [name for name in ("epochs", "samples", "users", "items", "dense", "dim",
                               "hidden", "batch") if getattr(args, name) < 1]
    if small or not args.zipf > 0 or not args.lr > 0:
        parser.error(f"--{', --'.join(small) or 'zipf/lr'} must be positive")
    torch.set_num_threads(1)  # the ranks share the cores
    data = ClickData(args.samples, args.users, args.items, args.dense, args.zipf)
    rank, loss = (with_ddp if args.api == "ddp" else with_horovod)(args, data)
    return compare_losses(args, loss, single_process(args, data)) if rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
