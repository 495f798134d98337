# cython: language_level=3
"""INA packets, compiled: the same functions as ina_collectives.packets.

The header layout is read from ina_collectives.protocol when this module is imported,
so the wire format is written in one place; payload loops are blockfp's C kernels.
"""
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

import numpy as np

from blockfp_kernels cimport (KIND_F32, KIND_F64, KIND_I32, Kind, dequantize_block,
                              quantize_block)

from ina_collectives import blockfp as ref_blockfp
from ina_collectives import packets as ref
from ina_collectives import protocol as P

cdef Py_ssize_t HEADER = P.HEADER_BYTES
cdef Py_ssize_t OFF_VERSION = P.OFF_VERSION, OFF_FLAGS = P.OFF_FLAGS, OFF_JOB = P.OFF_JOB
cdef Py_ssize_t OFF_WORKER = P.OFF_WORKER, OFF_SLOT_VERSION = P.OFF_SLOT_VERSION
cdef Py_ssize_t OFF_SLOT = P.OFF_SLOT, OFF_OFFSET = P.OFF_OFFSET, OFF_COUNT = P.OFF_COUNT
cdef Py_ssize_t OFF_EXPONENT = P.OFF_EXPONENT, OFF_PROPOSAL = P.OFF_PROPOSAL
cdef int VERSION = P.PROTOCOL_VERSION, FLAG_RESULT = P.FLAG_RESULT
cdef int PROPOSAL_NONE = P.PROPOSAL_NONE
cdef int PARSE_OK = P.PARSE_OK, PARSE_SHORT = P.PARSE_SHORT
cdef int PARSE_VERSION = P.PARSE_VERSION, PARSE_NOT_RESULT = P.PARSE_NOT_RESULT
cdef int PARSE_JOB = P.PARSE_JOB, PARSE_COUNT = P.PARSE_COUNT, PARSE_RANGE = P.PARSE_RANGE
cdef int PARSE_MISALIGNED = P.PARSE_MISALIGNED, PARSE_EXPONENT = P.PARSE_EXPONENT


cdef inline void put16(uint8_t *p, uint16_t v) noexcept nogil:
    p[0] = v >> 8
    p[1] = v & 0xff


cdef inline void put32(uint8_t *p, uint32_t v) noexcept nogil:
    v = __builtin_bswap32(v)
    memcpy(p, &v, 4)


cdef inline uint16_t get16(const uint8_t *p) noexcept nogil:
    return (p[0] << 8) | p[1]


