"""Allreduce time, algbw and busbw, 4 KiB .. 256 MiB: INA through the software switch,
the ring, MPI's own Allreduce, and the library's automatic choice, in one run.
Run with ``python -m bench.micro bench/micro/test_allreduce.py`` (it starts the switch).

algbw = bytes / time; busbw = algbw x 2(n-1)/n (the bytes each link carries in a ring).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives import Collectives
from ina_collectives.ina.engine import InaEngine
from ina_collectives.settings import Settings

RANKS = (4,)  # the rank counts python -m bench.micro runs it at

COMM = MPI.COMM_WORLD
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
         256 << 20]
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2,
                                reason="needs several ranks: python -m bench.micro "
                                       "bench/micro/test_allreduce.py")

_ring = Collectives(COMM, Settings.load({"ring_min_bytes": 0, "switch": ""}))
_auto = Collectives(COMM, Settings.load(), InaEngine)
_ina = Collectives(COMM, Settings.load({"switch_min_bytes": 0}), InaEngine)


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


def _rounds(nbytes: int) -> int:
    return int(min(100, max(5, (512 << 20) // nbytes // 8)))


@pytest.mark.parametrize("nbytes", SIZES, ids=_label)
@pytest.mark.parametrize("system", ["ina", "ring", "mpi", "auto"])
def test_allreduce(benchmark, system, nbytes):
    n = COMM.Get_size()
    send = np.ones(nbytes // 4, dtype=np.float32)
    recv = np.empty_like(send)
    run = {
        "ring": lambda: _ring.allreduce(send, out=recv),
        "ina": lambda: _ina.allreduce(send, out=recv),
        "auto": lambda: _auto.allreduce(send, out=recv),
        "mpi": lambda: COMM.Allreduce(send, recv),
    }[system]
    benchmark.group = f"allreduce-{_label(nbytes)}"
    COMM.Barrier()
    benchmark.pedantic(run, rounds=_rounds(nbytes), iterations=1, warmup_rounds=1)
    assert recv[0] == n and recv[-1] == n
    if system == "ina":
        assert _ina.stats.last["engine"] == "ina", _ina.stats.last
    if benchmark.stats is None:  # --benchmark-disable: run once, nothing measured
        return
    seconds = benchmark.stats.stats.median
    algbw = nbytes / seconds
    benchmark.extra_info.update(
        ranks=n, bytes=nbytes, algbw_GBps=algbw / 1e9, busbw_GBps=algbw * 2 * (n - 1) / n / 1e9,
        engines=dict(_auto.stats.by_engine) if system == "auto" else system)
