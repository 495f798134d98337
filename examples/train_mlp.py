"""Training demo: ranks train an MLP with Horovod's API, their gradients summed in the
(software) switch, and end where one process training on the same data ends.

    ina-run -np 4 -- python examples/train_mlp.py --compare-ring   # what `make demo` runs
    ina-run -np 4 -- python examples/train_mlp.py      # checked against one process
    mpiexec -n 4 python examples/train_mlp.py          # ring only (no INA_SWITCH)
    ina-run -np 4 -- python examples/train_mlp.py --quorum 3   # a straggler left out
    ina-run -np 4 -- python examples/train_mlp.py --compute-delay-ms 50   # a slower worker

The data set is generated here (a fixed random teacher network labels Gaussian inputs),
so nothing is downloaded. Every epoch rank 0 prints the loss over the whole data set,
the gradient bytes reduced, how the reductions were served (INA or ring) and the
throughput of the allreduce waits. At the end rank 0 trains the same model on one
process with the same global batches and checks that the final losses agree within
--tolerance (exit code 1 if not), and prints ina_collectives.summary(). With --quorum K
the switch completes each chunk with K workers' gradients (docs/quorum.md): the
one-process loss is then shown, not required.

With --compare-ring the same ranks then train the same model again on the ring (no
switch: exact sums, as one process computes them), which stands in for the one-process
run; rank 0 ends with the summary of the switch's run, the time each run waited for its
gradients per step, and why one machine favours the ring.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import ina_collectives
import ina_collectives.torch as hvd


def make_data(samples: int, features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=g)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, classes))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        logits = teacher(x) + 0.5 * torch.randn(samples, classes, generator=g)
    return x, logits.argmax(dim=1)


def make_model(features: int, hidden: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


def global_batches(samples: int, batch: int, epoch: int) -> list[torch.Tensor]:
    """The epoch's global batches: the same on every rank and in the reference run."""
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
    return list(order[: samples // batch * batch].split(batch))


def distributed(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
                title: str | None = None) -> tuple[float, float]:
    """Train through hvd (a table by rank 0, under ``title`` if given): the final loss
    and the mean time a step waited for its gradients, in seconds."""
    rank, size = hvd.rank(), hvd.size()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must divide among {size} ranks")
    model = make_model(x.shape[1], args.hidden, int(y.max()) + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    slow = args.compute_delay_ms > 0 and rank == size - 1
    if rank == 0:
        if title is None:
            print(f"{size} ranks, {sum(p.numel() for p in model.parameters())} parameters "
                  f"({grad_bytes / 2**20:.1f} MiB of gradients per step), {x.shape[0]} "
                  f"samples, global batch {args.batch}", flush=True)
        else:
            print(title, flush=True)
        print(f"{'epoch':>5} {'loss':>8} {'seconds':>8} {'reduced MiB':>11} "
              f"{'wait ms/step':>12} {'MB/s':>8}  engines", flush=True)
    loss = full_loss(model, x, y, rank, size)
    if rank == 0:
        print(f"{0:>5} {loss:8.4f}", flush=True)
    waited_in_all = steps_in_all = 0
    for epoch in range(1, args.epochs + 1):
        start, waited, steps = time.perf_counter(), 0.0, 0
        before = hvd.stats()
        for batch in global_batches(x.shape[0], args.batch, epoch):
            mine = batch.chunk(size)[rank]
            optimizer.zero_grad()
            if slow:  # a worker whose every step computes longer (a slower device)
                time.sleep(args.compute_delay_ms / 1e3)
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            t = time.perf_counter()
            optimizer.synchronize()           # the allreduce waits not hidden by backward
            waited += time.perf_counter() - t
            with optimizer.skip_synchronize():
                optimizer.step()
            steps += 1
        seconds = time.perf_counter() - start
        waited_in_all, steps_in_all = waited_in_all + waited, steps_in_all + steps
        after = hvd.stats()
        engines = {e: n - before["engines"].get(e, 0) for e, n in after["engines"].items()
                   if n - before["engines"].get(e, 0)}
        reduced = after["bytes"] - before["bytes"]
        loss = full_loss(model, x, y, rank, size)
        if rank == 0:
            print(f"{epoch:>5} {loss:8.4f} {seconds:8.2f} {reduced / 2**20:11.1f} "
                  f"{waited / steps * 1e3:12.2f} {reduced / max(waited, 1e-9) / 1e6:8.1f}  "
                  f"{engines}", flush=True)
    return loss, waited_in_all / max(steps_in_all, 1)


def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int,
              size: int) -> float:
    """Mean cross-entropy over the whole data set, each rank evaluating its share."""
    with torch.no_grad():
        part = torch.arange(rank, x.shape[0], size)
        total = torch.nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum")
    return float(hvd.allreduce(total.reshape(1), op=hvd.Sum, name="eval_loss")) / x.shape[0]


def single_process(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> float:
    """The same training on one process: the same initial model and global batches."""
    model = make_model(x.shape[1], args.hidden, int(y.max()) + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(x.shape[0], args.batch, epoch):
            optimizer.zero_grad()
            # The ranks average their chunks' mean losses: the same as the batch mean
            # when the chunks are equal.
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def demo_arguments(doc: str, epochs: int, samples: int,
                   hidden: int) -> argparse.ArgumentParser:
    """The demo model's command line (this script's and examples/train_ddp.py's)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="largest relative difference of the final loss from the "
                             "single-process run's")
    return parser


def main() -> int:
    parser = demo_arguments(__doc__, epochs=5, samples=16384, hidden=1024)
    parser.add_argument("--quorum", type=int, default=0, metavar="K",
                        help="quorum mode: each chunk completes with K workers' gradients "
                             "(0: sync, every worker)")
    parser.add_argument("--compute-delay-ms", type=float, default=0.0, metavar="MS",
                        help="the last rank computes each step this much longer")
    parser.add_argument("--compare-ring", action="store_true",
                        help="then train again on the ring (no switch) and compare: the "
                             "losses (instead of one process's), the waits per step")
    args = parser.parse_args()
    if args.compute_delay_ms < 0:
        parser.error("--compute-delay-ms must be 0 or more")
    if args.compare_ring and args.quorum:
        parser.error("--compare-ring compares exact losses: leave out --quorum")
    torch.set_num_threads(1)  # the ranks share the cores
    hvd.init()
    if args.quorum:
        hvd.set_quorum(args.quorum)
    x, y = make_data(args.samples, args.features, 10)
    loss, waited = distributed(args, x, y)
    rank, size, one_host = hvd.rank(), hvd.size(), hvd.local_size() == hvd.size()
    summary = ina_collectives.summary()  # (this rank's: before shutdown ends the counters)
    served = hvd.stats()["engines"].get("ina", 0)
    hvd.shutdown()
    if not args.compare_ring:
        if rank != 0:
            return 0
        code = check_against_one_process(args, x, y, loss)
        print(f"Summary: {summary}", flush=True)
        return code
    # The same ranks, every call exact: the ring (or MPI, for the small ones).
    hvd.init(switch="", require_switch=False)
    ring_loss, ring_waited = distributed(args, x, y, "The same job on the ring (no switch):")
    hvd.shutdown()
    if rank != 0:
        return 0
    code = compare_losses(args, loss, ring_loss, "on the ring (exact sums)")
    print(f"Summary of the switch's run: {summary}", flush=True)
    if not served:  # (no switch served: nothing to compare)
        return code
    print(f"Waiting for the gradients, per step: {waited * 1e3:.1f} ms through the switch, "
          f"{ring_waited * 1e3:.1f} ms on the ring.", flush=True)
    if one_host:
        print(why_one_machine(size, ring_waited < waited), flush=True)
    return code


# Why one machine says little of INA (the README quotes it: tests/test_docs.py).
ONE_MACHINE = ("the switch's work competes with theirs, while the ring's doubled bytes "
               "are nearly free on loopback")


def why_one_machine(ranks: int, ring_faster: bool) -> str:
    """One line: which engine won on this machine, why one machine favours the ring, and
    where to see INA pay."""
    cores = len(os.sched_getaffinity(0))
    verdict = ("Why the ring wins here" if ring_faster
               else "The switch won here, though one machine favours the ring")
    return (f"{verdict}: this host's {cores} core(s) run the software switch and all "
            f"{ranks} ranks, so {ONE_MACHINE}. To see INA pay: python -m "
            f"bench.cluster.netsim --quick, as root (emulated, shaped links put the cores out of "
            f"the way).")


def check_against_one_process(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
                              loss: float) -> int:
    """Train on one process (single_process) and compare the final losses: the exit
    code, 0 when they agree within --tolerance."""
    return compare_losses(args, loss, single_process(args, x, y))


def compare_losses(args: argparse.Namespace, loss: float, reference: float,
                   what: str = "one process on the same data") -> int:
    """Print the final loss against one process's (or ``what`` gave ``reference``): the
    exit code, 0 when they agree within --tolerance (or when --quorum dropped gradients:
    then shown only)."""
    difference = abs(loss - reference) / reference
    verdict = "OK" if difference <= args.tolerance else "FAILED"
    if getattr(args, "quorum", 0):  # left-out gradients were dropped: not the same run
        verdict = f"shown only (quorum {args.quorum}: gradients left out were dropped)"
    print(f"final loss {loss:.5f}; {what}: {reference:.5f}; "
          f"relative difference {difference:.2e} (tolerance {args.tolerance:g}): {verdict}",
          flush=True)
    return 1 if verdict == "FAILED" else 0


if __name__ == "__main__":
    sys.exit(main())
