"""The worker's side of the aggregator: its UDP socket, joining a job, streaming tensors.

Control exchanges (join, leave, probe) are rare and live here in Python, each with a
bounded wait; the data path is ``_fast/transport.pyx``.
"""
from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

import numpy as np

from . import protocol as P

RCVBUF = SNDBUF = 4 << 20


class AggregatorUnavailable(ConnectionError):
    """The aggregator did not answer, or refused the job; the message says which."""


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' (or 'host', for the default port) as a socket address."""
    host, _, port = text.strip().rpartition(":")
    if not host:
        host, port = text.strip(), str(P.UDP_PORT)
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"switch address {text!r}: the port {port!r} is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"switch address {text!r}: port {number} is out of range")
    try:
        resolved = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"switch address {text!r}: cannot resolve {host!r}: {exc}") from None
    return resolved, number


def control_exchange(sock: socket.socket, switch: tuple[str, int], job: int, worker: int,
                     body: list[int], timeout: float, what: str) -> int:
    """Send a control packet, resending every 0.2 s (UDP may lose either way), until the
    aggregator answers or ``timeout`` passes; the status it answered."""
    packet = P.pack_header(flags=P.FLAG_CONTROL, job=job, worker=worker, slot_version=0,
                           slot=0, offset=0, count=len(body), exponent=0,
                           proposal=P.PROPOSAL_NONE) + np.array(body, ">i4").tobytes()
    where = f"{switch[0]}:{switch[1]}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                sock.sendto(packet, switch)
            except OSError as exc:
                raise AggregatorUnavailable(f"cannot send the {what} to the aggregator at "
                                            f"{where}: {exc}") from None
            retry = min(time.monotonic() + 0.2, deadline)
            while (left := retry - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(65536)
                except socket.timeout:
                    break
                except ConnectionRefusedError:  # ICMP port unreachable: nobody listens
                    raise AggregatorUnavailable(
                        f"no aggregator listens at {where} (port unreachable)") from None
                if len(data) < P.HEADER_BYTES + 8:
                    continue
                h = P.unpack_header(data)
                reply = np.frombuffer(data[P.HEADER_BYTES:P.HEADER_BYTES + 8], ">i4")
                wanted = P.FLAG_CONTROL | P.FLAG_RESULT
                if h["flags"] & wanted == wanted and h["job"] == job and reply[0] == body[0]:
                    return int(reply[1])
            if time.monotonic() >= deadline:
                raise AggregatorUnavailable(
                    f"the aggregator at {where} did not answer the {what} within {timeout:g} s")
    finally:
        sock.settimeout(None)


@dataclass
class StreamResult:
    ok: bool
    reason: str
    counters: dict
    missing: np.ndarray


class WorkerLink:
    """One worker's UDP socket to the aggregator, for one job: joined by the worker
    itself (``join``), or installed by a controller at the socket's address (``port``
    given) and checked with ``probe``."""

    def __init__(self, switch: tuple[str, int], job: int, worker: int, n: int, k: int,
                 slots: int, port: int = 0):
        self.switch = switch
        self.job, self.worker, self.n, self.k, self.slots = job, worker, n, k, slots
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        try:
            self.sock.bind(("0.0.0.0", port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot bind the worker's UDP port {port}: {exc}") from None
        self.joined = False
        self.versions = np.zeros(slots, np.uint8)  # each slot's next version, kept across calls
        self.rtt = np.zeros(3)  # SRTT, RTTVAR, RTO (_fast/transport.pyx), kept across calls
        self.totals: dict[str, float] = {}  # the streams' counters, summed
        self._addr_be = struct.unpack("=I", socket.inet_aton(switch[0]))[0]
        self._port_be = socket.htons(switch[1])

    def close(self) -> None:
        self.sock.close()

    def _control(self, body: list[int], timeout: float, what: str) -> int:
        return control_exchange(self.sock, self.switch, self.job, self.worker, body,
                                timeout, what)

    def join(self, timeout: float) -> None:
        status = self._control([P.CTRL_JOIN, self.n, self.k, self.slots], timeout, "join")
        if status != 0:
            reason = P.JOIN_STATUS[status] if status < len(P.JOIN_STATUS) else f"code {status}"
            raise AggregatorUnavailable(
                f"the aggregator at {self.switch[0]}:{self.switch[1]} refused job {self.job} "
                f"(worker {self.worker} of {self.n}, K {self.k}, S {self.slots}): {reason}")
        self.joined = True

    def probe(self, timeout: float) -> None:
        """Check that a controller installed this worker of the job at this socket's
        address (a P4 switch answers only then; the software switch says why not)."""
        where = f"{self.switch[0]}:{self.switch[1]}"
        port = self.sock.getsockname()[1]
        try:
            status = self._control([P.CTRL_PROBE], timeout, "probe")
        except AggregatorUnavailable as exc:
            raise AggregatorUnavailable(
                f"{exc} (is job {self.job} installed for worker {self.worker} at UDP port "
                f"{port}? ina-run / ina_collectives.control install it)") from None
        if status != 0:
            reason = P.PROBE_STATUS[status] if status < len(P.PROBE_STATUS) else f"code {status}"
            raise AggregatorUnavailable(
                f"the aggregator at {where} has no entry for worker {self.worker} of job "
                f"{self.job} at UDP port {port}: {reason}")

    def leave(self, timeout: float = 0.5) -> None:
        """Tell the aggregator this worker is done; best effort (it may be gone). A job a
        controller installed is the controller's to remove: nothing is sent."""
        if not self.joined:
            return
        try:
            self._control([P.CTRL_LEAVE], timeout, "leave")
        except AggregatorUnavailable:
            pass

    def stream(self, x: np.ndarray, out: np.ndarray, local: np.ndarray, agreed: np.ndarray,
               average: bool, rto: float, rto_min: float, rto_max: float, silence: float,
               deadline: float) -> StreamResult:
        """Allreduce x (float32/64, 1-D) into out through the aggregator. rto is the
        timeout until a round trip is measured; then it adapts within rto_min .. rto_max."""
        from ._fast import transport

        status, counters, missing = transport.stream(
            self.sock.fileno(), self._addr_be, self._port_be, x, out, local, agreed,
            self.versions, self.n, self.k, self.job, self.worker, average, rto, rto_min,
            rto_max, silence, deadline, self.rtt)
        for name, value in counters.items():
            self.totals[name] = self.totals.get(name, 0) + value
        self.totals["srtt"], self.totals["rto"] = float(self.rtt[0]), float(self.rtt[2])
        return StreamResult(status == 0, transport.STATUS[status], counters, missing)
