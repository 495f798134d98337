"""runtime/p2p.py over both kinds of peers: MPI's (a rank's own communicator, each
message to itself, polled by the thread) and gloo's (``TorchPeers`` at 2 ranks in one
process, framed with their length): what was sent arrives, in every dtype; a receive
from any rank says who sent; a receive larger than what came, one nobody matches (the
timeout), a shutdown with transfers in flight, and bad input, each with its message;
the polling thread ends when idle."""
from __future__ import annotations

import datetime
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives.peers import TorchPeers
from ina_collectives.errors import AgreementError, CollectiveTimeout, CommunicatorBroken
from ina_collectives.runtime import p2p
from ina_collectives.runtime.p2p import PointToPoint

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64",
          "bool"]


def values(dtype: str, n: int, seed: int) -> np.ndarray:
    return (np.arange(n) * 7 + seed).astype(dtype) if dtype != "bool" else \
        (np.arange(n) + seed) % 3 == 0


@pytest.fixture
def own():
    """PointToPoint on a communicator of this process alone (bound 2 s), closed after."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("the polling thread needs MPI_THREAD_MULTIPLE")
    comm = MPI.COMM_SELF.Dup()
    made = []

    def make(seconds: float = 2.0) -> PointToPoint:
        made.append(PointToPoint(comm, seconds))
        return made[-1]
    yield make
    for one in made:
        one.close()


def test_mpi_what_was_sent_arrives_in_every_dtype(own):
    pp = own()
    for tag, dtype in enumerate(DTYPES):
        sent = values(dtype, 5, tag)
        into = np.zeros(5, dtype)
        receiving = pp.recv(into, 0, tag)
        sending = pp.send(sent, 0, tag)
        receiving.wait(5)
        sending.wait(5)
        np.testing.assert_array_equal(into, sent, err_msg=dtype)
        assert receiving.source == 0


def test_mpi_a_receive_from_any_rank_says_who_sent_and_calls_back(own):
    pp = own()
    ended = []
    into = np.zeros(3, np.float32)
    receiving = pp.recv(into, None, 4)
    receiving.add_done_callback(lambda t: ended.append((t.what, t.error, t.source)))
    pp.send(np.full(3, 2.5, np.float32), 0, 4).wait(5)
    receiving.wait(5)
    assert ended == [("recv from any rank (tag 4)", None, 0)]
    assert into.tolist() == [2.5] * 3
    late = []
    receiving.add_done_callback(late.append)  # ended already: at once
    assert late == [receiving]


def test_mpi_a_receive_larger_than_what_came_fails_naming_both(own):
    pp = own()
    receiving = pp.recv(np.zeros(9, np.float32), 0, 5)
    pp.send(np.ones(4, np.float32), 0, 5).wait(5)
    with pytest.raises(AgreementError) as failed:
        receiving.wait(5)
    assert str(failed.value) == ("recv from rank 0 (tag 5) failed: 16 bytes came, the "
                                 "tensor holds 36: the ranks' tensors differ")


def test_mpi_a_receive_nobody_matches_ends_at_the_bound(own):
    pp = own(0.3)
    start = time.monotonic()
    receiving = pp.recv(np.zeros(3, np.float32), 0, 99)
    with pytest.raises(CollectiveTimeout) as failed:
        receiving.wait()
    assert 0.3 <= time.monotonic() - start < 2.0
    assert str(failed.value) == ("waited for recv from rank 0 (tag 99) until the group's "
                                 "timeout: the peer never matched it")


def test_a_wait_shorter_than_the_transfer_ends_with_its_own_timeout(own):
    pp = own(5.0)
    receiving = pp.recv(np.zeros(2, np.int32), 0, 98)
    with pytest.raises(CollectiveTimeout, match=r"^waited 0.2 s for recv from rank 0 "
                                                r"\(tag 98\)$"):
        receiving.wait(0.2)
    assert not receiving.done()


def test_mpi_shutdown_fails_what_is_in_flight_and_refuses_more(own):
    pp = own(5.0)
    receiving = pp.recv(np.zeros(2, np.int32), 0, 97)
    pp.close()
    with pytest.raises(CommunicatorBroken, match=r"^the process group was shut down during "
                                                 r"recv from rank 0 \(tag 97\)$"):
        receiving.wait(1)
    with pytest.raises(CommunicatorBroken, match="has been shut down"):
        pp.send(np.ones(1), 0, 1)


def test_bad_input_is_refused_with_what_is_wrong(own):
    pp = own()
    with pytest.raises(ValueError, match=r"^send: rank 1 is not in the group's 0..0$"):
        pp.send(np.ones(1), 1, 0)
    with pytest.raises(ValueError, match=r"^recv: rank -1 is not in the group's 0..0$"):
        pp.recv(np.ones(1), -1, 0)
    with pytest.raises(ValueError, match=r"^send: tag -1 must be 0 \.\. \d+$"):
        pp.send(np.ones(1), 0, -1)
    with pytest.raises(ValueError, match=r"^recv from any source: tag -2 must be 0 \.\. "):
        pp.recv(np.ones(1), None, -2)
    frozen = np.ones(2)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable contiguous array"):
        pp.recv(frozen, 0, 0)
    with pytest.raises(ValueError, match="writable contiguous array"):
        pp.recv(np.ones((4, 4))[:, 0], 0, 0)
    with pytest.raises(TypeError, match=r"^send: the rank and the tag must be integers, "
                                        r"got 0 and 1.5$"):
        pp.send(np.ones(1), 0, 1.5)
    with pytest.raises(ValueError, match="writable contiguous array"):
        pp.recv([0.0], 0, 0)
    with pytest.raises(ValueError, match="timeout above 0 s"):
        PointToPoint(MPI.COMM_SELF, 0)


def test_the_polling_thread_ends_when_idle_and_comes_back(own, monkeypatch):
    monkeypatch.setattr(p2p, "_IDLE", 0.05)
    pp = own()

    def pollers() -> int:
        return sum(t.name == "ina-p2p" for t in threading.enumerate())
    for tag in (1, 2):
        into = np.zeros(1)
        receiving = pp.recv(into, 0, tag)
        pp.send(np.ones(1), 0, tag).wait(5)
        receiving.wait(5)
        deadline = time.monotonic() + 5
        while pollers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pollers() == 0 and into.tolist() == [1.0]


# -- gloo ------------------------------------------------------------------------------


def on_gloo(body, seconds: float = 5.0, n: int = 2) -> list:
    """``body(p2p, rank)`` on n ranks in threads, each with PointToPoint over its own
    TorchPeers (gloo over a shared store; bound ``seconds``); the results by rank. The
    ranks end together, and their gloo groups go once no transfer waits on them."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    peers: list = [None] * n
    results: list = [None] * n
    errors: list = []
    end = threading.Barrier(n)

    def rank(r: int) -> None:
        try:
            peers[r] = TorchPeers(store, r, n, datetime.timedelta(seconds=seconds))
            pp = PointToPoint(peers[r], seconds)
            try:
                results[r] = body(pp, r)
            except BaseException:
                end.abort()  # (a rank that failed leaves no one waiting for it)
                raise
            finally:
                try:
                    end.wait(seconds + 10)  # the others may still be sending to this rank
                finally:
                    pp.close()
        except BaseException as exc:  # noqa: BLE001 - reported below with its rank
            errors.append((r, exc))
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    deadline = time.monotonic() + seconds + p2p.LATE
    while (any(t.name == "ina-p2p-gloo" for t in threading.enumerate())
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert not any(t.is_alive() for t in threads), "a rank never ended"
    errors = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)
              ] or errors
    if errors:
        raise AssertionError(f"rank {errors[0][0]} failed") from errors[0][1]
    return results


