"""Packetization (NumPy reference): chunks of a tensor into INA packets, results back.

The oracle of _fast/packet.pyx, with the same functions and the same bytes. A packet
ring is a 2-D uint8 array, one row per packet buffer, at least HEADER_BYTES + 4 K wide.
Chunk c of a tensor covers elements [c K, c K + K) and travels in slot c mod S with
slot version ((c div S) + version_base) mod 2; its packet proposes the exponent of the
chunk that will use the slot next, c + S (PROPOSAL_NONE if there is none).
"""
from __future__ import annotations

import numpy as np

from ... import protocol as P
from . import blockfp

# The exponents a result may carry, per output dtype (int32 results carry 0..32).
EXPONENT_MAX = {np.dtype(np.float16): 16, np.dtype(np.float32): 128,
                np.dtype(np.float64): 1024, np.dtype(np.int32): 32}


def check_ring(rows: np.ndarray, k: int, needed: int) -> None:
    if rows.dtype != np.uint8 or rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("a packet ring is a C-contiguous 2-D uint8 array")
    if rows.shape[1] < P.HEADER_BYTES + P.ELEMENT_BYTES * k:
        raise ValueError(f"packet rows of {rows.shape[1]} bytes cannot hold a header and "
                         f"{k} elements ({P.HEADER_BYTES + P.ELEMENT_BYTES * k} bytes)")
    if rows.shape[0] < needed:
        raise ValueError(f"{needed} packets do not fit a ring of {rows.shape[0]} rows")


def check_chunks(x: np.ndarray, k: int, agreed: np.ndarray, local: np.ndarray, first: int,
                 count: int) -> None:
    blockfp.check_kernel_args(x, k)
    nb = blockfp.nblocks(x.size, k)
    for name, exps in (("agreed", agreed), ("local", local)):
        if exps.shape != (nb,):
            raise ValueError(f"{name} exponents: expected {nb}, got shape {exps.shape}")
    if first < 0 or count < 0 or first + count > nb:
        raise ValueError(f"chunks {first}..{first + count - 1} are outside the tensor's "
                         f"{nb} chunks")


def pack_chunks(x: np.ndarray, k: int, n: int, agreed: np.ndarray, local: np.ndarray,
                first: int, count: int, rows: np.ndarray, slots: int, version_base: int,
                job: int, worker: int, flags: int = 0, epoch: int = 0) -> np.ndarray:
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1; returns the
    packets' lengths in bytes."""
    check_chunks(x, k, agreed, local, first, count)
    check_ring(rows, k, count)
    if x.dtype.kind == "i":
        blockfp.check_int32_headroom(agreed[first:first + count], n, first)
    lengths = np.empty(count, np.int32)
    nb = blockfp.nblocks(x.size, k)
    for i, c in enumerate(range(first, first + count)):
        start, stop = c * k, min(c * k + k, x.size)
        proposal = int(local[c + slots]) if c + slots < nb else P.PROPOSAL_NONE
        header = P.pack_header(flags=flags, job=job, worker=worker,
                               slot_version=((c // slots) + version_base) & 1,
                               slot=c % slots, offset=start, count=stop - start,
                               exponent=int(agreed[c]), proposal=proposal, epoch=epoch)
        payload = blockfp.quantize(x[start:stop], agreed[c:c + 1], n, k).view(np.uint8)
        rows[i, :P.HEADER_BYTES] = np.frombuffer(header, np.uint8)
        rows[i, P.HEADER_BYTES:P.HEADER_BYTES + payload.size] = payload
        lengths[i] = P.HEADER_BYTES + payload.size
    return lengths


def parse_result(packet: np.ndarray, out: np.ndarray, n: int, k: int, job: int,
                 average: bool = False) -> int:
    """Check one result packet and, if it is good, write its chunk into out.

    Returns PARSE_OK or the PARSE_* reason it was dropped (nothing written then).
    """
    if packet.size < P.HEADER_BYTES:
        return P.PARSE_SHORT
    h = P.unpack_header(packet.tobytes()[:P.HEADER_BYTES])
    if h["version"] != P.PROTOCOL_VERSION:
        return P.PARSE_VERSION
    if not h["flags"] & P.FLAG_RESULT:
        return P.PARSE_NOT_RESULT
    if h["job"] != job:
        return P.PARSE_JOB
    if h["offset"] % k:
        return P.PARSE_MISALIGNED
    if h["offset"] >= out.size:
        return P.PARSE_RANGE
    if (h["count"] != min(k, out.size - h["offset"])
            or packet.size != P.HEADER_BYTES + P.ELEMENT_BYTES * h["count"]):
        return P.PARSE_COUNT
    if not blockfp.EXPONENT_MIN[out.dtype] <= h["exponent"] <= EXPONENT_MAX[out.dtype]:
        return P.PARSE_EXPONENT
    start, stop = h["offset"], h["offset"] + h["count"]
    q = packet[P.HEADER_BYTES:].view(">i4")
    blockfp.dequantize(q, np.array([h["exponent"]], np.int16), n, k, out[start:stop],
                       average)
    return P.PARSE_OK


def unpack_results(rows: np.ndarray, lengths: np.ndarray, out: np.ndarray, n: int, k: int,
                   job: int, average: bool = False) -> np.ndarray:
    """parse_result for each row i (its first lengths[i] bytes); the statuses (uint8)."""
    blockfp.check_kernel_args(out, k)
    check_ring(rows, k, lengths.size)
    status = np.empty(lengths.size, np.uint8)
    for i, length in enumerate(lengths):
        status[i] = parse_result(rows[i, :min(int(length), rows.shape[1])], out, n, k, job,
                                 average)
    return status
