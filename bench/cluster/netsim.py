"""INA against the ring, MPI and gloo on emulated, shaped links, in one run.

    python -m bench.cluster.netsim --quick           # n=4, one rate, 1 and 16 MiB, < 3 min
    python -m bench.cluster.netsim                   # the full sweep (hours)
    python -m bench.cluster.netsim --n 4 8 --rates 200 --sizes 16M 64M --loss 0 0.001 \
        --json r.json
    python -m bench.cluster.netsim --n 4 --rates 1000 --sizes 16M --systems ina --switches 2
    python -m bench.cluster.netsim --n 4 --rates 1000 --sizes 16M --systems ina --jobs 2
    python -m bench.cluster.netsim --aggregator bmv2 --n 2 --rates 100 --sizes 64K \
        --systems ina ring
    python -m bench.cluster.netsim --racks 2 --n 4 --rates 200 --uplink-ratio 4 \
        --sizes 16M                                   # a tree against the flat systems

Builds one namespace per worker and one for the switch (ina_collectives/testing/fabric.py), runs
each system as an mpiexec job whose ranks sit in the worker namespaces (so MPI, gloo, the
ring and INA all cross the same tbf-shaped veths), and writes one JSON record per
measurement, a table (netsim.md beside the JSON) and PNG plots. Needs root, iproute2 and
nftables (for loss). Everything it creates is removed on exit, after errors too.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mpi4py
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

mpi4py.rc.initialize = False  # the harness never communicates: only its ranks initialise MPI

from bench import RESULTS  # noqa: E402
from bench.cluster import netsim_report  # noqa: E402
from ina_collectives import protocol as P  # noqa: E402
from ina_collectives.launch.ranks import find_mpiexec  # noqa: E402
from ina_collectives.settings import parse_size  # noqa: E402
from ina_collectives.testing import bmv2  # noqa: E402
from ina_collectives.testing.fabric import (  # noqa: E402
    IFNAME,
    Fabric,
    aggregator_ip,
    worker_ip,
)
from ina_collectives.testing.jobs import child_env  # noqa: E402

# ina-quorum: ina in quorum mode, n - 1 of n (docs/quorum.md); ina-gate: ina with each
# call agreed by MPI instead of its opening through the switch (INA_INTERNAL_SWITCH_OPENING=0)
SYSTEMS = ("ina", "ina16", "ring", "mpi", "gloo", "ddp-ina", "ddp-gloo", "ina-quorum",
           "fsdp2-ina", "fsdp2-gloo", "sparse-ina", "sparse-exact", "sparse-gloo",
           "sparse-dense", "ina-gate", "ina-tree", "hier")
# Systems that time something else than one dense allreduce of SIZE bytes: a training
# step, an embedding gradient's exchange (their own tables).
TRAINING = ("ddp-", "fsdp2-", "sparse-")
VALUE_BITS = {"ina16": 16}  # the switch's value width per system (else 32)


def expected_seconds(system: str, n: int, nbytes: int, link_mbit: float) -> float:
    """The ideal time of one allreduce on these links (for the job's time limit)."""
    factor = ({"ina": 1.0, "ddp-ina": 1.0, "ina16": 0.5, "ina-quorum": 1.0,
               "ina-gate": 1.0, "ina-tree": 1.0}.get(system)
              or (4 if system.startswith("fsdp2-") else 2) * (n - 1) / n)
    return factor * nbytes * 8 / (link_mbit * 1e6)


def run_system(cluster: Fabric, switch: str, system: str, sizes: list[int],
               reps: int, mtu: int, workers: list[int] | None = None, jobs: int = 1,
               block: int = P.DEFAULT_BLOCK, straggler_ms: float = 0.0,
               straggler_delay_ms: float = 0.0, sparse: str = "",
               target: bmv2.OneArmedTarget | None = None, topology: str = "",
               slowest_mbit: float | None = None) -> tuple[list[dict[str, Any]], str]:
    """One mpiexec job measuring every size, its ranks in the namespaces of ``workers``
    (default all); (records, error or ''). ``jobs``: how many run at once (the limit)."""
    mpiexec = find_mpiexec()
    workers = list(range(cluster.n)) if workers is None else workers
    env = child_env(dict(**cluster.network_environment(workers[0]),
                         INA_SWITCH=switch,
                         INA_SWITCH_ELEMENTS=str(P.elements_for_mtu(
                             mtu, block, VALUE_BITS.get(system, 32))),
                         INA_SWITCH_BLOCK=str(block),
                         INA_SWITCH_VALUE_BITS=str(VALUE_BITS.get(system, 32)),
                         INA_BENCH_STRAGGLER_MS=str(straggler_ms),
                         INA_BENCH_SPARSE=sparse,
                         INA_TIMEOUT="120"), keep_settings=True)
    if system == "ina-tree":  # the ranks join their racks' leaves (--racks)
        env.update(INA_SWITCH="", INA_TOPOLOGY=topology)
    if system == "hier":
        env["INA_BENCH_RACK_SIZE"] = str(len(workers) // max(cluster.racks, 1))
    if system == "ina-quorum":
        env["INA_QUORUM"] = str(len(workers) - 1)
    if system == "ina-gate":
        env["INA_INTERNAL_SWITCH_OPENING"] = "0"
    if target is not None and system in ("ina", "ina16", "ina-gate", "ina-quorum"):
        # The P4 program on BMv2: the job installed by the controller, K of its build.
        env.update(target.install(workers, VALUE_BITS.get(system, 32),
                                  [worker_ip(w) for w in workers]))
    # Generous: 6x the ideal time per call (loss, a CPU-bound switch), plus start-up.
    # A packet held back D ms costs a window of S packets D ms in sync.
    window = 8 * P.packet_bytes(P.elements_for_mtu(mtu, block), block, 32)
    limit = 60 + jobs * sum(6 * (reps + 1) * (expected_seconds(
        system, len(workers), s, slowest_mbit or cluster.link_mbit) + straggler_ms / 1e3
        + s / window * straggler_delay_ms / 1e3)
        for s in sizes) * (1 + 50 * cluster.loss)
    if target is not None:  # BMv2 forwards a few thousand packets a second
        limit += (reps + 1) * sum(s / 256 for s in sizes) * len(workers) / 1000
    with tempfile.TemporaryDirectory(prefix="netsim-") as tmp:
        out = Path(tmp, "records.json")
        command = [sys.executable, "-m", "bench.cluster.netsim_ranks", system,
                   ",".join(map(str, sizes)), str(reps), str(out)]
        code, output = cluster.run_job(mpiexec, command, env, limit, workers=workers)
        if code is None:
            return [], f"timed out after {limit:.0f} s"
        if code != 0 or not out.exists():
            tail = "\n".join(output.strip().splitlines()[-40:])
            return [], f"exit {code}: {tail}"
        return json.loads(out.read_text()), ""


def run_jobs(cluster: Fabric, switch: str, system: str, args: argparse.Namespace,
             n: int) -> list[tuple[str | int, list[dict[str, Any]], str]]:
    """--jobs N: the first job alone, then N jobs of n ranks at once through the same
    switch; [(job: "alone" or its number, records, error)]."""
    alone = run_system(cluster, switch, system, args.sizes, args.reps, args.mtu,
                       list(range(n)), block=args.block, straggler_ms=args.straggler_ms)
    with ThreadPoolExecutor(args.jobs) as pool:
        together = list(pool.map(
            lambda j: run_system(cluster, switch, system, args.sizes, args.reps, args.mtu,
                                 list(range(j * n, (j + 1) * n)), args.jobs, args.block,
                                 args.straggler_ms),
            range(args.jobs)))
    return [("alone", *alone)] + [(j, *r) for j, r in enumerate(together)]


RACK_PORT = 47600  # the aggregators' UDP ports in a racks fabric: this + their index


def sweep_racks(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """--racks R: each n splits into R racks of n / R behind uplinks at link / ratio
    (testing/fabric.py), a spine aggregator (flat INA's, the tree's root) and one leaf
    per rack, every system in args.systems at each rate."""
    records: list[dict[str, Any]] = []
    for n in args.n:
        w = n // args.racks
        rate = args.rates[0]
        with Fabric(n, link_mbit=rate, mtu=args.mtu, aggregators=args.racks + 1,
                    racks=args.racks, uplink_mbit=rate / args.uplink_ratio) as cluster, \
                ExitStack() as switches, tempfile.TemporaryDirectory(prefix="racks-") as tmp:
            topology = Path(tmp, "tree.toml")
            text = (f'[[aggregator]]\nname = "spine"\n'
                    f'address = "{aggregator_ip(0)}:{RACK_PORT}"\n\n')
            for r in range(args.racks):
                text += (f'[[aggregator]]\nname = "rack{r}"\n'
                         f'address = "{aggregator_ip(r + 1)}:{RACK_PORT + r + 1}"\n'
                         f'parent = "spine"\nranks = {list(range(r * w, (r + 1) * w))}\n\n')
            topology.write_text(text)
            spine = switches.enter_context(cluster.switch_at(
                0, "--topology", str(topology), "--name", "spine", "--port", str(RACK_PORT)))
            for r in range(args.racks):
                switches.enter_context(cluster.switch_at(
                    r + 1, "--topology", str(topology), "--name", f"rack{r}", "--port",
                    str(RACK_PORT + r + 1)))
            for rate in args.rates:
                cluster.set_rate(rate)
                cluster.set_uplink_rate(rate / args.uplink_ratio)
                for system in args.systems:
                    console.print(f"racks {args.racks} x {w}, {rate:g} / "
                                  f"{rate / args.uplink_ratio:g} Mbit/s: {system}")
                    measured, error = run_system(
                        cluster, spine.address_text, system, args.sizes, args.reps,
                        args.mtu, list(range(n)), block=args.block, topology=str(topology),
                        slowest_mbit=rate / args.uplink_ratio / w)
                    if error:
                        console.print(f"[red]{system} racks {args.racks} x {w} failed: "
                                      f"{error}")
                    for m in measured:
                        records.append({
                            "system": system, "n": n, "racks": args.racks,
                            "bytes": m["bytes"], "link_mbit": rate,
                            "uplink_mbit": rate / args.uplink_ratio, "loss": 0.0,
                            "seconds": m["seconds"], "times": m["times"],
                            "engines": m["engines"],
                            "cpu_utilisation": round(m["cpu"], 3), "mtu": args.mtu,
                            "value_bits": 32, "block": args.block,
                            **{k: m[k] for k in ("packets", "tcp_retransmits",
                                                 "fallback_reasons") if k in m}})
                    if args.json:
                        write_json(args.json, records, args)
    return records


def sweep(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    combos = list(itertools.product(args.n, args.rates, args.loss))
    total = len(combos) * len(args.systems)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total} jobs"), TimeElapsedColumn(), console=console,
            transient=False) as progress:
        task = progress.add_task("netsim", total=total)
        for n in args.n:
            on_bmv2 = args.aggregator == "bmv2"
            with Fabric(n * args.jobs, link_mbit=args.rates[0], mtu=args.mtu,
                        aggregators=args.switches + on_bmv2) as cluster, \
                    ExitStack() as switches:
                # One ina-switch (one shard) per aggregator namespace; a job stripes
                # across all of them.
                # --straggler-delay-ms: each switch holds the last rank's packets back.
                late = (["--straggler-worker", str(n - 1), "--straggler-delay-ms",
                         str(args.straggler_delay_ms)] if args.straggler_delay_ms else [])
                target = None
                if on_bmv2:  # BMv2 on an aggregator namespace of its own, no ina-switch
                    target = switches.enter_context(bmv2.OneArmedTarget(
                        cluster, 1, IFNAME, aggregator_ip(1)))
                    address = target.address
                else:
                    address = ",".join(switches.enter_context(cluster.switch_at(
                        j, "--idle", "30", *late)).address_text for j in range(args.switches))
                if args.tcp_rto_min is not None:
                    cluster.set_tcp_rto_min(args.tcp_rto_min)
                for rate, loss in itertools.product(args.rates, args.loss):
                    cluster.set_rate(rate)
                    cluster.set_loss(loss)
                    for system in args.systems:
                        progress.update(task, description=(
                            f"n={n} {rate:g} Mbit/s loss {loss:g}: {system}"))
                        dropped0 = cluster.dropped() if loss else 0
                        if system.startswith("sparse-"):  # one job per workload
                            runs = [(None, *run_system(
                                cluster, address, system, [args.rows * args.dim * 4],
                                args.reps, args.mtu, list(range(n)), block=args.block,
                                sparse=f"{s},{lookups},{args.rows},{args.dim},"
                                       f"{args.hot_rows}"))
                                    for s in args.zipf for lookups in args.lookups]
                        elif args.jobs == 1:
                            runs = [(None, *run_system(cluster, address, system, args.sizes,
                                                       args.reps, args.mtu, list(range(n)),
                                                       block=args.block,
                                                       straggler_ms=args.straggler_ms,
                                                       straggler_delay_ms=(
                                                           args.straggler_delay_ms),
                                                       target=target))]
                        else:
                            runs = run_jobs(cluster, address, system, args, n)
                        for job, measured, error in runs:
                            if error:
                                console.print(f"[red]{system} n={n} {rate:g} Mbit/s loss "
                                              f"{loss:g}{'' if job is None else f' job {job}'}"
                                              f" failed: {error}")
                            for m in measured:
                                records.append({
                                    "system": system, "n": n, "bytes": m["bytes"],
                                    "link_mbit": rate, "loss": loss, "seconds": m["seconds"],
                                    "times": m["times"], "engines": m["engines"],
                                    "cpu_utilisation": round(m["cpu"], 3), "mtu": args.mtu,
                                    "value_bits": VALUE_BITS.get(system, 32),
                                    "block": args.block,
                                    "straggler_ms": args.straggler_ms,
                                    "straggler_delay_ms": args.straggler_delay_ms,
                                    "tcp_rto_min_ms": args.tcp_rto_min,
                                    "switches": args.switches, "jobs": args.jobs,
                                    "aggregator": args.aggregator,
                                    **({} if job is None else {"job": job}),
                                    "dropped_packets": (cluster.dropped() - dropped0
                                                        if loss else 0),
                                    **{k: m[k] for k in ("packets", "tcp_retransmits",
                                                         "stream_seconds", "compute_seconds",
                                                         "fallback_reasons", "zipf",
                                                         "lookups", "rows", "dim",
                                                         "hot_share",
                                                         "bytes_through_allreduce",
                                                         "bytes_gathered", "hot_ms",
                                                         "exact_ms", "trials_declined")
                                       if k in m}})
                        if target is not None and system.startswith("ina"):
                            # BMv2's own counters for the run: drops by reason, entries
                            console.print(f"BMv2 after {system} n={n}:\n"
                                          + target.counters().strip(),
                                          markup=False, highlight=False)
                        progress.advance(task)
                        if args.json:
                            write_json(args.json, records, args)  # partial results kept
    return records


def write_json(path: Path, records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.netsim",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="n=4, one link rate, 1 MiB and 16 MiB, no loss (< 3 min)")
    parser.add_argument("--n", type=int, nargs="+", help="workers (full: 2 4 8)")
    parser.add_argument("--rates", type=float, nargs="+",
                        help="link rates in Mbit/s (full: 100 200 500 1000 2000; quick: 200)")
    parser.add_argument("--sizes", nargs="+", help="bytes, e.g. 64K 16M (full: 64K..256M)")
    parser.add_argument("--loss", type=float, nargs="+",
                        help="loss probabilities per link (full: 0 0.001 0.01)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS[:5]), choices=SYSTEMS,
                        help="what to measure (default the allreduces: ina ina16 ring mpi "
                             "gloo); "
                             "ddp-ina and ddp-gloo time one DDP training step of SIZES bytes "
                             "of gradients on backend 'ina' or 'gloo', fsdp2-ina and "
                             "fsdp2-gloo one FSDP2 step; sparse-ina, sparse-exact, "
                             "sparse-gloo and sparse-dense one embedding gradient's exchange "
                             "(--zipf --lookups --rows --dim)")
    parser.add_argument("--reps", type=int, help="timed calls per size (median reported)")
    parser.add_argument("--mtu", type=int, default=9000, help="link MTU (K follows from it)")
    parser.add_argument("--tcp-rto-min", type=float, metavar="MS",
                        help="TCP's smallest retransmission timeout in the workers' "
                             "namespaces (default: the kernel's, 200 ms); applies to every "
                             "system's TCP (MPI, gloo, INA's agreements)")
    parser.add_argument("--block", type=int, default=P.DEFAULT_BLOCK, choices=P.BLOCK_SIZES,
                        help="B of the INA systems (values per exponent; K follows from it "
                             f"and the MTU; default {P.DEFAULT_BLOCK})")
    parser.add_argument("--straggler-ms", type=float, default=0.0, metavar="MS",
                        help="the last rank starts each call MS late (a straggler); every "
                             "system's time includes the wait it causes")
    parser.add_argument("--straggler-delay-ms", type=float, default=0.0, metavar="MS",
                        help="the switch holds each packet of the last rank back MS (a "
                             "straggler on a slow path; INA systems only: the others do not "
                             "pass the switch)")
    parser.add_argument("--switches", type=int, default=1, metavar="N",
                        help="aggregators, each an ina-switch in a namespace of its own on "
                             "the bridge; INA jobs stripe each call across all of them")
    parser.add_argument("--aggregator", choices=("software", "bmv2"), default="software",
                        help="the switch: the software switch (ina-switch, default) or the "
                             "P4 program on BMv2 (simple_switch_grpc; needs p4c and BMv2, "
                             "ina_collectives/testing/bmv2.py). BMv2 forwards a few "
                             "thousand packets a second: a check of results and packet "
                             "counts, not of speed")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="N jobs of n ranks at once through the same aggregator(s), "
                             "after the first job alone: per-job throughput and Jain's "
                             "fairness index (n x N worker namespaces)")
    parser.add_argument("--zipf", type=float, nargs="+", default=[1.2], metavar="S",
                        help="sparse systems: the Zipf exponents of the rows' popularity")
    parser.add_argument("--lookups", type=int, nargs="+", default=[16384], metavar="L",
                        help="sparse systems: rows each rank looks up per step")
    parser.add_argument("--rows", type=int, default=1_000_000, metavar="R",
                        help="sparse systems: the embedding table's rows")
    parser.add_argument("--dim", type=int, default=64, metavar="D",
                        help="sparse systems: the embedding table's columns (float32)")
    parser.add_argument("--hot-rows", type=int, default=4096, metavar="H",
                        help="sparse-ina: the most rows summed through the switch "
                             "(sparse_hot_rows)")
    parser.add_argument("--racks", type=int, default=0, metavar="R",
                        help="R racks of n / R workers, each behind one uplink to a spine "
                             "(a rack aggregator per rack, the spine's above them): the "
                             "systems ina-tree (the racks' aggregators under the spine's), "
                             "ina (flat: the spine's alone), ring, mpi, gloo and hier (the "
                             "hierarchical host allreduce, MPI's, without pipelining)")
    parser.add_argument("--uplink-ratio", type=float, default=4.0, metavar="X",
                        help="with --racks: a worker link's rate over an uplink's (4: "
                             "uplinks at a quarter of the link rate)")
    parser.add_argument("--json", type=Path, default=RESULTS / "netsim.json",
                        help="output records (the table and plots go beside it)")
    args = parser.parse_args(argv)
    if args.tcp_rto_min is not None and not 1 <= args.tcp_rto_min <= 200:
        parser.error(f"--tcp-rto-min must be 1..200 ms (the kernel's range of interest; its "
                     f"default is 200), got {args.tcp_rto_min:g}")
    quick = args.quick
    args.n = args.n or ([4] if quick else [2, 4, 8])
    args.rates = args.rates or ([200.0] if quick else [100.0, 200.0, 500.0, 1000.0, 2000.0])
    args.sizes = [parse_size(s) for s in (args.sizes or (
        ["1M", "16M"] if quick else ["64K", "256K", "1M", "4M", "16M", "64M", "256M"]))]
    args.loss = args.loss if args.loss is not None else ([0.0] if quick else [0.0, 0.001, 0.01])
    args.reps = args.reps or (3 if quick else 5)
    if any(s < 4 or s % 4 for s in args.sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32)")
    if any(n < 2 for n in args.n):
        parser.error("--n needs at least 2 workers")
    if any(r <= 0 for r in args.rates):
        parser.error("link rates must be positive")
    if any(not 0 <= p < 1 for p in args.loss):
        parser.error("loss must be in [0, 1) (a probability per link)")
    if not 576 <= args.mtu <= 65535:
        parser.error("--mtu must be 576..65535")
    if not 0 <= args.straggler_ms <= 60_000:
        parser.error("--straggler-ms must be 0..60000")
    if not 0 <= args.straggler_delay_ms <= 10_000:
        parser.error("--straggler-delay-ms must be 0..10000")
    if not 1 <= args.switches <= 50 or not 1 <= args.jobs or max(args.n) * args.jobs > 200:
        parser.error("--switches must be 1..50, --jobs 1 or more, n x jobs at most 200")
    if args.racks:
        given = argv if argv is not None else sys.argv[1:]
        if "--loss" not in given:
            args.loss = [0.0]
        if args.racks < 2 or any(n % args.racks or n // args.racks < 1 for n in args.n):
            parser.error("--racks needs at least 2 racks, and each --n a multiple of it")
        if args.aggregator != "software" or args.switches != 1 or args.jobs != 1 or any(
                p for p in args.loss):
            parser.error("--racks runs one job on the software switches, without loss "
                         "(no --aggregator bmv2, --switches, --jobs or --loss)")
        if not args.uplink_ratio > 0:
            parser.error("--uplink-ratio must be positive")
        if "--systems" not in given:
            args.systems = list(netsim_report.RACK_SYSTEMS)
        wrong = [s for s in args.systems if s not in netsim_report.RACK_SYSTEMS]
        if wrong:
            parser.error(f"--racks measures {', '.join(netsim_report.RACK_SYSTEMS)}, not "
                         f"{', '.join(wrong)}")
    elif "ina-tree" in args.systems or "hier" in args.systems:
        parser.error("ina-tree and hier need --racks")
    if args.aggregator == "bmv2":
        if args.switches != 1 or args.jobs != 1 or args.straggler_delay_ms:
            parser.error("--aggregator bmv2 runs one job through one BMv2 (no --switches, "
                         "--jobs or --straggler-delay-ms: those are the software switch's)")
        if bmv2.find_tools() is None:
            parser.error(f"--aggregator bmv2 {bmv2.missing_tools()}")
        if any(s.startswith(("ddp-ina", "fsdp2-ina", "sparse-ina")) for s in args.systems):
            parser.error("--aggregator bmv2 measures the allreduce systems (ina, ina16, "
                         "ina-gate, ina-quorum and the peers)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    # SIGTERM unwinds like Ctrl-C, so the namespaces and the switch are removed. Only in
    # this process: pyroute2's forked helpers inherit the handler and get SIGTERM to stop.
    harness = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != harness:
            os._exit(0)
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    if args.racks:
        records = sweep_racks(args, console)
        write_json(args.json, records, args)
        table = netsim_report.racks_table(records)
        (args.json.parent / (args.json.stem + ".md")).write_text(table + "\n")
        console.print(table, markup=False, highlight=False)
        console.print(f"{len(records)} records in {time.monotonic() - started:.0f} s: "
                      f"{args.json}")
        return 0 if records else 1
    records = sweep(args, console)
    write_json(args.json, records, args)
    single = [r for r in records if "job" not in r]
    table = "\n\n".join(filter(None, [
        netsim_report.table(plain) if (plain := [
            r for r in single if not r["system"].startswith(TRAINING)]) else "",
        netsim_report.ddp_table(single), netsim_report.ddp_table(single, "fsdp2"),
        netsim_report.sparse_table(single),
        netsim_report.jobs_table(records)]))
    (args.json.parent / (args.json.stem + ".md")).write_text(table + "\n")
    plots = netsim_report.plots([r for r in single if not r["system"].startswith(TRAINING)],
                                args.json.parent, args.json.stem)
    plots += netsim_report.sparse_plot(single, args.json.parent, args.json.stem)
    console.print(table, markup=False, highlight=False)
    console.print(f"{len(records)} records in {time.monotonic() - started:.0f} s: {args.json}; "
                  f"plots: {', '.join(str(p) for p in plots)}")
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
