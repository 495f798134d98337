"""Synthetic training benchmark in the shape of Horovod's PyTorch one: img/sec of a
model trained on random data, its gradients averaged through ina_collectives.torch.

    ina-run -np 2 -- python examples/pytorch_synthetic_benchmark.py
    ina-run -np 2 -- python examples/pytorch_synthetic_benchmark.py --num-iters 10 \\
        --batch-size 32 --fp16-allreduce

No torchvision: the model is a small convnet for 32x32 images whose classifier holds
most of the parameters (about 2 MiB of gradients a step, above the switch's
switch_min_bytes, so the switch serves them). Rank 0 prints the throughput as
Horovod's does; then every rank prints its own line (rank, img/sec, the engines that
served its reductions), so a launcher's output shows that every rank finished.
"""
from __future__ import annotations

import argparse
import sys
import timeit

import torch
import torch.nn.functional as F

import ina_collectives.torch as hvd


def small_convnet(classes: int = 10, width: int = 16, hidden: int = 256) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(2 * width * 8 * 8, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="compress the gradients to float16 for the allreduce")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)  # the ranks share the cores

    model = small_convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: small_convnet ({sum(p.numel() for p in model.parameters())} parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)

    mean = sum(img_secs) / len(img_secs)
    spread = 1.96 * (sum((x - mean) ** 2 for x in img_secs) / len(img_secs)) ** 0.5
    log(f"Img/sec per CPU: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * spread:.1f}")
    # Every rank reports itself: the launcher's output shows which ones finished.
    print(f"rank {hvd.rank()} of {hvd.size()}: {mean:.1f} img/sec, engines "
          f"{hvd.stats()['engines']}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
