# cython: language_level=3
"""Block floating point, compiled: the same functions as ina_collectives.ina.reference.blockfp.

The per-element loops are the C kernels of blockfp.h; this module walks the chunks
without the GIL and wraps them for Python. ina_collectives.ina.kernels selects it.
"""
from blockfp_kernels cimport *
from libc.stdint cimport int16_t

import numpy as np

from ina_collectives import protocol as P
from ina_collectives.ina.reference import blockfp as ref


cdef Kind kind_of(object dtype) except *:
    if dtype == np.float32 or dtype == np.float16:
        return KIND_F32
    if dtype == np.float64:
        return KIND_F64
    if dtype == np.int32:
        return KIND_I32
    raise TypeError(f"block floating point takes float16/32/64 or int32, not {dtype}")


def block_exponents(x, Py_ssize_t k, Py_ssize_t b=P.DEFAULT_BLOCK):
    """Each sub-block's exponent proposal (int16, G per chunk) and whether x holds a NaN
    or an Inf."""
    ref.check_kernel_args(x, k, b)
    cdef object dtype = x.dtype
    cdef int32_t floor = ref.EXPONENT_MIN[dtype]
    if dtype == np.float16:
        x = x.astype(np.float32)  # exact; the float32 scan then sees the same magnitudes
    cdef Kind kind = kind_of(x.dtype)
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef Py_ssize_t count = x.size, itemsize = x.itemsize
    cdef Py_ssize_t nc = ref.nblocks(count, k), g = ref.sub_blocks_per_chunk(k, b), c, start
    exps = np.empty(nc * g, np.int16)
    cdef int16_t[::1] e = exps
    cdef bint nonfinite = False
    with nogil:
        for c in range(nc):
            start = c * k
            if chunk_proposals(<const char *>&raw[start * itemsize], min(k, count - start),
                               kind, b, floor, g, &e[c * g]):
                nonfinite = True
    return exps, nonfinite


def quantize(x, exps, int n, Py_ssize_t k, Py_ssize_t b=P.DEFAULT_BLOCK, int bits=32):
    """x as int32 or int16 (``bits``) in network byte order, sub-block j scaled by its
    agreed exponent exps[j]."""
    ref.check_kernel_args(x, k, b, bits)
    ref.check_exps(exps, x.size, k, b)
    if x.dtype == np.int32:
        ref.check_int32_headroom(exps, n)
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    cdef Kind kind = kind_of(x.dtype)
    out = np.empty(x.size, ">i4" if bits == 32 else ">i2")
    cdef unsigned char[::1] q = out.view(np.uint8)
    cdef const unsigned char[::1] raw = x.view(np.uint8)
    cdef const int16_t[::1] e = np.ascontiguousarray(exps, np.int16)
    cdef Py_ssize_t count = x.size, itemsize = x.itemsize, c, start
    cdef Py_ssize_t g = ref.sub_blocks_per_chunk(k, b), width = bits // 8
    cdef Format f = Format(kind=kind, k=k, b=b, bits=bits, n=n, average=False)
    if count == 0:
        return out
    with nogil:
        for c in range((count + k - 1) // k):
            start = c * k
            quantize_chunk(<const char *>&raw[start * itemsize], min(k, count - start), &f,
                           &e[c * g], <char *>&q[start * width])
    return out


def dequantize(q, exps, int n, Py_ssize_t k, out, bint average=False,
               Py_ssize_t b=P.DEFAULT_BLOCK):
    """Write the aggregated payload q (int32 or int16, network order) into out, in out's
    dtype."""
    cdef int bits = 8 * q.dtype.itemsize
    ref.check_kernel_args(out, k, b, bits)
    ref.check_exps(exps, out.size, k, b)
    if q.size != out.size:
        raise ValueError(f"{q.size} aggregated values for an output of {out.size}")
    if average and out.dtype == np.int32:
        raise ValueError("AVERAGE is not defined for int32")
    target = np.empty(out.size, np.float64) if out.dtype == np.float16 else out
    cdef Kind kind = kind_of(target.dtype)
    cdef unsigned char[::1] raw = target.view(np.uint8)
    cdef const unsigned char[::1] qv = np.ascontiguousarray(q).view(np.uint8)
    cdef const int16_t[::1] e = np.ascontiguousarray(exps, np.int16)
    cdef Py_ssize_t count = out.size, itemsize = target.itemsize, c, start
    cdef Py_ssize_t g = ref.sub_blocks_per_chunk(k, b), width = bits // 8
    cdef Format f = Format(kind=kind, k=k, b=b, bits=bits, n=n, average=average)
    if count:
        with nogil:
            for c in range((count + k - 1) // k):
                start = c * k
                dequantize_chunk(<const char *>&qv[start * width], min(k, count - start),
                                 &f, &e[c * g], <char *>&raw[start * itemsize])
    if target is not out:
        out[...] = target
