"""ina/windows.py: a rank's kept window served to its peers and fetched from them, piece
by piece over UDP on loopback; a peer that keeps another call's window, or none, is
passed over for the next; a host that is no peer is not answered."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ina_collectives.ina.rescue import Kept
from ina_collectives.ina.windows import PIECE, WindowServer, fetch_window


@pytest.fixture
def servers():
    made: list[WindowServer] = []

    def serve(kept) -> WindowServer:
        server = WindowServer(lambda: kept, "127.0.0.1")
        server.peers = {"127.0.0.1"}
        made.append(server)
        return server

    yield serve
    for server in made:
        server.close()


def test_a_window_of_many_pieces_is_fetched_whole(servers):
    values = np.random.default_rng(1).standard_normal(3 * PIECE // 4 + 5)  # float64
    server = servers(Kept(7, 0, 1000, values))
    start, got, index = fetch_window([("127.0.0.1", server.port)], 7, values.dtype, 2.0)
    assert (start, index) == (1000, 0)
    assert got.tobytes() == values.tobytes()
    pieces, end = -(-values.nbytes // PIECE), time.monotonic() + 2
    while server.answered < pieces and time.monotonic() < end:  # (it counts after sending)
        time.sleep(0.01)
    assert server.answered == pieces


def test_a_peer_without_the_calls_window_is_passed_over_for_the_next(servers):
    values = np.arange(10, dtype=np.float32)
    other = servers(Kept(6, 0, 0, values))      # another call's
    none = servers(None)                        # nothing kept
    has = servers(Kept(7, 0, 4, values))
    peers = [("127.0.0.1", s.port) for s in (other, none, has)]
    start, got, index = fetch_window(peers, 7, np.float32, 2.0)
    assert (start, index, got.tolist()) == (4, 2, values.tolist())
    assert fetch_window(peers[:2], 7, np.float32, 1.0) is None


def test_a_host_that_is_no_peer_is_not_answered_and_the_wait_is_bounded(servers):
    server = servers(Kept(7, 0, 0, np.zeros(4, np.float32)))
    server.peers = {"127.0.0.2"}
    begun = time.monotonic()
    assert fetch_window([("127.0.0.1", server.port)], 7, np.float32, 0.3) is None
    waited = time.monotonic() - begun
    # (its bound, and one last wait of at most 0.5 s begun before it: slack for a busy
    # machine on top)
    assert 0.3 <= waited < 0.3 + 0.5 + 2.0 and server.answered == 0, waited
