"""A job striped across several aggregators against one (issue 18), in one run.

    python -m bench.loopback.striping [-n 2] [--mib 16] [--reps 20]
                                      [--json bench/results/striping.json]

n mpiexec ranks on loopback allreduce a float32 tensor ``--reps`` times through:
one ina-switch (one shard); two ina-switch processes (INA_SWITCH lists both); one
ina-switch with two shards (--threads 2). Each switch process is pinned to a core of its
own (taskset: the first on core 0, the second on core 1); the ranks run where the kernel
puts them, so the 2 cores of this machine carry the ranks and the switches together.
Reported: seconds per call (median), elements/s, and each as a multiple of one switch's.

``--switch-cpu F`` caps every aggregator at F of a core (a cgroup's CPU quota per switch
process; 2F for the process of two shards), so that the aggregators, not the ranks, are
the bottleneck: issue 18's case of a switch whose core limits the job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from bench import RESULTS
from ina_collectives.testing.jobs import child_env, mpiexec_line, run_group


def rank_main(mib: float, reps: int) -> None:
    """What each rank runs: warm-up, then ``reps`` timed calls; rank 0 prints JSON."""
    import numpy as np
    from mpi4py import MPI

    import ina_collectives as ina

    comm = MPI.COMM_WORLD
    ina.init(comm, switch_min_bytes=0)
    x = np.random.default_rng(comm.rank).standard_normal(int(mib * 2**18)).astype(np.float32)
    for _ in range(3):
        ina.allreduce(x)
    times = []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        ina.allreduce(x)
        times.append(time.perf_counter() - start)
    stats = ina.stats()
    ina.finalize()
    if comm.rank == 0:
        median = float(np.median(times))
        print(json.dumps({"seconds": median, "elements_per_s": x.size / median,
                          "engines": stats["engines"],
                          "aggregators": stats["switch"]["aggregators"]}), flush=True)


def measure(n: int, mib: float, reps: int, switch: str) -> dict:
    from ina_collectives.launch.ranks import find_mpiexec

    command = [sys.executable, "-m", "bench.loopback.striping", "--rank", "--mib", str(mib),
               "--reps", str(reps)]
    code, output = run_group(mpiexec_line(find_mpiexec(), command, n=n),
                             child_env({"INA_SWITCH": switch}), 600)
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        raise RuntimeError(f"the job failed ({'no result in 600 s' if code is None else code}):"
                           f" {output}")
    return json.loads(lines[-1])


@contextmanager
def cpu_quota(pid: int, cores: float, name: str) -> Iterator[None]:
    """Cap process ``pid`` (all its threads) at ``cores`` of a core with a cgroup of its
    own (v2 cpu.max, or v1 cpu.cfs_quota_us); removed afterwards."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    root = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
    group = root / f"inabench-{os.getpid()}-{name}"
    group.mkdir()
    try:
        period = 100_000
        if v2:
            (group / "cpu.max").write_text(f"{int(cores * period)} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        try:  # back to the root group (if still running), so that the group can go
            (root / "cgroup.procs").write_text(str(pid))
        except OSError:
            pass  # it ended: the group is empty
        group.rmdir()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--mib", type=float, default=16.0)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--switch-cpu", type=float, default=0.0, metavar="F",
                   help="cap each aggregator at F of a core (cgroup; needs root); 0: no cap")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=str(RESULTS / "striping.json"))
    args = p.parse_args()
    if not 0 <= args.switch_cpu <= len(os.sched_getaffinity(0)):
        p.error(f"--switch-cpu must be 0 (no cap) up to the {len(os.sched_getaffinity(0))} "
                f"cores here, got {args.switch_cpu:g}")
    if args.switch_cpu and os.geteuid() != 0:
        p.error("--switch-cpu needs root (it makes a cgroup per switch process)")
    if args.rank:
        rank_main(args.mib, args.reps)
        return 0
    from ina_collectives.switch.embedded import embedded_switch

    def pinned(core: int) -> list[str]:
        return ["taskset", "-c", str(core % os.cpu_count())]

    records, base = [], None
    setups = [("one switch", [(1, 0)]), ("two switches", [(1, 0), (1, 1)]),
              ("one switch, 2 shards", [(2, None)])]
    for name, switches in setups:
        with ExitStack() as stack:
            started = [stack.enter_context(embedded_switch(
                threads=threads, launcher=pinned(core) if core is not None else ()))
                for threads, core in switches]
            if args.switch_cpu:
                for j, (sw, (threads, _)) in enumerate(zip(started, switches)):
                    stack.enter_context(cpu_quota(sw.pid, args.switch_cpu * threads,
                                                  f"{len(records)}-{j}"))
            r = measure(args.n, args.mib, args.reps,
                        ",".join(sw.address_text for sw in started))
        base = base or r["elements_per_s"]
        r.update(setup=name, n=args.n, mib=args.mib, switch_cpu=args.switch_cpu,
                 of_one_switch=r["elements_per_s"] / base)
        records.append(r)
        shares = ", ".join(f"{a['share']:.2f}" for a in r["aggregators"])
        print(f"{name:>22}: {r['seconds'] * 1e3:7.1f} ms per {args.mib:g} MiB call, "
              f"{r['elements_per_s'] / 1e6:6.1f} M elements/s = {r['of_one_switch']:.2f}x "
              f"one switch (shares {shares}; engines {r['engines']})", flush=True)
    RESULTS.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(records, indent=1))
    print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
