"""MNIST-style training in the shape of Horovod's PyTorch MNIST example, on generated
28x28 images (nothing is downloaded), with checkpoint and resume.

    ina-run -np 2 -- python examples/pytorch_mnist_synthetic.py
    ina-run -np 2 -- python examples/pytorch_mnist_synthetic.py --checkpoint-dir ckpt
    ina-run -np 2 -- python examples/pytorch_mnist_synthetic.py --checkpoint-dir ckpt \\
        --resume --epochs 3                 # goes on from the last epoch saved there
    python examples/pytorch_mnist_synthetic.py --batch-size 64 --lr 0.1  # one process

Each rank trains on its shard of every epoch's shuffle (as torch's DistributedSampler
cuts it: indices rank, rank + size, ...), with --batch-size images a step and the
learning rate scaled by hvd.size(), as in Horovod's examples; so 2 ranks at batch B
and --lr L take the same steps as one process at batch 2B and --lr 2L (the tests check
it). Rank 0 saves the model and optimizer after every epoch; --resume loads the newest
checkpoint on rank 0 alone and broadcasts it. --save-final writes the final parameters
(rank 0); every rank prints a digest of its own.

The model's gradients (85 KiB a step) are below the switch's switch_min_bytes (128
KiB): give INA_SWITCH_MIN_BYTES=0 for them to go through the switch (the tests do).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import ina_collectives.torch as hvd


class Net(torch.nn.Module):
    """The classic MNIST convnet, without dropout: the runs must be deterministic to
    compare the ranks with one process."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = torch.nn.Linear(320, 50)
        self.fc2 = torch.nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of noise around a per-class template, so the classes can be learnt."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = templates[labels] + 0.5 * torch.randn(samples, 1, 28, 28, generator=g)
    return (images - 0.5) / 0.5, labels


def shard(samples: int, rank: int, size: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's indices of the epoch, as DistributedSampler(shuffle=True) picks them:
    one shuffle for all ranks (seed + epoch), cut to a multiple of size, every size-th."""
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order[: samples // size * size][rank::size]


def metric_average(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor(value), name=name))  # Average by default


def checkpoint_path(folder: str, epoch: int) -> str:
    return os.path.join(folder, f"checkpoint-{epoch}.pt")


def newest_checkpoint(folder: str, epochs: int) -> int:
    """The last epoch saved in ``folder`` (0: none)."""
    return max((e for e in range(1, epochs + 1) if os.path.exists(checkpoint_path(folder, e))),
               default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank a step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05, help="per rank: scaled by size")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--checkpoint-dir", help="rank 0 saves each epoch here")
    parser.add_argument("--resume", action="store_true",
                        help="go on from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--save-final", help="rank 0 saves the final state_dict here")
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the ranks share the cores

    images, labels = synthetic_mnist(args.samples, args.seed)
    model = Net()
    # Horovod's rule: the learning rate grows with the number of ranks (the global batch).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)

    # Rank 0 alone finds and loads the checkpoint; the broadcasts give it to the others.
    resume_from = 0
    if args.resume and hvd.rank() == 0:
        resume_from = newest_checkpoint(args.checkpoint_dir, args.epochs)
    resume_from = hvd.broadcast_object(resume_from, root_rank=0, name="resume_from_epoch")
    if resume_from and hvd.rank() == 0:
        state = torch.load(checkpoint_path(args.checkpoint_dir, resume_from))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    for epoch in range(resume_from + 1, args.epochs + 1):
        model.train()
        mine = shard(args.samples, hvd.rank(), hvd.size(), epoch, args.seed)
        for batch in mine.split(args.batch_size):
            optimizer.zero_grad()
            F.nll_loss(model(images[batch]), labels[batch]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            output = model(images[mine])
            loss = float(F.nll_loss(output, labels[mine]))
            accuracy = float((output.argmax(1) == labels[mine]).float().mean())
        loss = metric_average(loss, "avg_loss")
        accuracy = metric_average(accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.6f} accuracy {accuracy:.4f}", flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           checkpoint_path(args.checkpoint_dir, epoch))

    # Every rank reports its own model (the same on all when the broadcasts and the
    # averaging worked) and the engines that served its reductions.
    digest = sum(float(p.double().sum()) for p in model.state_dict().values())
    if hvd.rank() == 0:
        print(f"resumed from epoch {resume_from}" if resume_from else "started fresh")
        if args.save_final:
            torch.save(model.state_dict(), args.save_final)
    print(f"rank {hvd.rank()} of {hvd.size()}: parameters digest {digest!r}, engines "
          f"{hvd.stats()['engines']}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
