"""Allreduce demo: every rank reduces float32 arrays of growing size and rank 0 prints
time, algbw and busbw per size, with the engine that served the calls.

    mpiexec -n 4 python examples/allreduce_demo.py [--max-mib 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ina_collectives as ina


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=64, help="largest array (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size")
    args = parser.parse_args()

    ina.init()
    n, rank = ina.size(), ina.rank()
    if rank == 0:
        print(f"allreduce (SUM, float32) on {n} ranks")
        print(f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}  engine")
    nbytes = 4 << 10
    while nbytes <= args.max_mib << 20:
        x = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        ina.allreduce(x, out=out)  # warm-up: buffers, connections
        times = []
        for _ in range(args.repeats):
            MPI.COMM_WORLD.Barrier()
            start = time.perf_counter()
            ina.allreduce(x, out=out)
            times.append(time.perf_counter() - start)
        expected = n * (n + 1) / 2
        if not (out == expected).all():
            raise SystemExit(f"rank {rank}: wrong result for {nbytes} bytes")
        # The slowest rank's median is the collective's time.
        seconds = MPI.COMM_WORLD.allreduce(float(np.median(times)), op=MPI.MAX)
        if rank == 0:
            algbw = nbytes / seconds / 1e9
            label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"{label:>10} {seconds * 1e3:10.3f} {algbw:11.3f} "
                  f"{algbw * 2 * (n - 1) / n:11.3f}  {ina.stats()['last_call']['engine']}",
                  flush=True)
        nbytes *= 4
    if rank == 0:
        print("engines used:", ina.stats()["engines"])
    ina.finalize()


if __name__ == "__main__":
    main()
