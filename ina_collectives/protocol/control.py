"""Control packets: join, leave, probe, fault settings, wake; built and read here for
both ends (the worker's link, ina-run's probe, send_faults, and the software switch).

A control packet is an INA header with FLAG_CONTROL and a payload of int32 values, the
first one the op. The reply carries FLAG_CONTROL | FLAG_RESULT and the payload
[op, status], and from the software switch a third value, its capabilities (CAP_*; a P4
switch's two-value reply means none), and a fourth: for an accepted JOIN the slots the
job was granted (S or fewer: the pool is shared), for a PROBE of job 0 the pool's free
slots. Then, from a switch of several shards (``ina-switch --threads N``), every shard's
UDP port on the same host, in order (CAP_SHARDS): a job that names one stripes across all.
"""
from __future__ import annotations

import errno
import socket
import sys
import time
from typing import NamedTuple

import numpy as np

from ..errors import AggregatorUnavailable
from .header import (
    FLAG_CONTROL,
    FLAG_RESULT,
    HEADER_BYTES,
    PROTOCOL_VERSION,
    pack_header,
    unpack_header,
)

CTRL_JOIN = 1     # [JOIN, n, K, S, B, value bits]: the sender is worker `worker` of job `job`
CTRL_LEAVE = 2    # [LEAVE]: the sender is done; the job is freed when all have left
CTRL_PROBE = 3    # [PROBE]: job 0: is an aggregator there? job j: am I worker w of job j?
CTRL_FAULTS = 4   # [FAULTS, then FAULT_FIELDS in order] (probabilities in ppm, delays in us)
CTRL_WAKE = 5     # [WAKE]: the software switch's P4Runtime thread wakes its data path
# Capabilities an aggregator states in its replies (docs/protocol-recovery.md, Loss).
CAP_NACKS = 1     # it NACKs skipped packet numbers and answers result requests
CAP_NARROW = 2    # a job of 32-bit values also takes calls of 16-bit values
CAP_SHARDS = 4    # the reply lists the UDP ports of the switch's shards after the 4th value
CAP_OPEN = 8      # it takes a call's opening (FLAG_OPEN): no host collective per call
CAP_PREDICT = 16  # it takes predicted first windows (FLAG_PREDICTED): one round trip a call
CAP_QUORUM = 32   # it completes a chunk at the call's quorum k < n (a stamp in its packets)
FAULT_FIELDS = ("drop_in", "drop_out", "duplicate_in", "duplicate_out", "reorder_in",
                "reorder_out", "delay_ms_in", "delay_ms_out", "straggler_worker",
                "straggler_delay_ms", "probes_from_installed_only", "service_pps")
# (probes_from_installed_only, nonzero: the switch answers no PROBE of job 0, as a P4
# switch answers only its installed workers' probes; service_pps, nonzero: the switch
# serves at most that many data packets a second, as a slow target such as BMv2 does.)
JOIN_STATUS = ("accepted", "bad parameters", "job exists with other parameters",
               "worker id taken by another address", "no room for the job",
               "the job is configured by a controller (P4Runtime)",
               "another protocol version",
               "the job's packets do not fit the switch's MTU towards this worker")
JOIN_VERSION = JOIN_STATUS.index("another protocol version")
# A refusal of this status carries the switch's MTU towards the worker as its 4th value.
JOIN_MTU = JOIN_STATUS.index(
    "the job's packets do not fit the switch's MTU towards this worker")
# A probe for job j is answered 0 only if the sender is worker w of job j at its address
# (a P4 switch answers only then, and stays silent otherwise).
PROBE_STATUS = ("installed", "not installed at this address")
RETRY_SECONDS = 0.2  # UDP may lose a request or its reply: resend this often


def control_packet(job: int, worker: int, body: list[int], reply: bool = False) -> bytes:
    """A control request (or, ``reply``, an answer) carrying the int32 values ``body``."""
    flags = FLAG_CONTROL | (FLAG_RESULT if reply else 0)
    return pack_header(flags=flags, job=job, worker=worker, slot_version=0, slot=0,
                       offset=0, count=len(body)) + np.asarray(body, ">i4").tobytes()


def read_control(packet: bytes) -> tuple[dict[str, int], np.ndarray]:
    """A control packet's header and its int32 values (a trailing partial value is
    ignored); ValueError if it is shorter than a header."""
    head = unpack_header(packet)
    payload = packet[HEADER_BYTES:]
    return head, np.frombuffer(payload[:len(payload) - len(payload) % 4], ">i4")


def _fault_scale(name: str) -> float:
    if name in ("straggler_worker", "probes_from_installed_only", "service_pps"):
        return 1  # a worker id; a switch; packets a second
    # delays ms -> us, probabilities -> ppm
    return 1e3 if "delay" in name else 1e6


