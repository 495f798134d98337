"""What each rank of ``bench.cluster.training`` runs (in its namespace, under mpiexec):

    python -m bench.cluster.training_ranks CONFIG.json OUT.json

CONFIG holds the run: ``system`` (ina, ina16, ring, mpi: the Horovod API's
DistributedOptimizer, its allreduces served by the switch, the library's ring or MPI;
gloo: DistributedDataParallel on gloo; hook: the same with the INA hook,
torch/hooks.py; ddp-ina: DDP on backend "ina"), ``mode`` (fifo; priority: the first
layers' gradients first and each module updated at its next forward, Horovod API only),
``quorum`` (0: sync), ``scenario`` (none; transient: each step each rank waits an extra
``delay_ms`` with probability ``p``, from ``seed``; slow: the last rank computes
``delay_ms`` longer every step; late-packets: nothing here, the switch holds the last
rank's packets back ``delay_ms``), the model (``layers`` x ``width``, ``classes``,
``batch`` rows per rank), ``steps``, ``device_ms`` and ``lr``.

Compute is an accelerator's: each linear layer's forward is padded with a sleep to its
share of device_ms / 3 and its backward to its share of 2 device_ms / 3 (by parameters),
so the host's cores stay free for the network as they are under a GPU; the real forward
and backward of a small batch run inside the pads. Every rank trains on its slice of the
same generated global batches (a fixed random teacher labels Gaussian inputs), so every
system sees the same data. Rank 0 keeps its parameters after every ``eval_every`` steps
with the wall time, and after the run (outside the timed part) evaluates the loss of each
on a fixed held-out set; it writes those, every step's time, the bytes its allreduces
moved, the host's CPU use and a timeline of the last step (forward, backward, each
gradient's transfer, waits).
"""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

from bench.cluster.netsim_ranks import cpu_jiffies

HOROVOD = ("ina", "ina16", "ring", "mpi")
DDP = ("gloo", "hook", "ddp-ina")
WARMUP = 2


