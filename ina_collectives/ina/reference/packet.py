"""Packetization (NumPy reference): chunks of a tensor into INA packets, results back.

The oracle of _fast/packet.pyx, with the same functions and the same bytes. A packet
ring is a 2-D uint8 array, one row per packet buffer, wide enough for a packet of K
values (protocol.packet_bytes). Chunk c of a tensor covers elements [c K, c K + K) and
travels in slot c mod S with slot version ((c div S) + version_base) mod 2; after its
header come its sub-blocks' (exponent, proposal) pairs, the proposals being those of
the chunk that will use the slot next, c + S (PROPOSAL_NONE if there is none), then its
values (int32 or int16).
"""
from __future__ import annotations

import numpy as np

from ... import protocol as P
from . import blockfp

# The exponents a result may carry, per output dtype (int32 results carry 0..32).
EXPONENT_MAX = {np.dtype(np.float16): 16, np.dtype(np.float32): 128,
                np.dtype(np.float64): 1024, np.dtype(np.int32): 32}


def check_ring(rows: np.ndarray, k: int, needed: int, block: int = P.DEFAULT_BLOCK,
               value_bits: int = 32) -> None:
    if rows.dtype != np.uint8 or rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("a packet ring is a C-contiguous 2-D uint8 array")
    width = P.packet_bytes(k, block, value_bits)
    if rows.shape[1] < width:
        raise ValueError(f"packet rows of {rows.shape[1]} bytes cannot hold a packet of "
                         f"{k} values ({width} bytes)")
    if rows.shape[0] < needed:
        raise ValueError(f"{needed} packets do not fit a ring of {rows.shape[0]} rows")


def check_chunks(x: np.ndarray, k: int, agreed: np.ndarray, local: np.ndarray, first: int,
                 count: int, block: int = P.DEFAULT_BLOCK, value_bits: int = 32) -> None:
    blockfp.check_kernel_args(x, k, block, value_bits)
    nb = blockfp.nblocks(x.size, k)
    want = blockfp.nexponents(x.size, k, block)
    for name, exps in (("agreed", agreed), ("local", local)):
        if exps.shape != (want,):
            raise ValueError(f"{name} exponents: expected {want}, got shape {exps.shape}")
    if first < 0 or count < 0 or first + count > nb:
        raise ValueError(f"chunks {first}..{first + count - 1} are outside the tensor's "
                         f"{nb} chunks")


def pack_chunks(x: np.ndarray, fmt: P.JobFormat, agreed: np.ndarray, local: np.ndarray,
                first: int, count: int, rows: np.ndarray, stamp: P.Stamp) -> np.ndarray:
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1, as ``fmt``'s
    packets stamped by ``stamp``; returns the packets' lengths in bytes."""
    k, n, block, value_bits = fmt.k, fmt.n, fmt.block, fmt.value_bits
    slots = stamp.slots
    check_chunks(x, k, agreed, local, first, count, block, value_bits)
    check_ring(rows, k, count, block, value_bits)
    g = blockfp.sub_blocks_per_chunk(k, block)
    if x.dtype.kind == "i":
        blockfp.check_int32_headroom(agreed[first * g:(first + count) * g], n, first * g)
    lengths = np.empty(count, np.int32)
    nb = blockfp.nblocks(x.size, k)
    for i, c in enumerate(range(first, first + count)):
        start, stop = c * k, min(c * k + k, x.size)
        blocks = P.sub_blocks(stop - start, block)
        exps = agreed[c * g:c * g + g]
        nxt = c + slots
        proposals = (local[nxt * g:nxt * g + blocks] if nxt < nb
                     else np.full(blocks, P.PROPOSAL_NONE, np.int16))
        header = P.pack_header(flags=stamp.flags, job=fmt.job, worker=stamp.worker,
                               slot_version=((c // slots) + stamp.version_base) & 1,
                               slot=c % slots, offset=start, count=stop - start,
                               blocks=blocks, value_bits=value_bits, block=block,
                               epoch=stamp.epoch)
        pairs = np.stack([exps[:blocks], proposals]).T.astype(">i2").tobytes()
        # The chunk alone is a tensor of one chunk: G exponents.
        values = blockfp.quantize(x[start:stop], exps, n, k, block, value_bits)
        packet = header + pairs + values.tobytes()
        rows[i, :len(packet)] = np.frombuffer(packet, np.uint8)
        lengths[i] = len(packet)
    return lengths


def parse_result(packet: np.ndarray, out: np.ndarray, fmt: P.JobFormat,
                 average: bool = False) -> int:
    """Check one result packet of ``fmt``'s and, if it is good, write its chunk into out.

    Returns PARSE_OK or the PARSE_* reason it was dropped (nothing written then).
    """
    n, k, job, block, value_bits = fmt.n, fmt.k, fmt.job, fmt.block, fmt.value_bits
    if packet.size < P.HEADER_BYTES:
        return P.PARSE_SHORT
    h = P.unpack_header(packet.tobytes()[:P.HEADER_BYTES])
    if h["version"] != P.PROTOCOL_VERSION:
        return P.PARSE_VERSION
    if not h["flags"] & P.FLAG_RESULT:
        return P.PARSE_NOT_RESULT
    if h["job"] != job:
        return P.PARSE_JOB
    if h["value_bits"] != value_bits or h["block"] != block:
        return P.PARSE_FORMAT
    if h["offset"] % k:
        return P.PARSE_MISALIGNED
    if h["offset"] >= out.size:
        return P.PARSE_RANGE
    count, blocks = h["count"], h["blocks"]
    if (count != min(k, out.size - h["offset"]) or blocks != P.sub_blocks(count, block)
            or packet.size != P.packet_bytes(count, block, value_bits)):
        return P.PARSE_COUNT
    pairs = packet[P.HEADER_BYTES:P.HEADER_BYTES + P.PAIR_BYTES * blocks].view(">i2")
    exps = pairs[0::2].astype(np.int16)
    if not ((blockfp.EXPONENT_MIN[out.dtype] <= exps)
            & (exps <= EXPONENT_MAX[out.dtype])).all():
        return P.PARSE_EXPONENT
    start, stop = h["offset"], h["offset"] + count
    q = packet[P.HEADER_BYTES + P.PAIR_BYTES * blocks:].view(">i4" if value_bits == 32
                                                              else ">i2")
    # The chunk alone is a tensor of one chunk: G exponents (those past its end unused).
    g = blockfp.sub_blocks_per_chunk(k, block)
    exps = np.pad(exps, (0, g - blocks), constant_values=blockfp.EXPONENT_MIN[out.dtype])
    blockfp.dequantize(q, exps, n, k, out[start:stop], average, block,
                       h["contributors"].bit_count())
    return P.PARSE_OK


def unpack_results(rows: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                   fmt: P.JobFormat, average: bool = False) -> np.ndarray:
    """parse_result for each row i (its first lengths[i] bytes); the statuses (uint8)."""
    blockfp.check_kernel_args(out, fmt.k, fmt.block, fmt.value_bits)
    check_ring(rows, fmt.k, lengths.size, fmt.block, fmt.value_bits)
    status = np.empty(lengths.size, np.uint8)
    for i, length in enumerate(lengths):
        status[i] = parse_result(rows[i, :min(int(length), rows.shape[1])], out, fmt,
                                 average)
    return status
