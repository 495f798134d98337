"""What each rank of ``bench.loopback.standby`` runs (under mpiexec, on loopback):

    python -m bench.loopback.standby_ranks CALLS COUNT KILL_PID KILL_AFTER OUT.json

CALLS allreduces of COUNT float32 each through the aggregators INA_SWITCH names; rank 0
SIGKILLs process KILL_PID (an aggregator; 0: none) KILL_AFTER seconds into the second
call. Rank 0 writes each call's time (the slowest rank's) and engine, and the switch's
counters (standby takeovers, partial handovers).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    calls, count, pid, after, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                     float(sys.argv[4]), sys.argv[5])
    import ina_collectives as ina
    comm = MPI.COMM_WORLD
    ina.init(comm)
    x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    times, engines = [], []
    for i in range(calls):
        comm.Barrier()
        if i == 1 and pid and comm.rank == 0:
            threading.Timer(after, os.kill, (pid, signal.SIGKILL)).start()
        start = time.perf_counter()
        ina.allreduce(x)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        engines.append(ina.stats()["last_call"]["engine"])
    switch = ina.stats()["switch"]
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "engines": engines,
                       "standby_takeovers": switch["standby_takeovers"],
                       "partial_handovers": switch["partial_handovers"]}, f)
    ina.finalize()


if __name__ == "__main__":
    main()