def make_model(cfg: dict[str, Any]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(cfg["layers"]):
        blocks += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    blocks.append(torch.nn.Linear(cfg["width"], cfg["classes"]))
    return torch.nn.Sequential(*blocks)


class Data:
    """Global batches of a teacher-labelled Gaussian data set: step s's rows for rank r."""

    def __init__(self, cfg: dict[str, Any], n: int):
        g = torch.Generator().manual_seed(1234)
        w = cfg["width"]
        self.teacher = (torch.randn(w, 64, generator=g) / w ** 0.5,
                        torch.randn(64, cfg["classes"], generator=g) / 8)
        self.cfg, self.n = cfg, n
        self.eval_x = torch.randn(1024, w, generator=g)
        self.eval_y = self.label(self.eval_x)

    def label(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.teacher
        return (torch.relu(x @ a) @ b).argmax(dim=1)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.cfg["batch"]
        g = torch.Generator().manual_seed(10_000 + step)
        x = torch.randn(self.n * b, self.cfg["width"], generator=g)[rank * b:(rank + 1) * b]
        return x, self.label(x)


class Device:
    """Pads each linear layer's forward and backward with a sleep to its share of the
    emulated device time, and records them (the timeline of the last step)."""

    def __init__(self, model: torch.nn.Sequential, device_ms: float):
        self.events: list[tuple[str, int, float, float]] = []
        self.recording = False
        self.t0 = 0.0
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        total = sum(p.numel() for m in linears for p in m.parameters())
        self._started: dict[tuple[str, int], float] = {}
        for i, m in enumerate(linears):
            share = sum(p.numel() for p in m.parameters()) / total * device_ms / 1e3
            m.register_forward_pre_hook(lambda m, a, i=i: self._begin("forward", i))
            m.register_forward_hook(
                lambda m, a, o, i=i, s=share / 3: self._pad("forward", i, s))
            m.register_full_backward_pre_hook(lambda m, g, i=i: self._begin("backward", i))
            m.register_full_backward_hook(
                lambda m, gi, go, i=i, s=2 * share / 3: self._pad("backward", i, s))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _begin(self, what: str, layer: int) -> None:
        self._started[(what, layer)] = time.perf_counter()

    def _pad(self, what: str, layer: int, seconds: float) -> None:
        start = self._started.pop((what, layer), time.perf_counter())
        left = start + seconds - time.perf_counter()
        if left > 0:
            time.sleep(left)
        if self.recording:
            self.events.append((what, layer, start - self.t0, self.now()))


def wait(device: Device, seconds: float, what: str = "straggler") -> None:
    if seconds > 0:
        start = device.now()
        time.sleep(seconds)
        if device.recording:
            device.events.append((what, -1, start, device.now()))


class Transfers:
    """Each gradient's transfer in the last step, from its submission to its result,
    polled every half millisecond by a thread of this program (Horovod API only)."""

    def __init__(self, device: Device, model: torch.nn.Module, opt: Any):
        self.device, self.opt = device, opt
        self.layer_of = {p: i // 2 for i, p in enumerate(model.parameters())}
        self.seen: dict[Any, tuple[int, float]] = {}
        self.stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        from ina_collectives.torch import mpi_ops
        while not self.stop.wait(0.0005):
            if not self.device.recording:
                continue
            try:
                started = dict(self.opt.in_flight())
            except RuntimeError:
                continue
            for p, handle in started.items():
                self.seen.setdefault(handle, (self.layer_of.get(p, -1), self.device.now()))
            for handle, (layer, begun) in list(self.seen.items()):
                if begun < 0:
                    continue
                try:
                    done = mpi_ops.poll(handle)
                except Exception:  # noqa: BLE001 - claimed already: done
                    done = True
                if done:
                    self.device.events.append(("transfer", layer, begun, self.device.now()))
                    self.seen[handle] = (layer, -1.0)


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    out = sys.argv[2]
    torch.set_num_threads(1)
    system, mode = cfg["system"], cfg["mode"]
    rank, n = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    model = make_model(cfg)
    device = Device(model, cfg["device_ms"])
    data = Data(cfg, n)
    sgd = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    transfers = None
    if system in HOROVOD:
        import ina_collectives.torch as hvd
        hvd.init()
        if cfg["quorum"]:
            hvd.set_quorum(cfg["quorum"])
        opt = hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(),
            overlap=model if mode == "priority" else None)
        transfers = Transfers(device, model, opt)
        trained, barrier = model, lambda: hvd.allreduce(torch.zeros(1), name="barrier")
        stats = hvd.stats
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import ina_collectives.torch.distributed as ina_dist
        backend = "ina" if system == "ddp-ina" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:29531",
                                rank=rank, world_size=n)
        trained = DistributedDataParallel(model)
        if system == "hook":
            from ina_collectives.torch.hooks import allreduce_hook
            trained.register_comm_hook(None, allreduce_hook)
        opt, barrier = sgd, dist.barrier
        stats = ina_dist.stats if system != "gloo" else (lambda: {})
    late_at = (late_steps(cfg["seed"], rank, cfg["steps"], cfg["p"])
               if cfg["scenario"] == "transient" else [])
    kept: list[tuple[float, int, torch.Tensor]] = []
    marks: list[float] = []
    steps = cfg["steps"]
    barrier()
    for step in range(WARMUP + steps):
        if step == WARMUP:
            barrier()
            device.t0 = start = time.perf_counter()
            cpu0 = cpu_jiffies()
        if step >= WARMUP:
            marks.append(time.perf_counter() - start)
        if step == WARMUP + steps - 1:
            device.t0, device.recording = time.perf_counter(), True
        late = 0.0
        if step >= WARMUP and late_at and late_at[step - WARMUP]:
            late = cfg["delay_ms"] / 1e3
        if step >= WARMUP and cfg["scenario"] == "slow" and rank == n - 1:
            late = cfg["delay_ms"] / 1e3
        wait(device, late)
        x, y = data.batch(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(trained(x), y)
        loss.backward()
        opt.step()
        done = step + 1 - WARMUP
        if rank == 0 and done > 0 and (done % cfg["eval_every"] == 0 or done == steps):
            if mode == "priority" and done == steps:
                opt.synchronize()  # (the last updates wait for a forward: apply them)
            kept.append((time.perf_counter() - start, done,
                         torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    if mode == "priority" and rank != 0:
        opt.synchronize()
    end = time.perf_counter() - start
    marks.append(end)
    cpu = cpu_jiffies()
    device.recording = False
    if transfers is not None:
        time.sleep(0.01)
        transfers.stop.set()
    record = stats()
    barrier()
    if rank == 0:
        losses = []
        with torch.no_grad():
            for seconds, done, flat in kept:
                torch.nn.utils.vector_to_parameters(flat, model.parameters())
                losses.append((done, seconds,
                               float(F.cross_entropy(model(data.eval_x), data.eval_y))))
        grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        with open(out, "w") as f:
            json.dump({**cfg, "n": n, "steps_timed": steps, "seconds": end,
                       "step_times": [b - a for a, b in zip(marks, marks[1:])],
                       "losses": losses, "grad_bytes": grad_bytes,
                       "cpu_utilisation": (cpu[0] - cpu0[0]) / max(1.0, cpu[1] - cpu0[1]),
                       "engines": record.get("engines", {system: steps}),
                       "reduced_bytes": record.get("bytes", 0),
                       "transport": record.get("transport", {}),
                       "tensors_without_some_rank": record.get("tensors without some rank", 0),
                       "timeline": device.events}, f)
    if system in HOROVOD:
        hvd.shutdown()
    else:
        dist.destroy_process_group()


def late_steps(seed: int, rank: int, steps: int, p: float) -> list[bool]:
    """Whether ``rank`` is late at each timed step of the transient scenario: one draw a
    step from the rank's own generator (bench.cluster.training reads the same draws for the
    ideal of the draws made)."""
    draw = random.Random(seed * 1000 + rank)
    return [draw.random() < p for _ in range(steps)]


if __name__ == "__main__":
    main()
