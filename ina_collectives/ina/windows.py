"""A rank's kept window, served to its peers (docs/protocol-recovery.md, A call some ranks
finished).

A vote-free call returns on a rank as soon as it holds every result, and that rank keeps
its last window (rescue.py, ``Kept``). A peer that lost some of those results (the
switch died or restarted after multicasting them, its socket dropped them while it was
descheduled) would otherwise wait for the others in the next gate, which a program that
makes its own collective between two library calls never reaches: both wait until the
timeout. So each rank serves its kept window on a UDP socket of its own, from a thread,
to its peers only; a rank that lost results of the last window asks its peers for it
directly, completes the call with the same bits and returns as they did. Only where no
peer holds the window (no rank finished the call) does it post TROUBLE, and then every
rank is in the same call and reaches the same gate.

A request is ``REQUEST``: the magic, the call's number, the byte offset and length
wanted. The answer is ``REPLY`` and the bytes: the magic, the call's number, the window's
first element, its size in bytes (0: this rank keeps no window of that call) and the
offset of the bytes that follow.
"""
from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from ..protocol import udp_socket

log = logging.getLogger("ina_collectives")

MAGIC = b"INAW"
REQUEST = struct.Struct("!4sQQI")    # magic, call, offset, length (bytes)
REPLY = struct.Struct("!4sQQQQ")     # magic, call, start (element), size, offset (bytes)
PIECE = 32768                        # bytes of the window per answer
FIRST_WAIT = 0.02                    # seconds before a request is sent again (doubling)


class WindowServer:
    """Answers the peers' requests for this rank's kept window (``kept()``: the Kept of
    the last vote-free call, or None) from a daemon thread, on a socket bound to
    ``host``; requests from any host but the peers' (``peers``, their IPv4 addresses,
    set once they are known) are ignored."""

    def __init__(self, kept: Callable[[], Any], host: str = "0.0.0.0"):
        self._kept = kept
        self.sock = udp_socket(host, 0)
        self.port = self.sock.getsockname()[1]
        self.peers: set[str] = set()
        self.answered = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ina-kept-window",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.2)
                if not ready:
                    continue
                packet, peer = self.sock.recvfrom(64)
            except (OSError, ValueError):  # closed
                return
            if peer[0] not in self.peers or len(packet) != REQUEST.size:
                continue
            magic, call, offset, length = REQUEST.unpack(packet)
            if magic != MAGIC:
                continue
            kept = self._kept()
            if kept is None or kept.call != call:
                answer = REPLY.pack(MAGIC, call, 0, 0, 0)
            else:
                data = np.ascontiguousarray(kept.values).view(np.uint8)
                piece = data[offset:offset + min(length, PIECE)].tobytes()
                answer = REPLY.pack(MAGIC, call, kept.start, data.size, offset) + piece
            try:
                self.sock.sendto(answer, peer)
                self.answered += 1
            except OSError as exc:  # (the peer retries)
                log.debug("a kept window's answer to %s was refused: %s", peer, exc)

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        self._thread.join(1.0)


def fetch_window(peers: list[tuple[str, int]], call: int, dtype: np.dtype,
                 seconds: float) -> tuple[int, np.ndarray, int] | None:
    """Ask each of ``peers`` in turn for its kept window of switch call ``call``
    (elements of ``dtype``), within ``seconds`` in all: (its first element, its values,
    the index of the peer that had it), or None where none answered with it."""
    end = time.monotonic() + seconds
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for index, peer in enumerate(peers):
            got = _fetch_from(sock, peer, call, end)
            if got is not None:
                start, data = got
                return start, np.frombuffer(data, dtype).copy(), index
            if time.monotonic() >= end:
                break
    return None


def _fetch_from(sock: socket.socket, peer: tuple[str, int], call: int,
                end: float) -> tuple[int, bytes] | None:
    """One peer's window of ``call`` piece by piece, each request sent again with a
    doubling wait while unanswered; None if it keeps none, or by ``end``."""
    data = bytearray()
    size, start = None, 0
    wait = FIRST_WAIT
    while size is None or len(data) < size:
        now = time.monotonic()
        if now >= end:
            return None
        try:
            sock.sendto(REQUEST.pack(MAGIC, call, len(data), PIECE), peer)
        except OSError:
            return None
        sock.settimeout(max(0.001, min(wait, end - now)))
        try:
            while True:
                answer, source = sock.recvfrom(REPLY.size + PIECE)
                if source != peer or len(answer) < REPLY.size:
                    continue
                magic, got_call, first, total, offset = REPLY.unpack_from(answer)
                if magic == MAGIC and got_call == call and offset == len(data):
                    break
        except socket.timeout:
            wait = min(2 * wait, 0.5)
            continue
        except OSError:
            return None
        if total == 0:
            return None  # (it keeps no window of that call)
        size, start = total, first
        data += answer[REPLY.size:]
        wait = FIRST_WAIT
    return start, bytes(data[:size])