def encode_faults(faults: dict[str, float]) -> list[int]:
    """Fault settings as a CTRL_FAULTS body's values (names not given are 0: cleared)."""
    unknown = set(faults) - set(FAULT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(FAULT_FIELDS)}")
    return [round(faults.get(name, 0) * _fault_scale(name)) for name in FAULT_FIELDS]


def decode_faults(values: np.ndarray) -> dict[str, float]:
    """The inverse of encode_faults."""
    return {name: int(v) / _fault_scale(name) for name, v in zip(FAULT_FIELDS, values)}


def status_text(statuses: tuple[str, ...], status: int) -> str:
    return statuses[status] if 0 <= status < len(statuses) else f"code {status}"


def control_exchange(sock: socket.socket, switch: tuple[str, int], job: int, worker: int,
                     body: list[int], timeout: float, what: str) -> int:
    """Send a control request, resending every RETRY_SECONDS, until the aggregator answers
    or ``timeout`` passes; the status it answered. AggregatorUnavailable otherwise."""
    return control_request(sock, switch, job, worker, body, timeout, what)[0]


class ControlReply(NamedTuple):
    status: int
    capabilities: int    # CAP_*
    slots: int           # granted to a JOIN, free after a PROBE of job 0; -1 if absent
    shard_ports: tuple   # with CAP_SHARDS: every shard's UDP port, this one's included


# Linux's IP_RECVERR (<linux/in.h>; Python's socket module does not name it): an
# unconnected UDP socket hears ICMP errors, port unreachable among them, only with it.
IP_RECVERR = 11


# A send refused for want of buffers, not for the path: the datagram is lost, and retried.
_NO_ROOM = frozenset({errno.ENOBUFS, errno.EAGAIN, errno.EWOULDBLOCK})


def _hear_errors(sock: socket.socket, on: bool) -> None:
    """ICMP errors reported to ``sock``'s receives (``on``), or not again, with those
    queued meanwhile dropped (the data path reads none: _fast/transport.pyx)."""
    if not sys.platform.startswith("linux") or sock.family != socket.AF_INET:
        return
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, int(on))
        while not on:  # (the error queue, drained)
            sock.recvmsg(512, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    except OSError:  # (BlockingIOError: drained; elsewhere the join's timeout still bounds)
        pass


def control_request(sock: socket.socket, switch: tuple[str, int], job: int, worker: int,
                    body: list[int], timeout: float, what: str) -> ControlReply:
    """control_exchange, answering the whole reply (ControlReply). A port nothing
    listens on is named at once (ICMP port unreachable), not waited for."""
    packet = control_packet(job, worker, body)
    where = f"{switch[0]}:{switch[1]}"
    deadline = time.monotonic() + timeout
    _hear_errors(sock, True)
    try:
        while True:
            try:
                sock.sendto(packet, switch)
            except OSError as exc:
                # No room now (ENOBUFS under a shaping qdisc, EAGAIN): lost, as on a
                # link; the retry below sends it again. Anything else is the path's.
                if exc.errno not in _NO_ROOM:
                    raise AggregatorUnavailable(f"cannot send the {what} to the aggregator "
                                                f"at {where}: {exc}") from None
            retry = min(time.monotonic() + RETRY_SECONDS, deadline)
            while (left := retry - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(65536)
                except socket.timeout:
                    break
                except ConnectionRefusedError:  # ICMP port unreachable: nobody listens
                    raise AggregatorUnavailable(
                        f"no aggregator listens at {where} (port unreachable)") from None
                if len(data) < HEADER_BYTES + 8:
                    continue
                head, reply = read_control(data)
                wanted = FLAG_CONTROL | FLAG_RESULT
                if head["flags"] & wanted == wanted and head["job"] == job and \
                        reply[0] == body[0]:
                    if head["version"] != PROTOCOL_VERSION:  # the header's first byte: any
                        raise ValueError(           # version puts it there
                            f"the aggregator at {where} speaks protocol version "
                            f"{head['version']}, this worker version {PROTOCOL_VERSION}: "
                            f"{what} refused")
                    caps = int(reply[2]) if len(reply) > 2 else 0
                    return ControlReply(
                        int(reply[1]), caps, int(reply[3]) if len(reply) > 3 else -1,
                        tuple(int(p) for p in reply[4:]) if caps & CAP_SHARDS else ())
            if time.monotonic() >= deadline:
                raise AggregatorUnavailable(
                    f"the aggregator at {where} did not answer the {what} within {timeout:g} s")
    finally:
        sock.settimeout(None)
        _hear_errors(sock, False)


__all__ = [name for name in dir() if name.startswith(("CTRL_", "FAULT_", "CAP_")) or
           name.endswith("_STATUS")] + ["JOIN_VERSION", "JOIN_MTU", "RETRY_SECONDS",
                                         "control_packet", "read_control",
                                         "status_text", "control_exchange", "control_request",
                                         "ControlReply",
                                         "encode_faults",
                                         "decode_faults"]
