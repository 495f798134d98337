"""What each rank of ``bench.overlap`` runs (in its namespace, under mpiexec):

    python -m bench.overlap_ranks MODE STEPS OUT.json

MODE ``fifo``: Horovod's loop (DistributedOptimizer, step() waits for every gradient,
the runtime in submission order: INA_ORDERING=fifo, set by bench.overlap); ``priority``:
the same with ``overlap=model`` and the runtime's priority order (the first layers'
gradients first, each module updated at its next forward). The model: LAYERS linear
layers of WIDTH x WIDTH (INA_BENCH_LAYERS, INA_BENCH_WIDTH, INA_BENCH_BATCH), SGD with
momentum, each rank its own batches. Rank 0 writes the time of every step after the
warm-up, the final parameters' digest, and a timeline of the last step: each layer's
forward and backward, and each gradient's transfer from its submission (a gradient hook
after the optimizer's) to its result (polled every half millisecond by a thread of this
program, not by the library; a transfer of the step before starts at 0).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

import torch

from bench.netsim_ranks import cpu_jiffies

WARMUP = 2


def model_of(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


class Timeline:
    """Events of one step, in seconds from its start: (what, layer, start, end)."""

    def __init__(self, model: torch.nn.Module, opt: Any):
        self.model, self.opt, self.on = model, opt, False
        self.events: list[tuple[str, int, float, float]] = []
        self.t0 = 0.0
        self._open: dict[tuple[str, int], float] = {}
        self._transfers: dict[Any, tuple[int, float]] = {}
        self._stop = threading.Event()
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        self.layer_of = {p: i for i, m in enumerate(linears) for p in m.parameters()}
        for i, m in enumerate(linears):
            m.register_forward_pre_hook(lambda m, a, i=i: self._begin("forward", i))
            m.register_forward_hook(lambda m, a, o, i=i: self._end("forward", i))
            m.register_full_backward_pre_hook(lambda m, g, i=i: self._begin("backward", i))
            m.register_full_backward_hook(lambda m, gi, go, i=i: self._end("backward", i))
        # Registered after the optimizer's own hook, so it runs just after the gradient's
        # allreduce was submitted (or held back to be fused with the next).
        self._submitted: dict[torch.Tensor, float] = {}
        for p in self.layer_of:
            p.register_post_accumulate_grad_hook(self._submit)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def start(self) -> None:
        self.events, self._open, self._transfers, self._submitted = [], {}, {}, {}
        self.t0, self.on = time.perf_counter(), True

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _begin(self, what: str, layer: int) -> None:
        if self.on:
            self._open[(what, layer)] = self._now()

    def _end(self, what: str, layer: int) -> None:
        if self.on and (what, layer) in self._open:
            self.events.append((what, layer, self._open.pop((what, layer)), self._now()))

    def _submit(self, p: torch.Tensor) -> None:
        if self.on:
            self._submitted[p] = self._now()

    def _poll(self) -> None:
        from ina_collectives.torch import mpi_ops
        while not self._stop.wait(0.0005):
            if not self.on:
                continue
            try:  # (the training thread changes these dicts as it goes: retry)
                started = self.opt.in_flight()
            except RuntimeError:
                continue
            for p, handle in started.items():
                if handle not in self._transfers:
                    self._transfers[handle] = (self.layer_of.get(p, -1),
                                               self._submitted.get(p, self._now()))
            for handle, (layer, begun) in list(self._transfers.items()):
                if layer < 0 or begun < 0:
                    continue
                try:
                    done = mpi_ops.poll(handle)
                except Exception:  # noqa: BLE001 - synchronized (claimed) already: done
                    done = True
                if done:
                    self.events.append(("transfer", layer, begun, self._now()))
                    self._transfers[handle] = (layer, -1.0)

    def stop(self) -> None:
        self.on = False
        self._stop.set()


def main() -> None:
    mode, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    layers = int(os.environ.get("INA_BENCH_LAYERS", "12"))
    width = int(os.environ.get("INA_BENCH_WIDTH", "1024"))
    batch = int(os.environ.get("INA_BENCH_BATCH", "256"))
    torch.set_num_threads(1)
    import ina_collectives.torch as hvd
    hvd.init()
    rank = hvd.rank()
    model = model_of(layers, width)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   overlap=model if mode == "priority" else None)
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(4)]
    timeline = Timeline(model, opt)
    marks = []
    hvd.allreduce(torch.zeros(1), name="start")  # every rank ready
    cpu0 = cpu = cpu_jiffies()
    for step in range(WARMUP + steps):
        x, y = data[step % len(data)]
        if step >= WARMUP:
            marks.append(time.perf_counter())
        if step == WARMUP:
            cpu0 = cpu_jiffies()
        if step == WARMUP + steps - 1:
            timeline.start()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    # With overlap the last step's updates wait for a forward: apply them (and with
    # either mode, wait for every transfer), then stop the timeline.
    if mode == "priority":
        opt.synchronize()  # (fifo: step() waited already; synchronize would reduce again)
    marks.append(time.perf_counter())
    cpu = cpu_jiffies()
    time.sleep(0.01)
    timeline.stop()
    # A step's time: from its start to the next one's (the last: to every update applied).
    times = [b - a for a, b in zip(marks, marks[1:])]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    stats = hvd.stats()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "times": times, "digest": digest,
                       "loss": float(loss), "engines": stats["engines"],
                       "transport": {k: v for k, v in stats.get("transport", {}).items()
                                     if k in ("sent", "retransmitted", "result_requests",
                                              "nack_resent", "stale", "srtt", "rto")},
                       "cpu_utilisation": (cpu[0] - cpu0[0]) / max(1.0, cpu[1] - cpu0[1]),
                       "timeline": timeline.events, "layers": layers, "width": width,
                       "batch": batch}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
