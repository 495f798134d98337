"""Point-to-point between a group's ranks, framework-neutral (NumPy buffers).

``PointToPoint`` sends and receives on a group's peers: each transfer ends (done, or
failed naming what it waited for) without anyone waiting on it, so that a binding can
complete its futures from it, and each is bounded by the group's timeout from the moment
it was posted. One interface over the two kinds of peers a group has
(collectives/peers.py):

- an MPI communicator (ina-run, mpiexec): one thread polls every transfer in flight
  (``Test``, which drives MPI's progress; its status says who sent and how much came),
  and ends when none has been posted for a while;
- gloo's (``TorchPeers``, torchrun): its sends and receives end only when waited on, so
  each waits in a thread of its own; and since gloo tells a receiver nothing of what
  came, every message carries its length first (8 bytes), which the receive checks
  against its buffer as MPI's status lets it.

A binding (torch/distributed.py) turns its tensors into these buffers, and a transfer's
end into its own futures and error types.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError, CollectiveTimeout, CommunicatorBroken, InaError

log = logging.getLogger("ina_collectives")

_LENGTH = np.dtype(np.int64)  # what leads each message over gloo: its payload's bytes
_POLL_PAUSE = 0.0002  # seconds the polling thread sleeps when no transfer ended
_IDLE = 1.0  # seconds the polling thread stays with nothing in flight, then ends
_SLICE = 0.1  # a waiter's slices: Ctrl-C interrupts it
LATE = 5.0  # seconds past its bound a transfer's own end may take (a waiter's grace)


class Transfer:
    """One send or receive in flight. Once ``done()``, ``error`` is None or why it
    failed (an InaError naming it), and ``source`` the rank a receive came from."""

    __slots__ = ("what", "expires", "source", "error", "_request", "_wire", "_into",
                 "_done", "_lock", "_callbacks")

    def __init__(self, what: str, seconds: float, wire: np.ndarray,
                 into: np.ndarray | None):
        self.what = what
        self.expires = time.monotonic() + seconds
        self.source = -1
        self.error: InaError | None = None
        self._request: Any = None
        self._wire = wire      # the posted buffer, kept alive until the transfer ends
        self._into = into      # a receive's: where what came lands (None: a send)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Transfer], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(transfer)`` once it has ended: at once if it has, else from
        the thread that ends it (keep it short; what it raises there is logged)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        _run(callback, self)

    def wait(self, seconds: float | None = None) -> None:
        """Return once it has ended, raising its error if it failed; CollectiveTimeout
        if it has not ended after ``seconds`` (None: its own bound and ``LATE``). Waits
        in short slices, so that Ctrl-C interrupts it."""
        if seconds is None:
            seconds = max(self.expires - time.monotonic(), 0.0) + LATE
        deadline = time.monotonic() + seconds
        while not self._done.wait(_SLICE):
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"waited {seconds:g} s for {self.what}")
        if self.error is not None:
            raise self.error

    # -- the ends: by the polling thread, a gloo transfer's own thread, or close ----------

    def end(self, error: InaError | None = None) -> bool:
        """End it (failed with ``error``, else done) unless it has ended already;
        whether this call ended it."""
        with self._lock:
            if self._done.is_set():
                return False
            self.error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run(callback, self)
        return True

    def poll(self) -> bool:
        """An MPI transfer: whether it has ended (ending it if so); the polling thread's
        only call."""
        status = MPI.Status()
        try:
            if not self._request.Test(status):
                if time.monotonic() < self.expires:
                    return False
                self.end(CollectiveTimeout(f"waited for {self.what} until the group's "
                                           f"timeout: the peer never matched it"))
                self._request.Cancel()
                return True
            self.source = status.Get_source()
            if self._into is not None:
                self._check_length(status.Get_count(MPI.BYTE), self._into.nbytes)
        except Exception as exc:  # noqa: BLE001 - MPI's failure reaches the waiter
            self._failed(exc)
        else:
            self.end()
        return True

    def block(self, on_end: Callable[[Transfer], None]) -> None:
        """A gloo transfer (its message framed): wait for it, up to its bound (then gloo
        raises), and end it; ``on_end(self)`` after."""
        try:
            self._request.Wait(max(self.expires - time.monotonic(), 0.0))
            if self._into is not None:
                self.source = self._request.source()
                came = int(self._wire[:_LENGTH.itemsize].view(_LENGTH)[0])
                self._check_length(came, self._into.nbytes)
                if not self._done.is_set():  # (close may have failed it meanwhile)
                    np.copyto(_bytes(self._into), self._wire[_LENGTH.itemsize:])
        except Exception as exc:  # noqa: BLE001 - gloo's failure reaches the waiter
            self._failed(exc)
        else:
            self.end()
        finally:
            on_end(self)

    def _failed(self, exc: Exception) -> None:
        """End the transfer with ``exc``: the library's own error as it is, the MPI or
        gloo binding's as a broken communicator naming the transfer."""
        self.end(exc if isinstance(exc, InaError)
                 else CommunicatorBroken(f"{self.what} failed: {exc}"))

    def _check_length(self, came: int, holds: int) -> None:
        # (A binding's buffer is its tensor's, and the binding's users read "tensor".)
        if came != holds:
            raise AgreementError(f"{self.what} failed: {came} bytes came, the tensor holds "
                                 f"{holds}: the ranks' tensors differ")


