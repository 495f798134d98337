"""The INA wire format: one UDP header shared by workers, the software switch and P4.

Every constant of the format is written here once; the Cython packet code
(_fast/packet.pyx) reads its offsets from this module when it is imported, and
docs/protocol.md draws the same layout. All fields and the int32 payload are in
network byte order, because a P4 parser reads them so.

    offset size  field
     0     1     version          PROTOCOL_VERSION
     1     1     flags            FLAG_RESULT | FLAG_RETRANSMIT | FLAG_CONTROL
     2     2     job id
     4     2     worker id        0 .. n-1 within the job
     6     1     slot version     0 or 1 (SwitchML's shadow copy)
     7     1     reserved         0
     8     4     slot index       0 .. S-1
    12     4     element offset   of the chunk's first element in the tensor
    16     2     element count    1 .. K
    18     2     exponent         int16: the chunk's agreed block exponent e
    20     2     next proposal    int16: this worker's e for the slot's next chunk
    22     2     reserved         0
    24     4*c   payload          c int32 values

``scapy`` users get the same header as a Layer: ``INA`` (bound to UDP port
``UDP_PORT``); importing it is deferred so that the core never loads scapy.
"""
from __future__ import annotations

import struct
from typing import Any

PROTOCOL_VERSION = 1
UDP_PORT = 47474  # the aggregator's well-known port (workers listen on any port)

FLAG_RESULT = 0x01       # aggregator -> worker: the slot's sum
FLAG_RETRANSMIT = 0x02   # worker -> aggregator: a resend after a timeout
FLAG_CONTROL = 0x04      # join / leave / probe, no payload aggregation

HEADER = struct.Struct("!BBHHBxIIHhhxx")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 24

OFF_VERSION = 0
OFF_FLAGS = 1
OFF_JOB = 2
OFF_WORKER = 4
OFF_SLOT_VERSION = 6
OFF_SLOT = 8
OFF_OFFSET = 12
OFF_COUNT = 16
OFF_EXPONENT = 18
OFF_PROPOSAL = 20
OFF_PAYLOAD = HEADER_BYTES

ELEMENT_BYTES = 4  # int32
MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
MAX_ELEMENTS = (MAX_DATAGRAM - HEADER_BYTES) // ELEMENT_BYTES  # K on loopback


def elements_for_mtu(mtu: int) -> int:
    """The largest K whose packet fits a link MTU (IPv4 20 + UDP 8 bytes of headers)."""
    k = (min(mtu - 28, MAX_DATAGRAM) - HEADER_BYTES) // ELEMENT_BYTES
    if k < 1:
        raise ValueError(f"MTU {mtu} leaves no room for a payload after the "
                         f"{HEADER_BYTES + 28} bytes of headers")
    return k


# Control packets (FLAG_CONTROL): the payload is int32 values, the first one the op.
# Replies carry FLAG_CONTROL | FLAG_RESULT and the payload [op, status].
CTRL_JOIN = 1     # [JOIN, n workers, K, S]: the sender is worker `worker` of job `job`
CTRL_LEAVE = 2    # [LEAVE]: the sender is done; the job is freed when all have left
CTRL_PROBE = 3    # [PROBE]: job 0: is an aggregator there? job j: am I worker w of job j?
CTRL_FAULTS = 4   # [FAULTS, then FAULT_FIELDS in order] (probabilities in ppm, delays in us)
CTRL_WAKE = 5     # [WAKE]: the software switch's P4Runtime thread wakes its data path
FAULT_FIELDS = ("drop_in", "drop_out", "duplicate_in", "duplicate_out", "reorder_in",
                "reorder_out", "delay_ms_in", "delay_ms_out")
JOIN_STATUS = ("accepted", "bad parameters", "job exists with other parameters",
               "worker id taken by another address", "no room for the job",
               "the job is configured by a controller (P4Runtime)")
# A probe for job j is answered 0 only if the sender is worker w of job j at its address
# (a P4 switch answers only then, and stays silent otherwise).
PROBE_STATUS = ("installed", "not installed at this address")
MAX_WORKERS = 64  # one bit each in the switch's per-slot bitmap

# Why an aggregator drops a data packet: the software switch's counters and the P4
# program's drop counter share this order (the index is the counter's).
DROP_REASONS = ("malformed", "unknown job", "unknown worker", "bad slot", "mismatched chunk",
                "duplicate in progress", "injected loss in", "injected loss out",
                "result from a worker")


# What a worker's parser says of a received packet: 0 accepts it, any other value is
# the reason it was dropped (the index into PARSE_STATUS, counted by the transport).
PARSE_OK = 0
PARSE_STATUS = ("ok", "short", "version", "not a result", "foreign job", "bad count",
                "out of range", "misaligned", "bad exponent")
(PARSE_SHORT, PARSE_VERSION, PARSE_NOT_RESULT, PARSE_JOB, PARSE_COUNT, PARSE_RANGE,
 PARSE_MISALIGNED, PARSE_EXPONENT) = range(1, len(PARSE_STATUS))

# Exponent proposals: a worker with nothing more for a slot proposes this, which
# loses every max; block exponents themselves never go below the dtype's floor.
PROPOSAL_NONE = -32768


def pack_header(*, flags: int, job: int, worker: int, slot_version: int, slot: int,
                offset: int, count: int, exponent: int, proposal: int,
                version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(version, flags, job, worker, slot_version, slot, offset, count,
                       exponent, proposal)


def unpack_header(data: bytes | memoryview) -> dict[str, int]:
    if len(data) < HEADER_BYTES:
        raise ValueError(f"an INA packet has at least {HEADER_BYTES} bytes, got {len(data)}")
    fields = HEADER.unpack_from(data)
    names = ("version", "flags", "job", "worker", "slot_version", "slot", "offset", "count",
             "exponent", "proposal")
    return dict(zip(names, fields))


def __getattr__(name: str) -> Any:
    if name == "INA":
        from ._scapy_layer import INA
        return INA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
