# The C kernels of blockfp.h, shared by the Cython modules of the fast path, and the
# per-chunk steps built on them: a chunk's values in sub-blocks of b, one exponent each.
from libc.stdint cimport INT32_MIN, int16_t, int32_t, int64_t, uint16_t, uint32_t

cdef extern from "blockfp.h" nogil:
    double ina_pow2(int e)
    void ina_prefetch(const void *p, size_t bytes, int write)
    int32_t ina_exponent_f32(int32_t peak, int32_t floor)
    int32_t ina_exponent_f64(int64_t peak, int32_t floor)
    int32_t ina_exponent_i32(const int32_t *x, size_t n)
    void ina_peaks_f32(const float *x, size_t n, size_t b, int32_t *peaks)
    void ina_peaks_f64(const double *x, size_t n, size_t b, int64_t *peaks)
    void ina_quantize_f32(const float *x, size_t n, size_t b, const double *scales,
                          uint32_t *out)
    void ina_quantize_f64(const double *x, size_t n, size_t b, const double *scales,
                          uint32_t *out)
    void ina_quantize_f32_16(const float *x, size_t n, size_t b, const double *scales,
                             uint16_t *out)
    void ina_quantize_f64_16(const double *x, size_t n, size_t b, const double *scales,
                             uint16_t *out)
    void ina_quantize_i32(const int32_t *x, size_t n, uint32_t *out)
    void ina_dequantize_f32(const uint32_t *q, size_t n, size_t b, const double *scales,
                            float *out)
    void ina_dequantize_f64(const uint32_t *q, size_t n, size_t b, const double *scales,
                            double *out)
    void ina_dequantize_f32_16(const uint16_t *q, size_t n, size_t b,
                               const double *scales, float *out)
    void ina_dequantize_f64_16(const uint16_t *q, size_t n, size_t b,
                               const double *scales, double *out)
    void ina_dequantize_i32(const uint32_t *q, size_t n, int32_t *out)
    void ina_accumulate_be32(uint32_t *acc, const uint32_t *q, size_t n)
    void ina_load_be32(uint32_t *acc, const uint32_t *q, size_t n)
    void ina_store_be32(uint32_t *out, const uint32_t *acc, size_t n)
    void ina_accumulate_be16(uint16_t *acc, const uint16_t *q, size_t n)
    void ina_load_be16(uint16_t *acc, const uint16_t *q, size_t n)
    void ina_store_be16(uint16_t *out, const uint16_t *acc, size_t n)

# Element types the kernels take directly (float16 is widened by the callers).
cdef enum Kind:
    KIND_F32 = 0
    KIND_F64 = 1
    KIND_I32 = 2

# How a tensor's values go on the wire, fixed for a call: the element type, chunks of k
# values (a packet's), sub-blocks of b (one exponent each), values ``bits`` wide, the n
# workers a sum may hold (the headroom), and whether a result is an AVERAGE (divided by
# the workers it counted).
cdef struct Format:
    Kind kind
    Py_ssize_t k, b
    int bits, n
    bint average

# Sub-blocks handled per kernel call: their scales or peaks live on the stack.
cdef enum:
    PIECE = 256


# Inline, so that other modules cimport them with no import at run time.
cdef inline int shift_for(int exponent, int n, Kind kind, int bits) noexcept nogil:
    """2**shift scales a sub-block of agreed ``exponent``: bits - 2 - e - floor(log2 n)
    (docs/quantization.md); int32 values pass unscaled."""
    if kind == KIND_I32:
        return 0
    cdef int log2n = 0
    while (n >> (log2n + 1)) != 0:
        log2n += 1
    return bits - 2 - exponent - log2n


cdef inline Py_ssize_t kind_itemsize(Kind kind) noexcept nogil:
    return 8 if kind == KIND_F64 else 4


