"""Process groups of backend "ina" at 2-4 ranks in one process, a thread a rank.

``ProcessGroupIna(store, rank, size, timeout)`` takes its ranks' peers from
``distributed._communicator``: MPI's under a launcher, else gloo groups made from the
store (``TorchPeers``). ``thread_peers(monkeypatch)`` lets a ``ThreadPeers``
(tests/threadcomm.py) passed as the store be those peers as it is, for the test only;
any other store (a ``HashStore`` shared by the threads) still gets the library's own
gloo peers. Everything else (the runtime, its gates, the engines, the Work objects) is
the library's. ``on_groups(n, body)`` runs ``body(pg, rank)`` on n ranks, each with its
group, shut down after on every rank.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable

import pytest
import torch

from ina_collectives.torch import distributed
from tests.threadcomm import ThreadPeers, run_ranks


def thread_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ThreadPeers given as a group's store is its peers; no INA_* setting of the
    caller's environment (no switch: the exact engine, the peers' own allreduce)."""
    original = distributed._communicator

    def communicator(store: Any, rank: int, size: int, timeout: datetime.timedelta,
                     global_ranks: Any) -> Any:
        if isinstance(store, ThreadPeers):
            return store
        return original(store, rank, size, timeout, global_ranks)

    monkeypatch.setattr(distributed, "_communicator", communicator)
    for key in list(os.environ):
        if key.startswith("INA_"):
            monkeypatch.delenv(key)


def on_groups(n: int, body: Callable[[Any, int], Any], seconds: float = 5.0,
              store: Any = None, timeout: float = 60.0) -> list[Any]:
    """``body(pg, rank)`` on n ranks, each with a ProcessGroupIna whose timeout is
    ``seconds`` (peers: the thread's ThreadPeers, or gloo's over ``store`` if given);
    the results by rank."""
    def rank(comm: ThreadPeers) -> Any:
        pg = distributed.ProcessGroupIna(store if store is not None else comm,
                                         comm.Get_rank(), n,
                                         datetime.timedelta(seconds=seconds))
        try:
            return body(pg, comm.Get_rank())
        finally:
            pg.shutdown()
    return run_ranks(n, rank, timeout=timeout, kind=ThreadPeers)


def settled(future: torch.futures.Future, seconds: float = 10.0) -> Any:
    """A torch future's value, waiting at most ``seconds`` (AssertionError after)."""
    end = time.monotonic() + seconds
    while not future.done():
        if time.monotonic() > end:
            raise AssertionError(f"the future did not complete in {seconds:g} s")
        time.sleep(0.002)
    return future.value()
