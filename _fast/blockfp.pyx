# cython: language_level=3
"""Block floating point, compiled: the same functions as ina_collectives.ina.reference.blockfp.

The per-element loops are the C kernels of blockfp.h; this module walks the blocks
without the GIL and wraps them for Python. ina_collectives.ina.kernels selects it.
"""
from blockfp_kernels cimport *
from libc.stdint cimport INT32_MIN, int16_t, int32_t, uint32_t

import numpy as np

from ina_collectives.ina.reference import blockfp as ref


cdef Kind kind_of(object dtype) except *:
    if dtype == np.float32 or dtype == np.float16:
        return KIND_F32
    if dtype == np.float64:
        return KIND_F64
    if dtype == np.int32:
        return KIND_I32
    raise TypeError(f"block floating point takes float16/32/64 or int32, not {dtype}")


def block_exponents(x, Py_ssize_t k):
    """Each block's exponent proposal (int16) and whether x holds a NaN or an Inf."""
    ref.check_kernel_args(x, k)
    cdef object dtype = x.dtype
    cdef int32_t floor = ref.EXPONENT_MIN[dtype]
    if dtype == np.float16:
        x = x.astype(np.float32)  # exact; the float32 scan then sees the same magnitudes
    cdef Kind kind = kind_of(x.dtype)
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef Py_ssize_t count = x.size, itemsize = x.itemsize
    cdef Py_ssize_t nb = ref.nblocks(count, k), b, start
    exps = np.empty(nb, np.int16)
    cdef int16_t[::1] e = exps
    cdef int32_t got
    cdef bint nonfinite = False
    with nogil:
        for b in range(nb):
            start = b * k
            got = block_exponent(<const char *>&raw[start * itemsize], min(k, count - start),
                                 kind, floor)
            if got == INT32_MIN:
                nonfinite = True
                got = floor
            e[b] = <int16_t>got
    return exps, nonfinite


def quantize(x, exps, int n, Py_ssize_t k):
    """x as int32 in network byte order, block b scaled by its agreed exponent exps[b]."""
    ref.check_kernel_args(x, k)
    ref._check_exps(exps, x.size, k)
    if x.dtype == np.int32:
        ref.check_int32_headroom(exps, n)
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    cdef Kind kind = kind_of(x.dtype)
    out = np.empty(x.size, ">i4")
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef uint32_t[::1] q = out.view(np.uint32)
    cdef const int16_t[::1] e = np.ascontiguousarray(exps, np.int16)
    cdef Py_ssize_t count = x.size, itemsize = x.itemsize, b, start
    with nogil:
        for b in range(e.shape[0]):
            start = b * k
            quantize_block(<const char *>&raw[start * itemsize], min(k, count - start), kind,
                           e[b], n, &q[start])
    return out


def dequantize(q, exps, int n, Py_ssize_t k, out, bint average=False):
    """Write the aggregated int32 payload q (network order) into out, in out's dtype."""
    ref.check_kernel_args(out, k)
    ref._check_exps(exps, out.size, k)
    if q.size != out.size:
        raise ValueError(f"{q.size} aggregated values for an output of {out.size}")
    if average and out.dtype == np.int32:
        raise ValueError("AVERAGE is not defined for int32")
    target = np.empty(out.size, np.float64) if out.dtype == np.float16 else out
    cdef Kind kind = kind_of(target.dtype)
    cdef unsigned char[::1] raw = target.view(np.uint8)
    cdef const uint32_t[::1] qv = np.ascontiguousarray(q).view(np.uint32)
    cdef const int16_t[::1] e = np.ascontiguousarray(exps, np.int16)
    cdef Py_ssize_t count = out.size, itemsize = target.itemsize, b, start
    with nogil:
        for b in range(e.shape[0]):
            start = b * k
            dequantize_block(&qv[start], min(k, count - start), kind, e[b], n, average,
                             <char *>&raw[start * itemsize])
    if target is not out:
        out[...] = target
