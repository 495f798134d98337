# cython: language_level=3
"""INA packets, compiled: the same functions as ina_collectives.ina.reference.packet.

The header layout is read from ina_collectives.protocol when this module is imported,
so the wire format is written in one place; payload loops are blockfp's C kernels.
"""
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t

import numpy as np

from blockfp_kernels cimport KIND_F32, KIND_F64, KIND_I32

from ina_collectives.ina.reference import blockfp as ref_blockfp
from ina_collectives.ina.reference import packet as ref
from ina_collectives import protocol as P

include "header.pxi"
include "wire.pxi"


cdef Kind kind_of(object dtype) except *:
    if dtype == np.float32:
        return KIND_F32
    if dtype == np.float64:
        return KIND_F64
    return KIND_I32


def pack_chunks(x, fmt, agreed, local, Py_ssize_t first, Py_ssize_t count, rows, stamp):
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1, as ``fmt``'s
    (protocol.JobFormat) packets stamped by ``stamp`` (protocol.Stamp); returns the
    packets' lengths in bytes."""
    cdef Py_ssize_t k = fmt.k, block = fmt.block, slots = stamp.slots
    cdef int n = fmt.n, value_bits = fmt.value_bits, version_base = stamp.version_base
    ref.check_chunks(x, k, agreed, local, first, count, block, value_bits)
    ref.check_ring(rows, k, count, block, value_bits)
    cdef Py_ssize_t g = ref_blockfp.sub_blocks_per_chunk(k, block)
    if x.dtype == np.int32:
        ref_blockfp.check_int32_headroom(agreed[first * g:(first + count) * g], n,
                                         first * g)
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    cdef Format f = Format(kind=kind_of(x.dtype), k=k, b=block, bits=value_bits, n=n,
                           average=False)
    cdef Stamp h = Stamp(slot=0, slot_version=0, job=fmt.job, worker=stamp.worker,
                         flags=stamp.flags, epoch=stamp.epoch, call=0, quorum=0)
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef uint8_t[:, ::1] ring = rows
    cdef const int16_t[::1] a = agreed
    cdef const int16_t[::1] loc = local
    lengths = np.empty(count, np.int32)
    cdef int32_t[::1] lens = lengths
    cdef Py_ssize_t size = x.size, nb = ref_blockfp.nblocks(x.size, k), i, c
    if size == 0:
        return lengths
    with nogil:
        for i in range(count):
            c = first + i
            h.slot, h.slot_version = c % slots, ((c // slots) + version_base) & 1
            lens[i] = write_packet(&ring[i, 0], <const char *>&raw[0], size, &f, c,
                                   &a[c * g],
                                   &loc[(c + slots) * g] if c + slots < nb else NULL, &h)
    return lengths


def unpack_results(rows, lengths, out, fmt, bint average=False):
    """parse_result for each row i (its first lengths[i] bytes), of ``fmt``'s
    (protocol.JobFormat) job; the statuses (uint8)."""
    cdef Py_ssize_t k = fmt.k, block = fmt.block
    cdef int value_bits = fmt.value_bits
    ref_blockfp.check_kernel_args(out, k, block, value_bits)
    ref.check_ring(rows, k, lengths.size, block, value_bits)
    if average and out.dtype == np.int32:
        raise ValueError("AVERAGE is not defined for int32")
    cdef int emin = ref_blockfp.EXPONENT_MIN[out.dtype]
    cdef int emax = ref.EXPONENT_MAX[out.dtype]
    target = out.astype(np.float64) if out.dtype == np.float16 else out
    cdef Format f = Format(kind=kind_of(target.dtype), k=k, b=block, bits=value_bits,
                           n=fmt.n, average=average)
    cdef int job = fmt.job
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
                                 <char *>&raw[0], size, &f, job, emin, emax)
    if target is not out:
        out[...] = target
    return status
