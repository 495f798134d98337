"""The INA header: the one table of its fields, and every form made from it.

``FIELDS`` is the wire format, written once. From it come the ``struct`` layout and the
``OFF_*`` offsets (which the compiled modules in _fast/ read at import), the scapy layer
(scapy_layer.py), the P4 header that p4/gen.py emits, and the table in
docs/protocol.md (``markdown_table``; a test checks the document against it). All
fields and the int32 payload are in network byte order, because a P4 parser reads them
so.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

# 2: the reserved byte became seq, the flag NACK came (docs/protocol-recovery.md, Loss). 3: an
# exponent per sub-block of B values after the header, and 16-bit values. A packet of
# another version is dropped as malformed; a join of another version is refused, naming
# both (protocol/control.py), so a mixed job fails to join, not to add. 4: the call
# number, the quorum a chunk completes at, the job's mode and the contributors of a
# result (docs/quorum.md).
PROTOCOL_VERSION = 4
UDP_PORT = 47474  # the aggregator's well-known port (workers listen on any port)

FLAG_RESULT = 0x01       # aggregator -> worker: the slot's sum
FLAG_RETRANSMIT = 0x02   # worker -> aggregator: a resend after a timeout
FLAG_CONTROL = 0x04      # join / leave / probe, no payload aggregation
FLAG_NACK = 0x08         # aggregator -> one worker: your packet for this chunk never came
FLAG_OPEN = 0x10         # a call's opening: its identity and first exponents, no values
FLAG_MISMATCH = 0x20     # a result: the workers' identities differed (an opening's, a
                         # predicted chunk's)
FLAG_PREDICTED = 0x40    # a chunk of a call's first window sent without an opening: its
                         # exponents predicted, the call's identity in ``contributors``
FLAG_OVERFLOW = 0x80     # a predicted chunk's result: the workers' exponents differed, the
                         # pairs hold their max, the values are no sum (send it again)
FLAG_NAMES = ("RESULT", "RETRANSMIT", "CONTROL", "NACK", "OPEN", "MISMATCH", "PREDICTED",
              "OVERFLOW")  # bit 0 .. 7

# Exponent proposals: a worker with nothing more for a slot proposes this, which
# loses every max; block exponents themselves never go below the dtype's floor.
PROPOSAL_NONE = -32768
# A worker whose input holds a NaN or an Inf proposes this from then on, for every
# sub-block: it wins every max, so each result of such a packet tells every worker (the
# call then takes the exact path on every rank alike, with no vote; docs/protocol.md).
NONFINITE_MARK = 32767

# Values: int32 (the default) or int16, a job's choice (settings: switch_value_bits).
VALUE_BITS = (32, 16)
# Sub-blocks: B values share an exponent; B a power of two up to 64 (a job's choice,
# settings: switch_block). After the header come ceil(count / B) pairs (exponent,
# proposal), int16 each, then the count values.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BLOCK = 32
PAIR_BYTES = 4

class Field(NamedTuple):
    name: str        # the Python name (pack_header's keyword, unpack_header's key)
    p4: str          # the field's name in the P4 header ina_t
    bits: int
    signed: bool
    title: str       # docs/protocol.md's column
    meaning: str


FIELDS: tuple[Field, ...] = (
    Field("version", "version", 8, False, "version", f"`{PROTOCOL_VERSION}`"),
    Field("flags", "flags", 8, False, "flags",
          "`0x01` RESULT (aggregator to worker), `0x02` RETRANSMIT (a worker's resend; "
          "with count 0 and no payload, a result request), `0x04` CONTROL "
          "(join/leave/probe: no aggregation), `0x08` NACK (software aggregator to one "
          "worker, header only: its packets numbered seq .. seq + count - 1 never came; "
          "count 0: \"held\", its resent packet is here and the cell waits for a peer's), "
          "`0x10` OPEN (a call's opening: count 0, no values; the offset and the pairs' "
          "exponents carry the call's identity, the proposals its first exponents; "
          "docs/protocol.md, A call's opening), `0x20` MISMATCH (a result: the workers' "
          "identities differed), `0x40` PREDICTED (a chunk of a call's first window sent "
          "without an opening: predicted exponents, the identity in contributors; "
          "docs/protocol.md, One round trip), `0x80` OVERFLOW (a predicted chunk's result: "
          "the workers' exponents differed, the pairs hold their max; send it again)"),
    Field("job", "job_id", 16, False, "job id", "the job this packet belongs to"),
    Field("worker", "worker_id", 16, False, "worker id", "0 .. n-1 within the job"),
    Field("slot_version", "slot_version", 8, False, "slot version",
          "0 or 1: which of the slot's two shadow copies (SwitchML)"),
    Field("seq", "seq", 8, False, "packet number",
          "worker to aggregator: the worker's count of new packets mod 256 (a "
          "retransmission repeats its original's); in a NACK the first missing number, "
          "count saying how many (docs/protocol-recovery.md, Loss)"),
    Field("slot", "slot", 32, False, "slot index", "0 .. S-1"),
    Field("offset", "offset", 32, False, "element offset",
          "index of the chunk's first element in the tensor"),
    Field("count", "count", 16, False, "element count",
          "1 .. K; the payload holds exactly this many values"),
    Field("blocks", "blocks", 16, False, "sub-blocks",
          "ceil(count / B): the (exponent, proposal) pairs between header and values"),
    Field("value_bits", "value_bits", 8, False, "value bits",
          "32 or 16: the width of each value (a job's; control packets: 32)"),
    Field("block", "block", 8, False, "sub-block size",
          "B, values per sub-block: 1, 2, 4 .. 64 (a job's; control packets: 0)"),
    Field("epoch", "epoch", 16, False, "epoch",
          "the run's epoch: drawn by rank 0 at init, the same on every worker of the run; "
          "a cell last used in another epoch counts as idle (stale state of an earlier run "
          "is never answered)"),
    Field("call", "call", 16, False, "call",
          "the call's number in the run (mod 65536), the same on every worker: with the "
          "offset, which chunk a packet is of (a late packet of a finished chunk is told "
          "from the next use of its cell)"),
    Field("quorum", "quorum", 8, False, "quorum",
          "k: the chunk is complete when k workers contributed (0: all n, sync); the "
          "workers stamp the call's mode, a result repeats its cell's"),
    Field("mode_quorum", "mode_quorum", 8, False, "mode quorum",
          "results: the k the job's mode asks for now (0: sync), set by the control plane; "
          "the workers adopt it at a call boundary (workers send 0)"),
    Field("mode_generation", "mode_generation", 32, False, "mode generation",
          "results: the number of the job's latest mode change (workers send 0)"),
    Field("contributors", "contributors", 64, False, "contributors",
          "results: bit w set if worker w was counted in the sum (their number divides "
          "an AVERAGE); workers: the call's identity in a PREDICTED packet, else 0"),
)
RESERVED: tuple[str, ...] = ()  # fields that must be 0 (none now)

_CODES = {(8, False): "B", (16, False): "H", (16, True): "h", (32, False): "I",
          (32, True): "i", (64, False): "Q"}
HEADER = struct.Struct("!" + "".join(_CODES[f.bits, f.signed] for f in FIELDS))
HEADER_BYTES = HEADER.size
OFFSETS: dict[str, int] = {}
_at = 0
for _f in FIELDS:
    OFFSETS[_f.name] = _at
    _at += _f.bits // 8
assert _at == HEADER_BYTES == 40

OFF_VERSION = OFFSETS["version"]
OFF_FLAGS = OFFSETS["flags"]
OFF_JOB = OFFSETS["job"]
OFF_WORKER = OFFSETS["worker"]
OFF_SLOT_VERSION = OFFSETS["slot_version"]
OFF_SLOT = OFFSETS["slot"]
OFF_OFFSET = OFFSETS["offset"]
OFF_COUNT = OFFSETS["count"]
OFF_BLOCKS = OFFSETS["blocks"]
OFF_VALUE_BITS = OFFSETS["value_bits"]
OFF_BLOCK = OFFSETS["block"]
OFF_EPOCH = OFFSETS["epoch"]
OFF_SEQ = OFFSETS["seq"]
OFF_CALL = OFFSETS["call"]
OFF_QUORUM = OFFSETS["quorum"]
OFF_MODE_QUORUM = OFFSETS["mode_quorum"]
OFF_MODE_GENERATION = OFFSETS["mode_generation"]
OFF_CONTRIBUTORS = OFFSETS["contributors"]
OFF_PAYLOAD = HEADER_BYTES

MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
MAX_WORKERS = 64  # one bit each in the switch's per-slot bitmap


def sub_blocks(count: int, block: int) -> int:
    """The (exponent, proposal) pairs a packet of count values carries."""
    return -(-count // block)


def packet_bytes(count: int, block: int, value_bits: int) -> int:
    """A data packet's length: header, ceil(count / B) pairs, count values."""
    return HEADER_BYTES + PAIR_BYTES * sub_blocks(count, block) + value_bits // 8 * count


