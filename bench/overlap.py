"""Transfers in the order training needs them, with the next forward overlapping the
last ones (issue 34, MLfabric; P3, ByteScheduler): step time against first-in-first-out.

    python -m bench.overlap                 # n 4, 1 Gbit/s links, 12 layers of 1024 x 1024
    python -m bench.overlap --steps 6 --systems ina

On the emulated cluster (bench/netsim_topology.py: each rank in a namespace, links shaped
to --rate), each system (ina: through the software switch in the switch's namespace;
ring: the library's ring over MPI, no switch) trains the same model twice from the same
start: ``fifo`` (Horovod's loop: step() waits for every gradient, the runtime in
submission order) and ``priority`` (DistributedOptimizer(overlap=model): the first
layers' gradients first, each module updated at its next forward). Partitions of one
layer (--partition-bytes) in both. Prints each mode's median step time and whether the
final parameters are bit for bit the same, and as its last line
``priority N.NNx faster than fifo (ina)``. The JSON and a timeline PNG of one step of
each (every layer's forward, backward and gradient transfer) go to bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ina_collectives import protocol as P
from ina_collectives.launch.ranks import find_mpiexec

from .netsim_report import timeline_panel
from .netsim_topology import EmulatedCluster, remove_stale_namespaces

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("fifo", "priority")


def run_mode(cluster: EmulatedCluster, switch: str, system: str, mode: str,
             args: argparse.Namespace) -> dict[str, Any]:
    """One mpiexec job: the model trained --steps steps in ``mode``; rank 0's record."""
    block = P.DEFAULT_BLOCK
    k = P.elements_for_mtu(args.mtu, block)
    env = dict(os.environ, **cluster.network_environment(0),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])),
               INA_SWITCH=switch if system == "ina" else "",
               # K a multiple of B: a float's result then does not depend on where the
               # fusion buffer puts it, so both modes reduce to the same bits.
               INA_SWITCH_ELEMENTS=str(k - k % block),
               INA_SWITCH_MIN_BYTES="0", INA_RING_MIN_BYTES="0",
               INA_PARTITION_BYTES=str(args.partition_bytes or 4 * args.width ** 2),
               INA_ORDERING="fifo" if mode == "fifo" else "priority",
               INA_BENCH_LAYERS=str(args.layers), INA_BENCH_WIDTH=str(args.width),
               INA_BENCH_BATCH=str(args.batch), INA_TIMEOUT="120")
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        out = Path(tmp, "record.json")
        command = [sys.executable, "-m", "bench.overlap_ranks", mode, str(args.steps),
                   str(out)]
        return {"system": system, **cluster.job_record(
            find_mpiexec(), command, env, args.limit, ROOT, out, f"{system} {mode}")}


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per system and mode: each layer's forward, backward and transfer in the
    last step, against time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(11, 2.6 * len(records)),
                             squeeze=False)
    for ax, rec in zip(axes[:, 0], records):
        timeline_panel(ax, rec["timeline"], f"{rec['system']} {rec['mode']}: median step "
                       f"{statistics.median(rec['times']) * 1e3:.0f} ms")
    axes[-1, 0].set_xlabel("ms from the step's start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rate", type=float, default=1000.0, help="link Mbit/s")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2)")
    parser.add_argument("--partition-bytes", type=int, default=0,
                        help="INA_PARTITION_BYTES (default: one layer's weights)")
    parser.add_argument("--systems", nargs="+", default=["ina", "ring"],
                        choices=["ina", "ring"])
    parser.add_argument("--tcp-rto-min", type=float, default=None, metavar="MS",
                        help="TCP's smallest retransmission timeout in the workers' "
                             "namespaces (default: the kernel's, 200 ms); the runtime's "
                             "negotiation rounds ride on TCP across the same links")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "overlap")
    args = parser.parse_args(argv)
    if args.n < 2 or args.layers < 1 or args.width < 1 or args.batch < 1 or args.steps < 1:
        parser.error("--n must be 2 or more; --layers, --width, --batch, --steps positive")
    if os.geteuid() != 0:
        parser.error("the emulated cluster needs root (network namespaces, tc)")
    remove_stale_namespaces()
    records = []
    with EmulatedCluster(args.n, args.rate, mtu=args.mtu) as cluster, ExitStack() as stack:
        switch = stack.enter_context(cluster.switch_at(0, "--idle", "60")).address_text
        if args.tcp_rto_min is not None:
            cluster.set_tcp_rto_min(args.tcp_rto_min)
        for system in args.systems:
            for mode in MODES:
                rec = run_mode(cluster, switch, system, mode, args)
                records.append(rec)
                print(f"{system:5s} {mode:8s} median step "
                      f"{statistics.median(rec['times']) * 1e3:8.1f} ms  "
                      f"(steps {', '.join(f'{t * 1e3:.0f}' for t in rec['times'])}) "
                      f"CPU {rec['cpu_utilisation']:.2f} engines {rec['engines']} "
                      f"{rec['transport']}",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "records": records}, indent=1))
    plot(records, args.out.with_suffix(".png"))
    ratios = {}
    for system in args.systems:
        fifo, prio = (next(r for r in records if r["system"] == system and r["mode"] == m)
                      for m in MODES)
        same = "the same" if fifo["digest"] == prio["digest"] else "different"
        print(f"{system}: final parameters {same} bit for bit")
        ratios[system] = statistics.median(fifo["times"]) / statistics.median(prio["times"])
    # The line the issue reads comes last: ina's, where it ran.
    for system in sorted(ratios, key=lambda s: s == "ina"):
        print(f"priority {ratios[system]:.2f}x faster than fifo ({system})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
