"""The INA engine's faults at 2 ranks in one process, through the chooser as an API
builds it (collectives.Collectives with ina.InaEngine, over tests/threadcomm.py's
ThreadPeers; its exact engine is then the peers' own allreduce, "gloo") and a software
switch in a thread: a switch that dies after one rank returned a call without a vote
(the other lost its last results: it completes the call from the first one's kept
window, in the rescue's FAILED role, and the next call takes the exact engine), and a
rank that stops (the other ends within its bound, with an error that says what it
waited for). The whole-process forms of both are tests/integration/test_ina.py's."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

from ina_collectives.collectives.chooser import Collectives
from ina_collectives.errors import InaError
from ina_collectives.ina.engine import InaEngine
from ina_collectives.settings import Settings
from ina_collectives.switch.server import SoftwareSwitch
from tests.threadcomm import ThreadPeers, run_ranks

COUNT = 1000  # one chunk: the whole call is its last window


@contextmanager
def mortal_switch() -> Iterator[SoftwareSwitch]:
    """A software switch serving in a thread, which a test may stop (``kill``) midway."""
    sw = SoftwareSwitch("127.0.0.1", 0)
    thread = threading.Thread(target=sw.serve, name="switch", daemon=True)
    thread.start()

    def kill() -> None:
        sw.stop()
        thread.join(5)
        assert not thread.is_alive(), "the switch did not stop"
    sw.kill = kill  # type: ignore[attr-defined]
    try:
        yield sw
    finally:
        sw.stop()
        thread.join(5)


def deaf_from_the_next_stream(engine: InaEngine) -> None:
    """From the link's next stream on, results no longer reach its socket (it takes
    datagrams from a dead address only); the call's opening still gets through."""
    link = engine.link
    plain = link.stream

    def deaf_stream(*args, **kwargs):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dead:
            dead.bind(("127.0.0.1", 0))
            link.sock.connect(dead.getsockname())
        return plain(*args, **kwargs)
    link.stream = deaf_stream


def settings_for(sw: SoftwareSwitch, **more) -> Settings:
    return Settings(**{"switch": "%s:%d" % sw.address, "switch_min_bytes": 0,
                       "switch_silence": 0.5, "timeout": 10.0, **more})


@pytest.mark.parametrize("predicted", [False, True], ids=["opened", "predicted"])
def test_a_switch_that_dies_after_one_rank_returned_leaves_every_rank_the_same_bits(
        predicted):
    """Rank 0 holds every result of a sync call, returns and kills the switch; rank 1
    lost them. Rank 1 completes the call from rank 0's kept window: opened, it asks rank
    0 for it directly at its silence bound (ina/windows.py) and returns; predicted (the
    call repeats the first, no opening: rank 1 hears nothing of it), it reaches its
    error path, rank 0 its next call's gate, where rank 1's role PREDICTED is read as
    FAILED since rank 0 finished it. Both return the exact sum, bit for bit, and the
    next call, which the dead switch fails on both, takes the exact engine."""
    with mortal_switch() as sw:
        def rank(comm):
            r = comm.Get_rank()
            coll = Collectives(comm, settings_for(sw, switch_predict=predicted), InaEngine)
            try:
                x = np.arange(COUNT, dtype=np.float32) * (r + 1)
                coll.allreduce(x if predicted else np.full(COUNT, 1.0 + r, np.float32))
                engines = [coll.stats.snapshot()["last_call"]["engine"]]
                if r == 1:
                    deaf_from_the_next_stream(coll.offload)
                comm.Barrier()
                second = coll.allreduce(x)
                engines.append(coll.stats.snapshot()["last_call"]["engine"])
                if r == 0:
                    sw.kill()
                third = coll.allreduce(np.full(COUNT, 2.0, np.float32))
                engines.append(coll.stats.snapshot()["last_call"]["engine"])
                return second, third, engines, coll.offload.switch_state()
            finally:
                coll.free()

        results = run_ranks(2, rank, timeout=60, kind=ThreadPeers)
    (second0, third0, engines0, state0), (second1, third1, engines1, state1) = results
    assert second0.tolist() == (np.arange(COUNT, dtype=np.float32) * 3).tolist()
    assert second1.tobytes() == second0.tobytes()
    assert third0.tolist() == third1.tolist() == [4.0] * COUNT
    assert engines0 == engines1 == ["ina", "ina", "gloo"], (engines0, engines1)
    assert (state0["rescued_calls"], state1["rescued_calls"]) == (0, int(predicted))
    assert state1["peer_completed_calls"] == int(not predicted)
    assert [s["outages"] for s in (state0, state1)] == [1, 1]
    assert [s["serving"] for s in (state0, state1)] == [False, False]


def test_a_rank_that_stops_ends_the_others_call_within_its_bound_saying_why():
    """Rank 1 freezes after one call; rank 0's next call gets nothing from the switch
    (rank 1 never sends) nor from rank 1. The switch says it holds rank 0's packets (a
    late peer, not a dead switch), so rank 0's stream waits for its peer until the call's
    deadline (the timeout), not only its silence bound; then the error path waits for
    rank 1 its timeout too: it ends within twice the timeout with a CollectiveTimeout
    that says what it waited for, and why it needed it."""
    timeout = 1.5
    with mortal_switch() as sw:
        def rank(comm):
            coll = Collectives(comm, settings_for(sw, timeout=timeout), InaEngine)
            coll.allreduce(np.ones(COUNT, np.float32))
            if comm.Get_rank() == 1:
                comm.stop()  # (and its communicators: the chooser's copy)
                return None
            start = time.monotonic()
            try:
                coll.allreduce(np.ones(COUNT, np.float32))
            except InaError as exc:
                return type(exc).__name__, str(exc), time.monotonic() - start
            finally:
                coll.comm.stop()  # (nothing more to say to rank 1: free without a gate)
                coll.free()
            raise AssertionError("rank 0's call ended without an error")

        (kind, message, seconds), stopped = run_ranks(2, rank, timeout=60, kind=ThreadPeers)
    assert stopped is None
    assert kind == "CollectiveTimeout", message
    assert message.startswith(f"waited {timeout:g} s for all 2 ranks to take up the error "
                              f"path of switch call #2"), message
    assert "held this rank's packets for a peer's" in message, message
    assert seconds < 2 * timeout + 1.0, seconds  # (the stream's deadline, then the gate's)