def max_elements(datagram: int, block: int, value_bits: int) -> int:
    """The largest K whose packet fits a UDP payload of ``datagram`` bytes."""
    room = datagram - HEADER_BYTES
    whole = room // (PAIR_BYTES + block * value_bits // 8)  # full sub-blocks
    rest = room - whole * (PAIR_BYTES + block * value_bits // 8) - PAIR_BYTES
    return whole * block + max(0, min(block - 1, rest // (value_bits // 8)))


def check_format(block: int, value_bits: int) -> None:
    """ValueError naming a sub-block size or value width this protocol does not have."""
    if block not in BLOCK_SIZES:
        raise ValueError(f"sub-block size B must be one of {BLOCK_SIZES}, got {block}")
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value bits must be 32 or 16, got {value_bits}")


@dataclass(frozen=True)
class JobFormat:
    """A job's packets, as its workers and aggregator take them at the join: the job's
    id, its n workers, chunks of k values, sub-blocks of ``block`` (one exponent each),
    values ``value_bits`` wide (the job's widest: a call may go narrower)."""

    job: int
    n: int
    k: int
    block: int = DEFAULT_BLOCK
    value_bits: int = 32

    def __post_init__(self) -> None:
        check_format(self.block, self.value_bits)
        if not 0 <= self.job < 65536:
            raise ValueError(f"job {self.job} is not 0..65535")
        if not 1 <= self.n <= MAX_WORKERS:
            raise ValueError(f"a job has 1..{MAX_WORKERS} workers, not {self.n}")
        if self.k < 1:
            raise ValueError(f"a job needs K >= 1, not {self.k}")


@dataclass(frozen=True)
class Stamp:
    """What one worker's data packets say besides their values: the worker, and where
    each chunk goes, chunk c in slot c % slots with version (c // slots + version_base)
    % 2; their flags and the run's epoch."""

    worker: int
    slots: int
    version_base: int = 0
    flags: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if not 0 <= self.epoch < 65536:
            raise ValueError(f"epoch {self.epoch} is not 0..65535")


# K on loopback (64 KiB datagrams), for the default format.
MAX_ELEMENTS = max_elements(MAX_DATAGRAM, DEFAULT_BLOCK, 32)
# The most values any packet of any format may carry (B 64, 16 bits): buffers' bound.
MAX_ANY_ELEMENTS = max_elements(MAX_DATAGRAM, 64, 16)


# IPv4 (20) and UDP (8) headers: what a datagram adds to its payload on a link.
IP_UDP_HEADER_BYTES = 28


def elements_for_mtu(mtu: int, block: int = DEFAULT_BLOCK, value_bits: int = 32) -> int:
    """The largest K whose packet fits a link MTU (IPv4 20 + UDP 8 bytes of headers)."""
    check_format(block, value_bits)
    k = max_elements(min(mtu - IP_UDP_HEADER_BYTES, MAX_DATAGRAM), block, value_bits)
    if k < 1:
        raise ValueError(f"MTU {mtu} leaves no room for a payload after the "
                         f"{HEADER_BYTES + IP_UDP_HEADER_BYTES} bytes of headers")
    return k


# Why an aggregator drops a data packet: the software switch's counters and the P4
# program's drop counter share this order (the index is the counter's).
DROP_REASONS = ("malformed", "unknown job", "unknown worker", "bad slot", "mismatched chunk",
                "duplicate in progress", "injected loss in", "injected loss out",
                "result from a worker", "stale", "late")


# What a worker's parser says of a received packet: 0 accepts it, any other value is
# the reason it was dropped (the index into PARSE_STATUS, counted by the transport).
PARSE_OK = 0
PARSE_STATUS = ("ok", "short", "version", "not a result", "foreign job", "bad count",
                "out of range", "misaligned", "bad exponent", "format")
(PARSE_SHORT, PARSE_VERSION, PARSE_NOT_RESULT, PARSE_JOB, PARSE_COUNT, PARSE_RANGE,
 PARSE_MISALIGNED, PARSE_EXPONENT, PARSE_FORMAT) = range(1, len(PARSE_STATUS))


_DATA_FIELDS = tuple(f.name for f in FIELDS if f.name not in RESERVED)


def pack_header(*, flags: int, job: int, worker: int, slot_version: int, slot: int,
                offset: int, count: int, blocks: int = 0, value_bits: int = 32,
                block: int = 0, epoch: int = 0, seq: int = 0, call: int = 0,
                quorum: int = 0, mode_quorum: int = 0, mode_generation: int = 0,
                contributors: int = 0, version: int = PROTOCOL_VERSION) -> bytes:
    values = dict(version=version, flags=flags, job=job, worker=worker,
                  slot_version=slot_version, slot=slot, offset=offset, count=count,
                  blocks=blocks, value_bits=value_bits, block=block, epoch=epoch, seq=seq,
                  call=call, quorum=quorum, mode_quorum=mode_quorum,
                  mode_generation=mode_generation, contributors=contributors)
    return HEADER.pack(*(values[f.name] for f in FIELDS))


def pack_data(values, *, exponents=None, proposals=None, block: int = DEFAULT_BLOCK,
              value_bits: int = 32, **fields: int) -> bytes:
    """A whole data packet: the header (``fields`` as pack_header takes them; count and
    blocks from the values), the sub-blocks' pairs (exponents 0 and proposals none
    unless given) and the values, int32 or int16 in network order. For tests, benchmarks
    and tools; the workers' packets come from the compiled fast path."""
    import numpy as np

    values = np.asarray(values).astype(">i4" if value_bits == 32 else ">i2")
    blocks = sub_blocks(values.size, block)
    pairs = np.empty((blocks, 2), ">i2")
    pairs[:, 0] = 0 if exponents is None else exponents
    pairs[:, 1] = PROPOSAL_NONE if proposals is None else proposals
    return (pack_header(count=values.size, blocks=blocks, value_bits=value_bits,
                        block=block, **fields) + pairs.tobytes() + values.tobytes())


def unpack_header(data: bytes | memoryview) -> dict[str, int]:
    """The header's fields by name (the reserved ones left out)."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"an INA packet has at least {HEADER_BYTES} bytes, got {len(data)}")
    fields = dict(zip((f.name for f in FIELDS), HEADER.unpack_from(data)))
    return {name: fields[name] for name in _DATA_FIELDS}


def p4_header(type_name: str = "ina_t") -> str:
    """The P4-16 header declaration of FIELDS (p4/gen.py emits it)."""
    lines = [f"header {type_name} {{"]
    for f in FIELDS:
        note = ""
        lines.append(f"    bit<{f.bits}>{' ' * (3 - len(str(f.bits)))}{f.p4};{note}")
    lines.append("}")
    return "\n".join(lines)


def markdown_table() -> str:
    """docs/protocol.md's header table."""
    rows = ["| offset | size | field | meaning |", "| ---: | ---: | --- | --- |"]
    for f in FIELDS:
        rows.append(f"| {OFFSETS[f.name]} | {f.bits // 8} | {f.title} | {f.meaning} |")
    rows.append(f"| {HEADER_BYTES} | {PAIR_BYTES} x sub-blocks | exponents | per sub-block: "
                "int16 exponent e of its values (docs/quantization.md), int16 proposal for "
                f"the slot's next chunk (the switch keeps the max; `{PROPOSAL_NONE}` = "
                f"none, `{NONFINITE_MARK}` = the sender met a NaN or an Inf) |")
    rows.append(f"| {HEADER_BYTES} + {PAIR_BYTES} x sub-blocks | value bits / 8 x count | "
                "values | int32 or int16, two's complement |")
    return "\n".join(rows)


__all__ = [name for name in dir() if name.isupper() and not name.startswith("_")] + [
    "Field", "JobFormat", "Stamp", "elements_for_mtu", "pack_data", "sub_blocks",
    "packet_bytes", "max_elements", "check_format", "pack_header", "unpack_header",
    "p4_header", "markdown_table"]