@pytest.fixture
def gloo_on_loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("MASTER_ADDR", raising=False)


def test_gloo_what_was_sent_arrives_framed_in_every_dtype(gloo_on_loopback):
    def body(pp, r):
        assert pp.framed
        got = {}
        for tag, dtype in enumerate(DTYPES):
            into = np.zeros(6, dtype)
            receiving = pp.recv(into, 1 - r, tag)
            pp.send(values(dtype, 6, r), 1 - r, tag).wait()
            receiving.wait()
            got[dtype] = (into, receiving.source)
        return got

    for r, got in enumerate(on_gloo(body)):
        for dtype, (into, source) in got.items():
            np.testing.assert_array_equal(into, values(dtype, 6, 1 - r), err_msg=dtype)
            assert source == 1 - r


def test_gloo_any_source_a_short_message_and_a_shutdown(gloo_on_loopback):
    closed = threading.Event()

    def body(pp, r):
        if r == 1:
            pp.send(np.full(2, 3.0, np.float32), 0, 1).wait()
            pp.send(np.ones(4, np.float32), 0, 2).wait()
            assert closed.wait(10)
            pp.send(np.ones(1), 0, 3).wait()  # (ends rank 0's thread, after the fact)
            return None
        anyone = pp.recv(np.zeros(2, np.float32), None, 1)
        anyone.wait()
        short = pp.recv(np.zeros(9, np.float32), 1, 2)
        with pytest.raises(AgreementError) as failed:
            short.wait()
        pending = pp.recv(np.zeros(1), 1, 3)
        pp.close()
        closed.set()
        with pytest.raises(CommunicatorBroken, match=r"^the process group was shut down "
                                                     r"during recv from rank 1 \(tag 3\)$"):
            pending.wait(2)
        return anyone.source, str(failed.value)

    source, message = on_gloo(body)[0]
    assert source == 1
    assert message == ("recv from rank 1 (tag 2) failed: 16 bytes came, the tensor holds "
                       "36: the ranks' tensors differ")


def test_gloo_a_receive_nobody_matches_fails_within_the_bound(gloo_on_loopback):
    def body(pp, r):
        if r == 1:
            return None
        start = time.monotonic()
        with pytest.raises(CommunicatorBroken, match=r"^recv from rank 1 \(tag 9\) failed: "):
            pp.recv(np.zeros(2), 1, 9).wait()
        return time.monotonic() - start

    waited = on_gloo(body, seconds=1.0)[0]
    assert 0.5 < waited < 1.0 + p2p.LATE
