"""The Horovod API (``ina_collectives.torch``) at 2-4 ranks in one process, a thread a
rank over tests/threadcomm.py's ThreadPeers.

The library keeps one world per process (runtime/world.py's ``_world``) and the Horovod
module one table of handles (torch/handle_table.py's ``_handles``): right for a process a
rank, but threads of one process would share them. ``on_hvd`` gives each thread its own,
by replacing, for the test only, the world module's ``start``, ``stop``, ``current``,
``require`` and ``_registered`` with versions that keep the world per thread (``start``
opens it as the library's does: ``World.open`` on the communicator given to
``hvd.init``, then the sets given at init), and the handle table with one that keeps
handles per thread. Everything else (init's settings, the process sets, the names, the
negotiation, the runtime, the staging, the autograd Functions) is the library's own.
"""
from __future__ import annotations

import re
import threading
from typing import Any, Callable

import pytest

from ina_collectives.runtime import world as world_module
from ina_collectives.runtime.world import ProcessSet, World, global_process_set
from ina_collectives.settings import Settings
from ina_collectives.torch import handle_table
from tests.threadcomm import ThreadPeers, run_ranks

# No switch (the exact engine: the peers' own allreduce), a short stall bound, and a
# quick cycle, so that tests run in seconds.
SETTINGS = {"switch": "", "timeout": 5.0, "cycle_time": 0.001}


class _PerThread(threading.local):
    world: World | None = None

    def __init__(self) -> None:
        self.world = None
        self.handles: dict[int, Any] = {}


class _Handles(dict):
    """handle_table._handles, a table per thread (the subscript, pop and clear it uses)."""

    def __init__(self, local: _PerThread):
        super().__init__()
        self._local = local

    def __setitem__(self, key: Any, value: Any) -> None:
        self._local.handles[key] = value

    def __getitem__(self, key: Any) -> Any:
        return self._local.handles[key]

    def __contains__(self, key: object) -> bool:
        return key in self._local.handles

    def __len__(self) -> int:
        return len(self._local.handles)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._local.handles.pop(key, *default)

    def clear(self) -> None:
        self._local.handles.clear()


@pytest.fixture
def per_thread_world(monkeypatch: pytest.MonkeyPatch) -> _PerThread:
    """The world and the handle table per thread, for this test (see the module)."""
    local = _PerThread()
    assert world_module.current() is None, "a world is open in this process already"

    def start(comm: Any = None, process_sets: list[ProcessSet] | None = None,
              settings: Settings | None = None) -> None:
        if local.world is not None:
            return
        local.world = World.open(comm, settings or Settings.load())
        global_process_set.ranks = list(range(local.world.size))
        if process_sets:
            try:
                local.world.register_at_init(process_sets)
            except BaseException:
                stop()
                raise

    def stop() -> None:
        world, local.world = local.world, None
        if world is not None:
            world.close()

    library_require = world_module.require

    def require() -> World:
        if local.world is None:  # (no world in the process either: the library's error)
            return library_require()
        return local.world

    def registered(process_set: ProcessSet) -> Any:
        if local.world is None or process_set.process_set_id is None:
            return None
        return local.world.sets.get(process_set.process_set_id)

    # (start sets the global set's ranks, as the library's does: put them back after.)
    monkeypatch.setattr(global_process_set, "ranks", global_process_set.ranks)
    monkeypatch.setattr(world_module, "start", start)
    monkeypatch.setattr(world_module, "stop", stop)
    monkeypatch.setattr(world_module, "current", lambda: local.world)
    monkeypatch.setattr(world_module, "require", require)
    monkeypatch.setattr(world_module, "_registered", registered)
    monkeypatch.setattr(handle_table, "_handles", _Handles(local))
    return local


def on_hvd(n: int, body: Callable[[Any, int], Any], limit: float = 30.0,
           barrier: bool = True, **settings: Any) -> list[Any]:
    """``body(hvd, rank)`` on n ranks, each after ``hvd.init(comm, **SETTINGS,
    **settings)`` on its thread's communicator; ``hvd.shutdown()`` after, on every rank
    (after a barrier unless ``barrier`` is False: a test whose ranks part in error). Its
    results by rank; a rank that raises fails the test (tests.threadcomm.RankFailed).
    Needs the ``per_thread_world`` fixture."""
    import ina_collectives.torch as hvd

    assert isinstance(handle_table._handles, _Handles), "use the per_thread_world fixture"

    def rank(comm: Any) -> Any:
        hvd.init(comm, **{**SETTINGS, **settings})
        try:
            out = body(hvd, comm.Get_rank())
            if barrier:
                hvd.barrier()
            return out
        finally:
            hvd.shutdown()

    return run_ranks(n, rank, timeout=limit, kind=ThreadPeers)


def mismatch(message: str) -> tuple[str, dict[int, str]]:
    """A "Mismatched ... of KIND 'NAME': rank 0: A, rank 1: B" error as (its head, each
    rank's value by rank): the runtime lists the ranks in the order their requests
    reached it, which varies from run to run (and so from rank to rank)."""
    found = re.fullmatch(r"(Mismatched .*? '[^']*'): (.*)", message)
    assert found, message
    listed = re.findall(r"rank (\d+): (.+?)(?=, rank \d+: |$)", found.group(2))
    values = {int(r): v for r, v in listed}
    assert len(values) == len(listed), message
    return found.group(1), values


def attempt(call) -> tuple[str, str]:
    """(exception class name, message) of ``call()``, which must raise."""
    try:
        call()
    except Exception as exc:  # what the rank saw, compared by the main thread
        return type(exc).__name__, str(exc)
    return "nothing", "no exception"
