"""ina/engine.py at 2 ranks in one process (tests/threadcomm.py), through a software
switch in a thread (tests/switch/test_server.py: switch_thread): the engine built as the
chooser builds it (its aggregators joined over the thread communicator), a call served
and ended by the vote, and a sync call without a vote whose results one rank lost: that
rank completes it from the other's kept window (rescue.py), both return the same bits
and both mark the aggregator lost."""
from __future__ import annotations

import socket

import numpy as np

from ina_collectives.collectives.engine import AllreduceCall
from ina_collectives.collectives.ops import Op
from ina_collectives.collectives.recovery import TROUBLE, ErrorPath
from ina_collectives.collectives.waiting import Deadline
from ina_collectives.ina.engine import InaEngine
from ina_collectives.settings import Settings
from tests.inputs import check_within_bound, make_input
from tests.switch.test_server import switch_thread
from tests.threadcomm import run_ranks


def settings_for(sw, **more) -> Settings:
    return Settings(switch="%s:%d" % sw.address, switch_min_bytes=0, timeout=10,
                    **more)


def gated_engine(comm, sw) -> InaEngine:
    """An engine whose next collective is a gate (vote-free calls), opening by MPI, a
    silence bound of 0.5 s."""
    errors = ErrorPath(comm, 10.0)
    errors.set_gate(lambda: 4)
    return InaEngine(comm, settings_for(sw, switch_silence=0.5, switch_opening=False),
                     errors)


def deafen(engine: InaEngine) -> None:
    """The engine's link takes datagrams from a dead address only: no result reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dead:
        dead.bind(("127.0.0.1", 0))
        engine.link.sock.connect(dead.getsockname())


def test_a_call_through_the_switch_ends_by_the_vote_alike_on_every_rank():
    count = 70_001
    with switch_thread() as sw:
        def rank(comm):
            engine = InaEngine(comm, settings_for(sw), ErrorPath(comm, 10.0))
            try:
                x = make_input("float32", "sum", count, 5, comm.Get_rank())
                handed = engine.run(AllreduceCall(None, x, Op.SUM), Deadline(10.0))
                return handed, x, engine.switch_state()
            finally:
                engine.close()

        results = run_ranks(2, rank)
    assert [handed for handed, _, _ in results] == [None, None]
    assert results[0][1].tobytes() == results[1][1].tobytes()
    check_within_bound(results[0][1], "float32", "sum", count, 5, 2)
    for _, _, state in results:
        assert (state["serving"], state["vote_free_calls"], state["rescued_calls"]) == (
            True, 0, 0), state


def test_a_rank_that_lost_a_vote_free_calls_results_completes_it_from_the_others_window():
    """A sync call through one aggregator whose next collective is a gate needs no vote.
    Rank 1's results never arrive (its socket takes datagrams from a dead address only);
    rank 0 returns with every result and keeps its last window, which it serves to no
    one (its window server closed: ina/windows.py, as where a peer cannot be reached).
    Rank 1 gives up after the silence bound and posts TROUBLE in the gate; rank 0 reads
    it there and helps: rank 1's output is rank 0's, bit for bit, and both mark the
    aggregator lost."""
    count = 1000  # one chunk: the whole call is the last window
    with switch_thread() as sw:
        def rank(comm):
            r = comm.Get_rank()
            engine = gated_engine(comm, sw)
            try:
                if r == 0:
                    engine.windows.close()
                if r == 1:
                    deafen(engine)
                x = np.arange(count, dtype=np.float32) * (r + 1)
                handed = engine.run(AllreduceCall(None, x, Op.SUM), Deadline(10.0))
                if r == 0:  # the next gate
                    rows = np.empty((2, 4), np.int64)
                    comm.Iallgather(np.zeros(4, np.int64), rows).Wait()
                    assert rows[:, 0].tolist() == [0, TROUBLE]
                    engine.help_rescue("the last switch call")
                return handed, x, engine.switch_state()
            finally:
                engine.close()

        results = run_ranks(2, rank)
    (handed0, out0, state0), (handed1, out1, state1) = results
    assert handed0 is None and handed1 is None
    assert out0.tolist() == (np.arange(count, dtype=np.float32) * 3).tolist()
    assert out1.tobytes() == out0.tobytes()
    assert (state0["vote_free_calls"], state0["rescued_calls"]) == (1, 0)
    assert (state1["vote_free_calls"], state1["rescued_calls"]) == (0, 1)
    assert [s["serving"] for s in (state0, state1)] == [False, False]
    assert [s["outages"] for s in (state0, state1)] == [1, 1]


def test_a_rank_that_lost_results_takes_them_from_a_peer_in_its_own_collective():
    """Rank 0 finishes a vote-free call and goes on into the program's own collective
    (no gate). Rank 1 lost the call's results (its socket takes datagrams from a dead
    address only): at its silence bound it asks rank 0 for its kept window
    (ina/windows.py), returns the same bits and reaches that collective; no rank posts
    TROUBLE, the aggregator stays in use, and the next call through it is exact on both
    (rank 1's slots settled as the call's completion leaves them)."""
    count = 5000  # two chunks of K 4096: one slot's use, the second chunk in another
    with switch_thread() as sw:
        def rank(comm):
            r = comm.Get_rank()
            engine = gated_engine(comm, sw)
            try:
                if r == 1:
                    deafen(engine)
                x = np.arange(count, dtype=np.float32) * (r + 1)
                handed = engine.run(AllreduceCall(None, x, Op.SUM), Deadline(10.0))
                mine = np.full(1, r, np.int64)  # the program's own collective
                theirs = np.empty(1, np.int64)
                comm.Iallreduce(mine, theirs).Wait()
                if r == 1:
                    engine.link.sock.connect(sw.address)  # (it hears the switch again)
                y = np.arange(count, dtype=np.float32) + r
                again = engine.run(AllreduceCall(None, y, Op.SUM), Deadline(10.0))
                return handed, x, again, y, int(theirs[0]), engine.switch_state()
            finally:
                engine.close()

        results = run_ranks(2, rank, timeout=60)
    (h0, x0, a0, y0, t0, state0), (h1, x1, a1, y1, t1, state1) = results
    assert (h0, h1, a0, a1, t0, t1) == (None, None, None, None, 1, 1)
    assert x0.tolist() == (np.arange(count, dtype=np.float32) * 3).tolist()
    assert x1.tobytes() == x0.tobytes()
    assert y0.tolist() == (np.arange(count, dtype=np.float32) * 2 + 1).tolist()
    assert y1.tobytes() == y0.tobytes()
    assert (state1["peer_completed_calls"], state1["rescued_calls"]) == (1, 0), state1
    assert state0["windows_served"] >= 1 and state0["peer_completed_calls"] == 0
    assert [s["serving"] for s in (state0, state1)] == [True, True]
    assert [s["outages"] for s in (state0, state1)] == [0, 0]