cdef inline uint32_t get32(const uint8_t *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return __builtin_bswap32(v)


cdef extern from *:
    uint32_t __builtin_bswap32(uint32_t) nogil


cdef Py_ssize_t write_packet(uint8_t *row, const char *x, Py_ssize_t size, Kind kind,
                             Py_ssize_t chunk, Py_ssize_t k, int n, int exponent,
                             int proposal, uint32_t slot, int slot_version, int job,
                             int worker, int flags) noexcept nogil:
    """Chunk ``chunk`` of x (size elements) as a packet in row; returns its length."""
    cdef Py_ssize_t start = chunk * k
    cdef Py_ssize_t count = min(k, size - start)
    cdef Py_ssize_t itemsize = 4 if kind != KIND_F64 else 8
    row[OFF_VERSION] = VERSION
    row[OFF_FLAGS] = flags
    put16(row + OFF_JOB, job)
    put16(row + OFF_WORKER, worker)
    row[OFF_SLOT_VERSION] = slot_version
    row[OFF_SLOT_VERSION + 1] = 0
    put32(row + OFF_SLOT, slot)
    put32(row + OFF_OFFSET, <uint32_t>start)
    put16(row + OFF_COUNT, <uint16_t>count)
    put16(row + OFF_EXPONENT, <uint16_t><int16_t>exponent)
    put16(row + OFF_PROPOSAL, <uint16_t><int16_t>proposal)
    put16(row + OFF_PROPOSAL + 2, 0)
    quantize_block(x + start * itemsize, count, kind, exponent, n,
                   <uint32_t *>(row + HEADER))
    return HEADER + 4 * count


cdef int parse_result(const uint8_t *pkt, Py_ssize_t length, char *out, Py_ssize_t size,
                      Kind kind, Py_ssize_t k, int n, bint average, int job,
                      int exponent_min, int exponent_max) noexcept nogil:
    """Check a result packet; if good, write its chunk into out (size elements)."""
    if length < HEADER:
        return PARSE_SHORT
    if pkt[OFF_VERSION] != VERSION:
        return PARSE_VERSION
    if not (pkt[OFF_FLAGS] & FLAG_RESULT):
        return PARSE_NOT_RESULT
    if get16(pkt + OFF_JOB) != job:
        return PARSE_JOB
    cdef Py_ssize_t offset = get32(pkt + OFF_OFFSET)
    cdef Py_ssize_t count = get16(pkt + OFF_COUNT)
    cdef int exponent = <int16_t>get16(pkt + OFF_EXPONENT)
    if offset % k:
        return PARSE_MISALIGNED
    if offset >= size:
        return PARSE_RANGE
    if count != min(k, size - offset) or length != HEADER + 4 * count:
        return PARSE_COUNT
    if exponent < exponent_min or exponent > exponent_max:
        return PARSE_EXPONENT
    cdef Py_ssize_t itemsize = 4 if kind != KIND_F64 else 8
    dequantize_block(<const uint32_t *>(pkt + HEADER), count, kind, exponent, n, average,
                     out + offset * itemsize)
    return PARSE_OK


cdef Kind kind_of(object dtype) except *:
    if dtype == np.float32:
        return KIND_F32
    if dtype == np.float64:
        return KIND_F64
    return KIND_I32


def pack_chunks(x, Py_ssize_t k, int n, agreed, local, Py_ssize_t first, Py_ssize_t count,
                rows, Py_ssize_t slots, int version_base, int job, int worker, int flags=0):
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1; returns the
    packets' lengths in bytes."""
    ref.check_chunks(x, k, agreed, local, first, count)
    ref.check_ring(rows, k, count)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if x.dtype == np.int32:
        ref_blockfp.check_int32_headroom(agreed[first:first + count], n, first)
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    cdef Kind kind = kind_of(x.dtype)
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef uint8_t[:, ::1] ring = rows
    cdef const int16_t[::1] a = agreed
    cdef const int16_t[::1] l = local
    lengths = np.empty(count, np.int32)
    cdef int32_t[::1] lens = lengths
    cdef Py_ssize_t size = x.size, nb = a.shape[0], i, c
    cdef int proposal
    if size == 0:
        return lengths
    with nogil:
        for i in range(count):
            c = first + i
            proposal = l[c + slots] if c + slots < nb else PROPOSAL_NONE
            lens[i] = write_packet(&ring[i, 0], <const char *>&raw[0], size, kind, c, k, n, a[c], proposal,
                                   c % slots, ((c // slots) + version_base) & 1, job, worker,
                                   flags)
    return lengths


def unpack_results(rows, lengths, out, int n, Py_ssize_t k, int job, bint average=False):
    """parse_result for each row i (its first lengths[i] bytes); the statuses (uint8)."""
    ref_blockfp.check_kernel_args(out, k)
    ref.check_ring(rows, k, lengths.size)
    if average and out.dtype == np.int32:
        raise ValueError("AVERAGE is not defined for int32")
    cdef int emin = ref_blockfp.EXPONENT_MIN[out.dtype]
    cdef int emax = ref.EXPONENT_MAX[out.dtype]
    target = out.astype(np.float64) if out.dtype == np.float16 else out
    cdef Kind kind = kind_of(target.dtype)
    cdef unsigned char[::1] raw = target.view(np.uint8)
    cdef const uint8_t[:, ::1] ring = rows
    cdef const int32_t[::1] lens = np.ascontiguousarray(lengths, np.int32)
    status = np.empty(lens.shape[0], np.uint8)
    cdef uint8_t[::1] st = status
    cdef Py_ssize_t i, size = out.size, width = rows.shape[1]
    if size == 0:
        status[:] = PARSE_RANGE
        return status
    with nogil:
        for i in range(lens.shape[0]):
            st[i] = parse_result(&ring[i, 0], min(<Py_ssize_t>lens[i], width),
                                 <char *>&raw[0], size,
                                 kind, k, n, average, job, emin, emax)
    if target is not out:
        out[...] = target
    return status