cdef inline bint chunk_exponents(const char *x, Py_ssize_t count, Kind kind, Py_ssize_t b,
                                 int32_t floor, int16_t *out) noexcept nogil:
    """Each sub-block's exponent proposal into out (ceil(count / b) of them); whether a
    NaN or an Inf was seen (its sub-block proposes the floor)."""
    cdef int32_t peaks32[PIECE]
    cdef int64_t peaks64[PIECE]
    cdef Py_ssize_t start, span, j, blocks
    cdef int32_t e
    cdef bint nonfinite = False
    if kind == KIND_I32:
        for j in range((count + b - 1) // b):
            span = min(b, count - j * b)
            e = ina_exponent_i32(<const int32_t *>x + j * b, span)
            out[j] = e if e > floor else floor
        return False
    start = 0
    while start < count:
        span = min(PIECE * b, count - start)
        blocks = (span + b - 1) // b
        if kind == KIND_F32:
            ina_peaks_f32(<const float *>x + start, span, b, peaks32)
            for j in range(blocks):
                e = ina_exponent_f32(peaks32[j], floor)
                if e == INT32_MIN:
                    nonfinite, e = True, floor
                out[j] = e
        else:
            ina_peaks_f64(<const double *>x + start, span, b, peaks64)
            for j in range(blocks):
                e = ina_exponent_f64(peaks64[j], floor)
                if e == INT32_MIN:
                    nonfinite, e = True, floor
                out[j] = e
        out += blocks
        start += span
    return nonfinite


cdef inline bint chunk_proposals(const char *x, Py_ssize_t count, Kind kind, Py_ssize_t b,
                                 int32_t floor, Py_ssize_t g, int16_t *out) noexcept nogil:
    """A chunk's G exponent proposals into out: its sub-blocks' (chunk_exponents), then
    the floor for those past its end (a short last chunk); whether a NaN or an Inf was
    seen."""
    cdef bint nonfinite = chunk_exponents(x, count, kind, b, floor, out)
    cdef Py_ssize_t j
    for j in range((count + b - 1) // b, g):
        out[j] = <int16_t>floor
    return nonfinite


cdef inline void quantize_chunk(const char *x, Py_ssize_t count, const Format *f,
                                const int16_t *exps, char *out) noexcept nogil:
    """A chunk's count values into out (network order, ``f.bits`` wide), sub-block j
    scaled by its agreed exponent exps[j]."""
    cdef Kind kind = f.kind
    cdef Py_ssize_t b = f.b
    cdef int n = f.n, bits = f.bits
    cdef double scales[PIECE]
    cdef Py_ssize_t start = 0, span, j, blocks
    if kind == KIND_I32:
        ina_quantize_i32(<const int32_t *>x, count, <uint32_t *>out)
        return
    while start < count:
        span = min(PIECE * b, count - start)
        blocks = (span + b - 1) // b
        for j in range(blocks):
            scales[j] = ina_pow2(shift_for(exps[j], n, kind, bits))
        if kind == KIND_F32 and bits == 32:
            ina_quantize_f32(<const float *>x + start, span, b, scales,
                             <uint32_t *>out + start)
        elif kind == KIND_F32:
            ina_quantize_f32_16(<const float *>x + start, span, b, scales,
                                <uint16_t *>out + start)
        elif bits == 32:
            ina_quantize_f64(<const double *>x + start, span, b, scales,
                             <uint32_t *>out + start)
        else:
            ina_quantize_f64_16(<const double *>x + start, span, b, scales,
                                <uint16_t *>out + start)
        exps += blocks
        start += span


cdef inline void dequantize_chunk(const char *q, Py_ssize_t count, const Format *f,
                                  const int16_t *exps, char *out,
                                  int counted=0) noexcept nogil:
    """A chunk's aggregated values (network order, ``f.bits`` wide) into out, sub-block j
    times 2**-shift of exps[j] (and, for AVERAGE, 1 / the workers counted: ``counted``,
    or n if 0), one rounding to out's type."""
    cdef Kind kind = f.kind
    cdef Py_ssize_t b = f.b
    cdef int n = f.n, bits = f.bits
    cdef bint average = f.average
    cdef double scales[PIECE]
    cdef Py_ssize_t start = 0, span, j, blocks
    if kind == KIND_I32:
        ina_dequantize_i32(<const uint32_t *>q, count, <int32_t *>out)
        return
    while start < count:
        span = min(PIECE * b, count - start)
        blocks = (span + b - 1) // b
        for j in range(blocks):
            scales[j] = ina_pow2(-shift_for(exps[j], n, kind, bits))
            if average:
                scales[j] /= counted if counted > 0 else n
        if kind == KIND_F32 and bits == 32:
            ina_dequantize_f32(<const uint32_t *>q + start, span, b, scales,
                               <float *>out + start)
        elif kind == KIND_F32:
            ina_dequantize_f32_16(<const uint16_t *>q + start, span, b, scales,
                                  <float *>out + start)
        elif bits == 32:
            ina_dequantize_f64(<const uint32_t *>q + start, span, b, scales,
                               <double *>out + start)
        else:
            ina_dequantize_f64_16(<const uint16_t *>q + start, span, b, scales,
                                  <double *>out + start)
        exps += blocks
        start += span
