"""Allreduce demo: 4 ranks reduce float32 arrays of growing size through the embedded
software switch; rank 0 prints time, algbw and busbw per size for the library's choice
(INA when the switch serves) beside the ring fallback, and the switch's status at the end.

    python examples/allreduce_demo.py --ranks 4     # starts the switch and the ranks
    INA_SWITCH=host:port mpiexec -n 4 python examples/allreduce_demo.py   # your own
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def launch(args: argparse.Namespace) -> int:
    from ina_collectives.launch.ranks import find_mpiexec
    from ina_collectives.switch.embedded import embedded_switch

    mpiexec = find_mpiexec()
    with embedded_switch() as switch:
        print(f"embedded ina-switch on {switch.address_text}", flush=True)
        env = dict(os.environ, INA_SWITCH=switch.address_text)
        code = subprocess.call([str(mpiexec), "-n", str(args.ranks), sys.executable,
                                __file__, "--max-mib", str(args.max_mib), "--repeats",
                                str(args.repeats)], env=env)
        switch.stop()
        print(switch.final_status)
    return code


def measure(run, repeats: int) -> float:
    from mpi4py import MPI

    run()  # warm-up
    times = []
    for _ in range(repeats):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    # The slowest rank's median is the collective's time.
    return MPI.COMM_WORLD.allreduce(float(np.median(times)), op=MPI.MAX)


def ranks(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    import ina_collectives as ina
    from ina_collectives.collectives import Collectives
    from ina_collectives.settings import Settings

    ina.init()
    ring = Collectives(MPI.COMM_WORLD, Settings.load({"ring_min_bytes": 0, "switch": ""}))
    n, rank = ina.size(), ina.rank()
    if rank == 0:
        print(f"allreduce (SUM, float32) on {n} ranks; switch: "
              f"{os.environ.get('INA_SWITCH') or 'none'}")
        print(f"{'size':>9} {'time ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10} "
              f"{'engine':>6} | {'ring ms':>8} {'speed-up':>8}")
    nbytes = 4 << 10
    while nbytes <= args.max_mib << 20:
        x = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        seconds = measure(lambda: ina.allreduce(x, out=out), args.repeats)
        if not (out == n * (n + 1) / 2).all():
            raise SystemExit(f"rank {rank}: wrong result for {nbytes} bytes")
        engine = ina.stats()["last_call"]["engine"]
        ring_seconds = measure(lambda: ring.allreduce(x, out=out), args.repeats)
        if rank == 0:
            algbw = nbytes / seconds / 1e9
            label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"{label:>9} {seconds * 1e3:9.3f} {algbw:10.3f} "
                  f"{algbw * 2 * (n - 1) / n:10.3f} {engine:>6} | {ring_seconds * 1e3:8.3f} "
                  f"{ring_seconds / seconds:7.2f}x", flush=True)
        nbytes *= 4
    if rank == 0:
        print("engines used:", ina.stats()["engines"])
        for reason, count in ina.stats()["fallback_reasons"].items():
            print(f"  passed over {count}x: {reason}")
    ring.free()
    ina.finalize()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=0,
                        help="start the embedded switch and this many ranks under mpiexec")
    parser.add_argument("--max-mib", type=int, default=64, help="largest array (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size")
    args = parser.parse_args()
    return launch(args) if args.ranks else ranks(args)


if __name__ == "__main__":
    sys.exit(main())