class PointToPoint:
    """Sends and receives on one group's peers (``comm``: an MPI communicator, or
    gloo's ``TorchPeers``), each bounded by ``seconds`` (the group's timeout)."""

    def __init__(self, comm: Any, seconds: float):
        if not seconds > 0:
            raise ValueError(f"point-to-point needs a timeout above 0 s, got {seconds!r}")
        self.comm, self.seconds = comm, seconds
        self.size = comm.Get_size()
        # gloo (anything but MPI) ends a transfer only when waited on, and says nothing
        # of what came: a thread each, and the length first.
        self.framed = not isinstance(comm, MPI.Comm)
        self.tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._lock = threading.Condition()
        self._polled: list[Transfer] = []
        self._blocking: set[Transfer] = set()
        self._poller: threading.Thread | None = None
        self._closed = False

    def send(self, data: np.ndarray, dest: int, tag: int) -> Transfer:
        """Start sending ``data`` (its bytes) to rank ``dest`` with ``tag``."""
        self._check(dest, tag, "send")
        data = np.ascontiguousarray(data)
        if self.framed:
            wire = np.concatenate([np.array([data.nbytes], _LENGTH).view(np.uint8),
                                   _bytes(data)])
        else:
            wire = data
        transfer = Transfer(f"send to rank {dest} (tag {tag})", self.seconds, wire, None)
        return self._start(transfer, lambda: self.comm.Isend(wire, dest=dest, tag=tag))

    def recv(self, into: np.ndarray, source: int | None, tag: int) -> Transfer:
        """Start receiving into ``into`` (a writable contiguous array, which what came
        must fill exactly) from rank ``source`` (None: any rank; the transfer's
        ``source`` then says which) with ``tag``."""
        if source is None:
            self._check(0, tag, "recv from any source")
            what, peer = f"recv from any rank (tag {tag})", MPI.ANY_SOURCE
        else:
            self._check(source, tag, "recv")
            what, peer = f"recv from rank {source} (tag {tag})", source
        if not (isinstance(into, np.ndarray) and into.flags.c_contiguous
                and into.flags.writeable):
            raise ValueError(f"{what}: the buffer must be a writable contiguous array")
        wire = (np.empty(_LENGTH.itemsize + into.nbytes, np.uint8) if self.framed
                else into)
        transfer = Transfer(what, self.seconds, wire, into)
        return self._start(transfer, lambda: self.comm.Irecv(wire, source=peer, tag=tag))

    def close(self) -> None:
        """Fail every transfer in flight (saying the group was shut down) and refuse new
        ones; the polling thread ends."""
        with self._lock:
            self._closed = True
            ending = self._polled + list(self._blocking)
            self._polled, self._blocking = [], set()
            self._lock.notify_all()
        for t in ending:
            t.end(CommunicatorBroken(f"the process group was shut down during {t.what}"))

    def _check(self, peer: int, tag: int, what: str) -> None:
        if not all(isinstance(v, (int, np.integer)) for v in (peer, tag)):
            raise TypeError(f"{what}: the rank and the tag must be integers, got {peer!r} "
                            f"and {tag!r}")
        if not 0 <= peer < self.size:
            raise ValueError(f"{what}: rank {peer} is not in the group's 0..{self.size - 1}")
        if not 0 <= tag <= self.tag_ub:
            raise ValueError(f"{what}: tag {tag} must be 0 .. {self.tag_ub}")

    def _start(self, transfer: Transfer, post: Callable[[], Any]) -> Transfer:
        with self._lock:
            if self._closed:
                raise CommunicatorBroken(f"{transfer.what}: the process group has been "
                                         f"shut down")
            transfer._request = post()
            if self.framed:
                self._blocking.add(transfer)
                threading.Thread(target=transfer.block, args=(self._unblock,), daemon=True,
                                 name="ina-p2p-gloo").start()
                return transfer
            self._polled.append(transfer)
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, daemon=True,
                                                name="ina-p2p")
                self._poller.start()
            self._lock.notify()
        return transfer

    def _unblock(self, transfer: Transfer) -> None:
        with self._lock:
            self._blocking.discard(transfer)

    def _poll(self) -> None:
        while True:
            with self._lock:
                if not self._polled and not self._closed:
                    self._lock.wait(_IDLE)
                if self._closed or not self._polled:  # closed, or idle: a new one starts
                    self._poller = None  # another thread when needed
                    return
                polled = list(self._polled)
            ended = [t for t in polled if t.poll()]
            if ended:
                with self._lock:
                    self._polled = [t for t in self._polled if t not in ended]
            else:
                time.sleep(_POLL_PAUSE)


def _bytes(array: np.ndarray) -> np.ndarray:
    """A contiguous array's memory as bytes (the same memory)."""
    return array.reshape(-1).view(np.uint8)


def _run(callback: Callable[[Transfer], None], transfer: Transfer) -> None:
    try:
        callback(transfer)
    except Exception:  # noqa: BLE001 - the thread must go on; the caller hears of it
        log.exception("a completion callback of %s failed", transfer.what)
