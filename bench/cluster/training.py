"""Training speed-up as users measure it: wall time to a target loss, on emulated links,
with compute as an accelerator's time, for every system, mode and straggler scenario.

    python -m bench.cluster.training                          # n 4, 200 Mbit/s, the defaults below
    python -m bench.cluster.training --rate 500 --width 1024 --device-ms 120
    python -m bench.cluster.training --systems ina ring --steps 20 --stragglers
    python -m bench.cluster.training --systems ina ring --overlap ina ring --stragglers
    python -m bench.cluster.training --systems ina --stragglers late-packets slow

On the emulated cluster (ina_collectives/testing/fabric.py: each rank in a namespace,
its link shaped to --rate, the software switch in a namespace of its own), each run trains the
same model from the same start on the same global batches (bench/cluster/training_ranks.py:
compute padded to --device-ms per step, a third forward, two thirds backward, so the
host's cores stay free as under a GPU). Runs:

- every system of --systems, sync, first-in-first-out (Horovod's loop; DDP's for gloo,
  hook and ddp-ina), no stragglers;
- each system of --overlap (default ina) with priority and overlap (the first layers'
  gradients first, each module updated at its next forward), against its own
  first-in-first-out run;
- ina sync against ina quorum n - 1 of n, per straggler scenario of --stragglers:
  ``transient`` (each step each rank waits an extra --delay-ms, default twice the device
  time, with probability --p); ``slow`` (the last rank always --delay-ms / 4 slower,
  late to every step: reported, no target; docs/quorum.md: a worker that is always
  slower sets every scheme's pace); ``late-packets`` (the switch holds each packet of the
  last rank back --packet-delay-ms: a straggler on a slow path, off by default). Quorum
  runs ahead of late ranks in the runtime (quorum_run_ahead), except for late packets,
  which the switch's quorum leaves out (INA_INTERNAL_QUORUM_RUN_AHEAD=0).

The measure: wall time until the held-out loss first reaches the target, the highest
final loss among the sync systems without stragglers (so each of them reaches it),
interpolated between the kept checkpoints. Beside each measured ratio: the ideal one from
the arithmetic (``ideal``: each layer's forward, backward and gradient on the wire at the
links' rate with its format's bytes, scheduled first-in-first-out or with priority and
overlap: step_seconds). The JSON, a table (training.md) and two PNGs
(loss against wall time; one step's timeline per mode) go to --out. The last lines:

    ina over best peer: N.NNx (ideal N.NNx)
    ina16 over best peer: N.NNx (ideal N.NNx)
    priority+overlap over fifo (ina): N.NNx (ideal N.NNx)
    quorum over sync, transient stragglers: N.NNx (ideal N.NNx)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import RESULTS
from ina_collectives import protocol as P
from ina_collectives.launch.ranks import find_mpiexec
from ina_collectives.testing.fabric import Fabric, aggregator_ip, in_namespace
from ina_collectives.testing.jobs import child_env

from .netsim_report import timeline_panel

SYSTEMS = ("ina", "ina16", "hook", "ddp-ina", "ring", "mpi", "gloo")
HOROVOD = ("ina", "ina16", "ring", "mpi")  # the Horovod API's: priority and overlap
PEERS = ("ring", "mpi", "gloo")
THROUGH_SWITCH = ("ina", "ina16", "hook", "ddp-ina")
DDP = ("gloo", "hook", "ddp-ina")


# -- the arithmetic ------------------------------------------------------------------------

def allreduce_seconds(system: str, n: int, grad_bytes: int, rate_mbit: float,
                      mtu: int) -> float:
    """The ideal time of one step's gradients on these links: the switch's format (each
    worker sends its gradients once and receives the sum once, headers and exponents
    included), or a ring's 2(n-1)/n of them each way."""
    if system in THROUGH_SWITCH:
        bits = 16 if system == "ina16" else 32
        k = P.elements_for_mtu(mtu, P.DEFAULT_BLOCK)
        values = grad_bytes // 4
        packets = -(-values // k)
        wire = packets * P.packet_bytes(k, P.DEFAULT_BLOCK, bits)
        return wire * 8 / (rate_mbit * 1e6)
    return 2 * (n - 1) / n * grad_bytes * 8 / (rate_mbit * 1e6)


def layer_shares(args: argparse.Namespace) -> list[float]:
    """Each linear layer's share of the parameters, the input's layer first."""
    sizes = [args.width * (args.width + 1)] * args.layers + [args.classes * (args.width + 1)]
    return [size / sum(sizes) for size in sizes]


def ddp_buckets(shares: list[float], grad_bytes: int) -> list[list[int]]:
    """DDP's buckets of these layers: from the last layer, the first up to 1 MiB, the
    others up to 25 MiB (torch's defaults); each a list of layer indices."""
    buckets: list[list[int]] = [[]]
    cap, held = 1 << 20, 0.0
    for i in reversed(range(len(shares))):
        size = shares[i] * grad_bytes
        if buckets[-1] and held + size > cap:
            buckets.append([])
            cap, held = 25 << 20, 0.0
        buckets[-1].append(i)
        held += size
    return buckets


def step_seconds(shares: list[float], device: float, allreduce: float, overlap: bool,
                 buckets: list[list[int]] | None = None, steps: int = 8) -> float:
    """The steady step time of a model whose layers hold ``shares`` of the parameters (and
    of the device time: forward a third, backward two thirds), each layer's gradient sent
    over one link once its backward is done (``allreduce``: all of them; ``buckets``:
    layers sent together, DDP's, once the last of them is done), the next step starting
    when every one is in (first-in-first-out), or, with ``overlap``, the first layers'
    gradients first and each layer's forward waiting for its own update only."""
    units = buckets or [[i] for i in range(len(shares))]
    fwd = [device / 3 * s for s in shares]
    bwd = [2 * device / 3 * s for s in shares]
    updated = [0.0] * len(shares)
    t = link = 0.0
    ends = []
    for _ in range(steps):
        for i, f in enumerate(fwd):
            t = max(t, updated[i]) + f
        done = {}
        for i in reversed(range(len(shares))):
            t += bwd[i]
            done[i] = t
        ready = {u: max(done[i] for i in unit) for u, unit in enumerate(units)}
        pending = set(ready)
        while pending:
            now = [u for u in pending if ready[u] <= link]
            if not now:
                link = min(ready[u] for u in pending)
                continue
            u = (min(now, key=lambda v: min(units[v])) if overlap
                 else min(now, key=lambda v: ready[v]))
            link += allreduce * sum(shares[i] for i in units[u])
            for i in units[u]:
                updated[i] = link
            pending.remove(u)
        if not overlap:
            t = max(t, link)
        ends.append(t)
    tail = ends[len(ends) // 2:]
    return (tail[-1] - tail[0]) / (len(tail) - 1)


def straggler_wait(n: int, p: float, delay: float, quorum: bool) -> float:
    """The expected extra wait per step: sync waits whenever any of the n ranks is late,
    D (1 - (1-p)^n); a quorum that leaves the late one out, about p D (its own lateness,
    and the spread of the lags, not modelled)."""
    return p * delay if quorum else delay * (1 - (1 - p) ** n)


@dataclasses.dataclass(frozen=True)
class Lateness:
    """The transient stragglers actually drawn over a run's timed steps: the steps with
    a late rank (sync waits D on each) and those with two or more (a quorum of n - 1
    waits on those alone, where the late rank takes the results completed without it
    and catches up on the communication the others wait for)."""

    steps: int
    any_late: int
    several_late: int
    late: tuple[tuple[bool, ...], ...] = ()  # by rank, by timed step

    @classmethod
    def drawn(cls, n: int, seed: int, steps: int, p: float) -> Lateness:
        from .training_ranks import late_steps
        late = [late_steps(seed, rank, steps, p) for rank in range(n)]
        per_step = [sum(ranks) for ranks in zip(*late)]
        return cls(steps, sum(k >= 1 for k in per_step), sum(k >= 2 for k in per_step),
                   tuple(map(tuple, late)))

    def catching_up(self, device: float, wire: float, delay: float, k: int) -> float:
        """Quorum k over sync, time for the timed steps, where a late rank still computes
        every step (the training loop's doing) and catches up only by the others'
        ``wire`` time a step, its calls run without it meanwhile: each step's calls run
        once k ranks have finished its backward (sync: all of them), and a rank starts
        its next step at its results or at its own backward's end, whichever is later.
        No grace, no staleness bound: an ideal."""
        def seconds(quorum: int) -> float:
            n = len(self.late)
            start = [0.0] * n
            for step in range(self.steps):
                done = [start[r] + device + delay * self.late[r][step] for r in range(n)]
                results = sorted(done)[quorum - 1] + wire
                start = [max(results, d) for d in done]
            return start[0]
        return seconds(len(self.late)) / seconds(k) if self.late else 1.0

    def ideal(self, step: float, delay: float) -> float:
        """Quorum n - 1 over sync, time for the timed steps, with these draws."""
        return ((self.steps * step + self.any_late * delay)
                / (self.steps * step + self.several_late * delay))


# -- running -------------------------------------------------------------------------------

def run(cluster: Fabric, switch: str, cfg: dict[str, Any],
        args: argparse.Namespace) -> dict[str, Any]:
    """One mpiexec job of bench.cluster.training_ranks; rank 0's record."""
    system = cfg["system"]
    k = P.elements_for_mtu(args.mtu, P.DEFAULT_BLOCK)
    env = child_env(dict(**cluster.network_environment(0),
                         INA_SWITCH=switch if system in THROUGH_SWITCH else "",
                         INA_SWITCH_ELEMENTS=str(k - k % P.DEFAULT_BLOCK),
                         INA_SWITCH_MIN_BYTES="0",
                         INA_RING_MIN_BYTES=str(1 << 40) if system == "mpi" else "0",
                         INA_PARTITION_BYTES=str(args.partition_bytes
                                                 or 4 * args.width * (args.width + 1)),
                         INA_ORDERING="priority" if cfg["mode"] == "priority" else "fifo",
                         INA_TIMEOUT="120"), keep_settings=True)
    if system == "ina16":
        env["INA_SWITCH_VALUE_BITS"] = "16"
    late = cfg["scenario"] == "late-packets"
    if late:  # (late packets: the switch's quorum leaves them out; the runtime's cannot)
        env["INA_INTERNAL_QUORUM_RUN_AHEAD"] = "0"
    with tempfile.TemporaryDirectory(prefix="training-") as tmp:
        config, out = Path(tmp, "config.json"), Path(tmp, "record.json")
        config.write_text(json.dumps(cfg))
        command = [sys.executable, "-m", "bench.cluster.training_ranks", str(config), str(out)]
        if late:  # the switch holds the last rank's packets back, for this run alone
            switch_faults(cluster, switch, straggler_worker=args.n - 1,
                          straggler_delay_ms=cfg["delay_ms"])
        try:
            return cluster.job_record(find_mpiexec(), command, env, args.limit, out,
                                      label(cfg))
        finally:
            if late:
                switch_faults(cluster, switch)


def switch_faults(cluster: Fabric, switch: str, **faults: float) -> None:
    """Set the fault injection of the switch at ``switch`` from the fabric's switch
    namespace (the switch takes them from its own address there); faults not named are
    cleared."""
    from ina_collectives.switch import send_faults

    host, port = switch.rsplit(":", 1)
    with in_namespace(cluster.switch_ns):
        send_faults((host, int(port)), **faults)


def label(rec: dict[str, Any]) -> str:
    parts = [rec["system"]]
    if rec["mode"] != "fifo":
        parts.append(rec["mode"])
    parts.append(f"quorum {rec['quorum']}" if rec["quorum"] else "sync")
    if rec["scenario"] != "none":
        parts.append(rec["scenario"])
    return " ".join(parts)


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"layers": args.layers, "width": args.width, "classes": args.classes,
            "batch": args.batch, "device_ms": args.device_ms, "lr": args.lr,
            "seed": args.seed, "p": args.p, "eval_every": args.eval_every,
            "mode": "fifo", "quorum": 0, "scenario": "none", "delay_ms": 0.0,
            "steps": args.steps}
    runs = [dict(base, system=s) for s in args.systems]
    runs += [dict(base, system=s, mode="priority") for s in args.overlap]
    if "ina" in args.systems:
        delay = args.delay_ms if args.delay_ms is not None else 2 * args.device_ms
        delays = {"transient": delay, "slow": delay / 4, "late-packets": args.packet_delay_ms}
        extra = dict(steps=args.steps + args.steps // 2)  # quorum may need more steps
        for scenario in args.stragglers:
            for quorum in (0, args.n - 1):
                runs.append(dict(base, system="ina", quorum=quorum, scenario=scenario,
                                 delay_ms=delays[scenario], **(extra if quorum else {})))
    return runs


# -- the measure ---------------------------------------------------------------------------

def time_to(rec: dict[str, Any], target: float) -> float | None:
    """When the held-out loss first reached ``target`` (linear between checkpoints)."""
    before = (0.0, None)
    for _, seconds, loss in rec["losses"]:
        if loss <= target:
            t0, l0 = before
            if l0 is None or l0 == loss:
                return seconds
            return t0 + (seconds - t0) * (l0 - target) / (l0 - loss)
        before = (seconds, loss)
    return None


def one_process_loss(args: argparse.Namespace) -> float:
    """The final held-out loss of one process trained on the same global batches."""
    import torch
    import torch.nn.functional as F

    from .training_ranks import WARMUP, Data, make_model
    cfg = {"layers": args.layers, "width": args.width, "classes": args.classes,
           "batch": args.batch * args.n}
    model = make_model(cfg)
    data = Data(cfg, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(WARMUP + args.steps):
        x, y = data.batch(step, 0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(model(data.eval_x), data.eval_y))


def median_step(rec: dict[str, Any]) -> float:
    return statistics.median(rec["step_times"])


def report(records: list[dict[str, Any]], args: argparse.Namespace,
           reference: float) -> tuple[list[str], list[str]]:
    """The table's rows (markdown) and the closing lines."""
    device = args.device_ms / 1e3
    grad_bytes = records[0]["grad_bytes"]
    shares = layer_shares(args)

    def ideal_allreduce(system: str) -> float:
        return allreduce_seconds(system, args.n, grad_bytes, args.rate, args.mtu)

    def ideal_step(system: str, overlap: bool = False) -> float:
        buckets = ddp_buckets(shares, grad_bytes) if system in DDP else None
        return step_seconds(shares, device, ideal_allreduce(system), overlap, buckets)

    sync_plain = [r for r in records if r["scenario"] == "none" and not r["quorum"]
                  and r["mode"] == "fifo"]
    target = max(r["losses"][-1][2] for r in sync_plain)
    rows = ["| run | median step ms | ideal step ms | final loss | vs one process | "
            "time to target s | CPU use | engines |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        r["label"] = label(r)
        r["time_to_target"] = time_to(r, target)
        ideal = ideal_step(r["system"], r["mode"] == "priority")
        final = r["losses"][-1][2]
        gap = (final - reference) / reference
        reached = (f"{r['time_to_target']:.2f}" if r["time_to_target"] is not None
                   else "not reached")
        rows.append(f"| {r['label']} | {median_step(r) * 1e3:.0f} | {ideal * 1e3:.0f} | "
                    f"{final:.4f} | {gap:+.2%} | {reached} | {r['cpu_utilisation']:.2f} | "
                    f"{r['engines']} |")
    rows.append("")
    rows.append(f"Target loss {target:.4f} (the highest final loss of the sync runs "
                f"without stragglers); one process on the same global batches: "
                f"{reference:.4f}. Gradients: {grad_bytes / 2**20:.2f} MiB per step.")

    def find(system: str, **match: Any) -> dict[str, Any] | None:
        want = {"mode": "fifo", "quorum": 0, "scenario": "none", **match}
        return next((r for r in records if r["system"] == system
                     and all(r[k] == v for k, v in want.items())), None)

    def ratio(slow: dict[str, Any] | None, fast: dict[str, Any] | None) -> str:
        if not slow or not fast or fast["time_to_target"] is None:
            return "n/a"
        if slow["time_to_target"] is None:
            return f"> {slow['seconds'] / fast['time_to_target']:.2f}x"
        return f"{slow['time_to_target'] / fast['time_to_target']:.2f}x"

    lines = []
    peers = [r for r in (find(s) for s in PEERS) if r and r["time_to_target"] is not None]
    best = min(peers, key=lambda r: r["time_to_target"]) if peers else None
    # (the best peer by the arithmetic: DDP's buckets make gloo's ideal the slowest)
    peer_step = min(ideal_step(s) for s in PEERS)
    hook, ddp_ina, gloo = find("hook"), find("ddp-ina"), find("gloo")
    if hook and ddp_ina:
        lines.append(f"hook on gloo over backend ina (DDP, per step): "
                     f"{median_step(ddp_ina) / median_step(hook):.2f}x")
    if hook and gloo:
        ideal = ideal_step("gloo") / ideal_step("hook")
        lines.append(f"hook over plain gloo DDP: {ratio(gloo, hook)} (ideal {ideal:.2f}x)")
    if best:
        lines.append(f"best peer: {best['system']}, {best['time_to_target']:.2f} s to the "
                     f"target")
    sync_t, quorum_t = (find("ina", scenario="transient", quorum=q)
                        for q in (0, args.n - 1))
    ina_step = ideal_step("ina")
    delay = (args.delay_ms if args.delay_ms is not None else 2 * args.device_ms) / 1e3
    if sync_t and quorum_t:
        mean = (statistics.mean(sync_t["step_times"])
                / statistics.mean(quorum_t["step_times"]))
        lines.append(f"quorum over sync, transient stragglers, per step: "
                     f"{median_step(sync_t) / median_step(quorum_t):.2f}x by the median, "
                     f"{mean:.2f}x by the mean")
    slow_s, slow_q = (find("ina", scenario="slow", quorum=q) for q in (0, args.n - 1))
    if slow_s and slow_q:
        lines.append(f"quorum over sync, one rank always slower (no target): "
                     f"{ratio(slow_s, slow_q)}")
    late_s, late_q = (find("ina", scenario="late-packets", quorum=q) for q in (0, args.n - 1))
    if late_s and late_q:
        lines.append(f"quorum over sync, the last rank's packets "
                     f"{args.packet_delay_ms:g} ms late: {ratio(late_s, late_q)}")
    for system in args.overlap:
        if system != "ina":  # (ina's is a closing line)
            ideal = ideal_step(system) / ideal_step(system, True)
            lines.append(f"priority+overlap over fifo ({system}): "
                         f"{ratio(find(system), find(system, mode='priority'))} "
                         f"(ideal {ideal:.2f}x)")
    # The closing lines, always these four in this order ("n/a": a run it needs did
    # not run, or did not reach the target).
    for system in ("ina", "ina16"):
        ideal = peer_step / ideal_step(system)
        lines.append(f"{system} over best peer: {ratio(best, find(system))} "
                     f"(ideal {ideal:.2f}x)")
    ideal = ina_step / ideal_step("ina", True)
    lines.append(f"priority+overlap over fifo (ina): "
                 f"{ratio(find('ina'), find('ina', mode='priority'))} (ideal {ideal:.2f}x)")
    expected = ((ina_step + straggler_wait(args.n, args.p, delay, False))
                / (ina_step + straggler_wait(args.n, args.p, delay, True)))
    drawn = Lateness.drawn(args.n, args.seed, args.steps, args.p)
    catching_up = drawn.catching_up(args.device_ms / 1e3, ina_step - args.device_ms / 1e3,
                                    delay, args.n - 1)
    lines.insert(len(lines) - 3, (
        f"transient stragglers drawn (seed {args.seed}): {drawn.any_late} of "
        f"{drawn.steps} timed steps have a late rank (expected "
        f"{1 - (1 - args.p) ** args.n:.0%}), {drawn.several_late} have two or more; "
        f"ideal {drawn.ideal(ina_step, delay):.2f}x for these draws, {expected:.2f}x "
        f"for the expected ones; {catching_up:.2f}x for these draws where a late rank "
        f"still computes each step it was late for"))
    lines.append(f"quorum over sync, transient stragglers: {ratio(sync_t, quorum_t)} "
                 f"(ideal {drawn.ideal(ina_step, delay):.2f}x)")
    return rows, lines


# -- plots ---------------------------------------------------------------------------------

def plot(records: list[dict[str, Any]], out: Path, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in records:
        seconds = [0.0] + [s for _, s, _ in r["losses"]]
        losses = [r["losses"][0][2]] + [loss for _, _, loss in r["losses"]]
        ax.plot(seconds[1:], losses[1:], marker=".", label=r["label"])
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("wall time, s")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-loss.png"), dpi=110)

    shown = [r for r in records if r["system"] == "ina" and r["scenario"] == "none"]
    shown += [r for r in records if r["scenario"] == "transient"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 2.4 * len(shown)), squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        timeline_panel(ax, r["timeline"], f"{r['label']}: the last step (rank 0), median "
                       f"step {median_step(r) * 1e3:.0f} ms")
    axes[-1, 0].set_xlabel("ms from the step's start (gaps: waiting for transfers)")
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-timeline.png"), dpi=110)


# -- the command ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.training",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="ranks (one namespace each)")
    parser.add_argument("--rate", type=float, default=200.0, help="link Mbit/s")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--layers", type=int, default=8, help="hidden layers")
    parser.add_argument("--width", type=int, default=362)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--device-ms", type=float, default=170.0,
                        help="emulated accelerator time per step (forward + backward)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=40, help="timed steps (after 2)")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--p", type=float, default=0.1,
                        help="transient stragglers: a rank's chance to be late each step")
    parser.add_argument("--delay-ms", type=float, default=None,
                        help="a transient straggler's extra wait (default 2x --device-ms)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--overlap", nargs="*", default=None, choices=HOROVOD,
                        help="the systems (of --systems) that also run with priority and "
                             "overlap (default ina, where it runs; none: --overlap alone)")
    parser.add_argument("--partition-bytes", type=int, default=0,
                        help="INA_PARTITION_BYTES (default: one hidden layer's parameters)")
    parser.add_argument("--stragglers", nargs="*", default=["transient", "slow"],
                        choices=["transient", "slow", "late-packets"],
                        help="the straggler scenarios ina runs in sync and quorum n - 1 "
                             "(none: --stragglers alone)")
    parser.add_argument("--packet-delay-ms", type=float, default=10.0,
                        help="late-packets: how long the switch holds each packet of the "
                             "last rank")
    parser.add_argument("--burst-bytes", type=int, default=None,
                        help="tbf's burst on every link (default: 1 ms at the rate, at "
                             "least 4 frames: an idle link banks that much time for the "
                             "next burst; a real link banks nothing, one frame comes "
                             "closest)")
    parser.add_argument("--tcp-rto-min", type=float, default=None, metavar="MS",
                        help="TCP's smallest retransmission timeout in the workers' "
                             "namespaces (default: the kernel's, 200 ms); the runtime's "
                             "negotiation rounds ride on TCP across the same links")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--out", type=Path, default=RESULTS / "training")
    parser.add_argument("--from-json", type=Path, default=None, metavar="JSON",
                        help="report an earlier run's records (its JSON) again, run nothing")
    args = parser.parse_args(argv)
    if args.n < 2 or min(args.layers, args.width, args.batch, args.steps,
                         args.eval_every) < 1 or args.device_ms < 0 or not 0 <= args.p <= 1:
        parser.error("--n must be 2 or more; --layers, --width, --batch, --steps, "
                     "--eval-every positive; --device-ms >= 0; --p in [0, 1]")
    if args.overlap is None:
        args.overlap = ["ina"] if "ina" in args.systems else []
    if not set(args.overlap) <= set(args.systems):
        parser.error(f"--overlap names systems that --systems does not run: "
                     f"{sorted(set(args.overlap) - set(args.systems))}")
    if not 0 <= args.packet_delay_ms <= 10_000 or args.partition_bytes < 0:
        parser.error("--packet-delay-ms must be in [0, 10000], --partition-bytes >= 0")
    if args.tcp_rto_min is not None and not 1 <= args.tcp_rto_min <= 200:
        parser.error(f"--tcp-rto-min must be 1..200 ms, got {args.tcp_rto_min:g}")
    if args.from_json is not None and not args.from_json.is_file():
        parser.error(f"--from-json: no file {args.from_json}")
    if os.geteuid() != 0 and args.from_json is None:
        parser.error("the emulated cluster needs root (network namespaces, tc)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.cluster.training " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        command = earlier["command"]
        vars(args).update({k: v for k, v in earlier["args"].items()
                           if k not in ("out", "from_json")})
        write(earlier["records"], args, command)
        return 0
    records = []
    with Fabric(args.n, link_mbit=args.rate, mtu=args.mtu,
                burst_bytes=args.burst_bytes) as cluster, ExitStack() as stack:
        # (fault settings from its own address: the late-packets runs set them from its
        # namespace, the workers cannot)
        switch = stack.enter_context(cluster.switch_at(
            0, "--idle", "60", "--faults-from", aggregator_ip(0))).address_text
        if args.tcp_rto_min is not None:
            cluster.set_tcp_rto_min(args.tcp_rto_min)
        for cfg in plan(args):
            rec = run(cluster, switch, cfg, args)
            records.append(rec)
            print(f"{label(rec):28s} median step {median_step(rec) * 1e3:7.1f} ms  "
                  f"{rec['seconds']:6.1f} s  final loss {rec['losses'][-1][2]:.4f}  "
                  f"CPU {rec['cpu_utilisation']:.2f}  engines {rec['engines']}", flush=True)
    write(records, args, command.strip())
    return 0


def write(records: list[dict[str, Any]], args: argparse.Namespace, command: str) -> None:
    """The report of ``records``: the JSON, the table, the plots and the closing lines."""
    reference = one_process_loss(args)
    rows, lines = report(records, args, reference)
    target = max(r["losses"][-1][2] for r in records
                 if r["scenario"] == "none" and not r["quorum"] and r["mode"] == "fifo")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command,
         "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "one_process_loss": reference, "records": records, "lines": lines}, indent=1))
    args.out.with_suffix(".md").write_text(
        f"`{command}`\n\n" + "\n".join(rows) + "\n\n" + "\n".join(lines) + "\n")
    plot(records, args.out, target)
    print("\n".join(rows))
    for line in lines:
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
