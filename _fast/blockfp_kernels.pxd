# The C kernels of blockfp.h, shared by the Cython modules of the fast path.
from libc.math cimport ldexp
from libc.stdint cimport int32_t, int64_t, uint32_t

cdef extern from "blockfp.h" nogil:
    int32_t ina_peak_bits_f32(const float *x, size_t n)
    int64_t ina_peak_bits_f64(const double *x, size_t n)
    int32_t ina_exponent_f32(int32_t peak, int32_t floor)
    int32_t ina_exponent_f64(int64_t peak, int32_t floor)
    int32_t ina_exponent_i32(const int32_t *x, size_t n)
    void ina_quantize_f32(const float *x, size_t n, double scale, uint32_t *out)
    void ina_quantize_f64(const double *x, size_t n, double scale, uint32_t *out)
    void ina_quantize_i32(const int32_t *x, size_t n, uint32_t *out)
    void ina_dequantize_f32(const uint32_t *q, size_t n, double scale, float *out)
    void ina_dequantize_f64(const uint32_t *q, size_t n, double scale, double *out)
    void ina_dequantize_i32(const uint32_t *q, size_t n, int32_t *out)
    void ina_accumulate_be32(uint32_t *acc, const uint32_t *q, size_t n)
    void ina_load_be32(uint32_t *acc, const uint32_t *q, size_t n)
    void ina_store_be32(uint32_t *out, const uint32_t *acc, size_t n)

# Element types the kernels take directly (float16 is widened by the callers).
cdef enum Kind:
    KIND_F32 = 0
    KIND_F64 = 1
    KIND_I32 = 2


# Inline, so that other modules cimport them with no import at run time.
cdef inline int shift_for(int exponent, int n, Kind kind) noexcept nogil:
    if kind == KIND_I32:
        return 0
    cdef int log2n = 0
    while (n >> (log2n + 1)) != 0:
        log2n += 1
    return 30 - exponent - log2n


cdef inline double result_scale(int exponent, int n, Kind kind, bint average) noexcept nogil:
    cdef double scale = ldexp(1.0, -shift_for(exponent, n, kind))
    return scale / n if average else scale


cdef inline int32_t block_exponent(const char *x, size_t count, Kind kind,
                                   int32_t floor) noexcept nogil:
    if kind == KIND_F32:
        return ina_exponent_f32(ina_peak_bits_f32(<const float *>x, count), floor)
    if kind == KIND_F64:
        return ina_exponent_f64(ina_peak_bits_f64(<const double *>x, count), floor)
    cdef int32_t e = ina_exponent_i32(<const int32_t *>x, count)
    return e if e > floor else floor


cdef inline void quantize_block(const char *x, size_t count, Kind kind, int exponent,
                                int n, uint32_t *out) noexcept nogil:
    cdef double scale = ldexp(1.0, shift_for(exponent, n, kind))
    if kind == KIND_F32:
        ina_quantize_f32(<const float *>x, count, scale, out)
    elif kind == KIND_F64:
        ina_quantize_f64(<const double *>x, count, scale, out)
    else:
        ina_quantize_i32(<const int32_t *>x, count, out)


cdef inline void dequantize_block(const uint32_t *q, size_t count, Kind kind,
                                  int exponent, int n, bint average,
                                  char *out) noexcept nogil:
    cdef double scale = result_scale(exponent, n, kind, average)
    if kind == KIND_F32:
        ina_dequantize_f32(q, count, scale, <float *>out)
    elif kind == KIND_F64:
        ina_dequantize_f64(q, count, scale, <double *>out)
    else:
        ina_dequantize_i32(q, count, <int32_t *>out)
