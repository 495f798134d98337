/* Block floating point kernels: the per-element loops of the INA fast path.
 *
 * Plain C with restrict pointers so that gcc -O3 vectorizes them on baseline x86-64
 * (SSE2); the Cython modules beside this file call them without the GIL. The rules
 * are those of ina_collectives/ina/reference/blockfp.py (the NumPy reference) and must give the
 * same bits. Payload values are int32 or int16 in network byte order.
 */
#ifndef INA_BLOCKFP_H
#define INA_BLOCKFP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Byte swapping vectorizes only from SSSE3 on, which baseline x86-64 lacks: each
 * kernel is compiled for AVX2, SSSE3 and the baseline, and the loader picks the best
 * one this CPU has (GCC/clang function multiversioning). Portable, no -march=native. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define INA_KERNEL __attribute__((target_clones("avx2", "ssse3", "default"))) static
#else
#define INA_KERNEL static inline
#endif

/* Adding then subtracting 1.5 * 2**52 rounds a double below 2**51 in magnitude to an
 * integer, half to even (as np.rint): vectorizes where lrint does not. */
#define INA_ROUND_MAGIC 6755399441055744.0

/* Block exponent e with peak < 2**e (frexp's), or INT32_MIN for NaN/Inf. */
static inline int32_t ina_exponent_f32(int32_t peak, int32_t floor)
{
    int32_t biased = peak >> 23;
    if (biased == 0xff)
        return INT32_MIN;
    int32_t e = biased == 0 ? floor : biased - 126;
    return e > floor ? e : floor;
}

static inline int32_t ina_exponent_f64(int64_t peak, int32_t floor)
{
    int32_t biased = (int32_t)(peak >> 52);
    if (biased == 0x7ff)
        return INT32_MIN;
    int32_t e = biased == 0 ? floor : biased - 1022;
    return e > floor ? e : floor;
}

/* int32: the bit length of the largest |x| (|INT32_MIN| = 2**31 has 32). */
INA_KERNEL int32_t ina_exponent_i32(const int32_t *restrict x, size_t n)
{
    uint32_t peak = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t m = x[i] < 0 ? (uint32_t)0 - (uint32_t)x[i] : (uint32_t)x[i];
        peak = m > peak ? m : peak;
    }
    return peak == 0 ? 0 : 32 - __builtin_clz(peak);
}

/* 2**e as a double, for e in -1022 .. 1023 (the caller keeps it there): the bits built
 * directly, a few times cheaper than ldexp, which matters once per sub-block of 32. */
static inline double ina_pow2(int e)
{
    uint64_t bits = (uint64_t)(e + 1023) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* Quantize: values of sub-block j are scaled by scales[j] (2**shift of its exponent),
 * rounded half to even and written in network order, int32 or int16. Sub-blocks of b
 * values; the last may be shorter. */
#define INA_QUANTIZE(name, in_t, out_t, cast_t, swap)                                   \
INA_KERNEL void name(const in_t *restrict x, size_t n, size_t b,                        \
                     const double *restrict scales, out_t *restrict out)                \
{                                                                                       \
    for (size_t start = 0, j = 0; start < n; start += b, j++) {                         \
        size_t stop = start + b < n ? start + b : n;                                    \
        double scale = scales[j];                                                       \
        for (size_t i = start; i < stop; i++) {                                         \
            double v = ((double)x[i] * scale + INA_ROUND_MAGIC) - INA_ROUND_MAGIC;      \
            out[i] = swap((out_t)(cast_t)(int32_t)v);                                   \
        }                                                                               \
    }                                                                                   \
}

/* Dequantize: value i of sub-block j (network order) times scales[j] (2**-shift, times
 * 1/n for AVERAGE), one rounding to the output type. */
#define INA_DEQUANTIZE(name, in_t, cast_t, swap, out_t)                                 \
INA_KERNEL void name(const in_t *restrict q, size_t n, size_t b,                        \
                     const double *restrict scales, out_t *restrict out)                \
{                                                                                       \
    for (size_t start = 0, j = 0; start < n; start += b, j++) {                         \
        size_t stop = start + b < n ? start + b : n;                                    \
        double scale = scales[j];                                                       \
        for (size_t i = start; i < stop; i++)                                           \
            out[i] = (out_t)((double)(cast_t)swap(q[i]) * scale);                       \
    }                                                                                   \
}

INA_QUANTIZE(ina_quantize_f32_generic, float, uint32_t, int32_t, __builtin_bswap32)
INA_QUANTIZE(ina_quantize_f64, double, uint32_t, int32_t, __builtin_bswap32)
INA_QUANTIZE(ina_quantize_f32_16, float, uint16_t, int16_t, __builtin_bswap16)
INA_QUANTIZE(ina_quantize_f64_16, double, uint16_t, int16_t, __builtin_bswap16)
INA_DEQUANTIZE(ina_dequantize_f32_generic, uint32_t, int32_t, __builtin_bswap32, float)
INA_DEQUANTIZE(ina_dequantize_f64, uint32_t, int32_t, __builtin_bswap32, double)
INA_DEQUANTIZE(ina_dequantize_f32_16, uint16_t, int16_t, __builtin_bswap16, float)
INA_DEQUANTIZE(ina_dequantize_f64_16, uint16_t, int16_t, __builtin_bswap16, double)

/* float32 <-> int32, the worker's hot pair, written out for AVX2: gcc vectorizes the
 * rule above through float64 (half the lanes) and measured about 3x slower per value.
 * A sub-block whose scale is a power of two within float32's normal range takes the
 * float32 rule, which gives the same bits: scaling by such a power of two is exact (a
 * quantized |x| 2**shift stays below 2**31; a dequantized value, at least the scale in
 * magnitude, is never subnormal), so one rounding remains in both rules, to an integer
 * half to even (cvtps2dq under the default MXCSR) or to float32 (cvtdq2ps, with the
 * same overflow to +-inf). Any other scale (AVERAGE over a count that is not a power of
 * two; extreme exponents) keeps the float64 rule, with the same instructions gcc
 * emits. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

static inline int ina_float32_scale(double scale)
{
    uint64_t bits;
    memcpy(&bits, &scale, sizeof bits);
    return (bits & ((UINT64_C(1) << 52) - 1)) == 0 && scale >= 0x1p-126 && scale <= 0x1p127;
}

#define INA_BSWAP32_LANES _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14,  \
                                           13, 12, 3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, \
                                           15, 14, 13, 12)

__attribute__((target("avx2"))) static void
ina_quantize_f32_avx2(const float *restrict x, size_t n, size_t b,
                      const double *restrict scales, uint32_t *restrict out)
{
    const __m256i swap = INA_BSWAP32_LANES;
    for (size_t start = 0, j = 0; start < n; start += b, j++) {
        size_t stop = start + b < n ? start + b : n, i = start;
        double scale = scales[j];
        if (ina_float32_scale(scale)) {
            __m256 s = _mm256_set1_ps((float)scale);
            for (; i + 8 <= stop; i += 8) {
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), s));
                _mm256_storeu_si256((__m256i *)(out + i), _mm256_shuffle_epi8(q, swap));
            }
        }
        for (; i < stop; i++) {
            double v = ((double)x[i] * scale + INA_ROUND_MAGIC) - INA_ROUND_MAGIC;
            out[i] = __builtin_bswap32((uint32_t)(int32_t)v);
        }
    }
}

__attribute__((target("avx2"))) static void
ina_dequantize_f32_avx2(const uint32_t *restrict q, size_t n, size_t b,
                        const double *restrict scales, float *restrict out)
{
    const __m256i swap = INA_BSWAP32_LANES;
    for (size_t start = 0, j = 0; start < n; start += b, j++) {
        size_t stop = start + b < n ? start + b : n, i = start;
        double scale = scales[j];
        if (ina_float32_scale(scale)) {
            __m256 s = _mm256_set1_ps((float)scale);
            for (; i + 8 <= stop; i += 8) {
                __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(q + i)),
                                                swap);
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
            }
        } else {
            __m256d s = _mm256_set1_pd(scale);
            for (; i + 8 <= stop; i += 8) {
                __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(q + i)),
                                                swap);
                __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(
                    _mm256_cvtepi32_pd(_mm256_castsi256_si128(v)), s));
                __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(
                    _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)), s));
                _mm256_storeu_ps(out + i, _mm256_set_m128(hi, lo));
            }
        }
        for (; i < stop; i++)
            out[i] = (float)((double)(int32_t)__builtin_bswap32(q[i]) * scale);
    }
}

static inline int ina_has_avx2(void)
{
    static int known = -1;  /* a benign race: every thread stores the same answer */
    if (known < 0)
        known = __builtin_cpu_supports("avx2") ? 1 : 0;
    return known;
}

static inline void ina_quantize_f32(const float *x, size_t n, size_t b,
                                    const double *scales, uint32_t *out)
{
    if (ina_has_avx2())
        ina_quantize_f32_avx2(x, n, b, scales, out);
    else
        ina_quantize_f32_generic(x, n, b, scales, out);
}

static inline void ina_dequantize_f32(const uint32_t *q, size_t n, size_t b,
                                      const double *scales, float *out)
{
    if (ina_has_avx2())
        ina_dequantize_f32_avx2(q, n, b, scales, out);
    else
        ina_dequantize_f32_generic(q, n, b, scales, out);
}
#else
#define ina_quantize_f32 ina_quantize_f32_generic
#define ina_dequantize_f32 ina_dequantize_f32_generic
#endif

/* Hints that bytes at p will soon be read (write 0) or written (write 1): the next
 * chunk's values come from memory while this packet's system calls run, instead of
 * stalling the kernels above (a tensor is streamed once, from DRAM). */
static inline void ina_prefetch(const void *p, size_t bytes, int write)
{
    const char *c = (const char *)p;
    for (size_t i = 0; i < bytes; i += 64) {
        if (write)
            __builtin_prefetch(c + i, 1, 3);
        else
            __builtin_prefetch(c + i, 0, 3);
    }
}

/* Each sub-block's peak: the largest |x| as its bit pattern with the sign cleared: such
 * patterns order like the magnitudes, and NaN/Inf are those >= 0x7f800000 (float32).
 * Integer max, so it vectorizes without -ffast-math. */
#define INA_PEAKS(name, in_t, bits_t, magnitude)                                        \
INA_KERNEL void name(const in_t *restrict x, size_t n, size_t b, bits_t *restrict peaks) \
{                                                                                       \
    for (size_t start = 0, j = 0; start < n; start += b, j++) {                         \
        size_t stop = start + b < n ? start + b : n;                                    \
        bits_t peak = 0;                                                                \
        for (size_t i = start; i < stop; i++) {                                         \
            bits_t u;                                                                   \
            memcpy(&u, &x[i], sizeof u);                                                \
            u &= magnitude;                                                             \
            peak = u > peak ? u : peak;                                                 \
        }                                                                               \
        peaks[j] = peak;                                                                \
    }                                                                                   \
}

INA_PEAKS(ina_peaks_f32, float, int32_t, 0x7fffffff)
INA_PEAKS(ina_peaks_f64, double, int64_t, INT64_C(0x7fffffffffffffff))

INA_KERNEL void ina_quantize_i32(const int32_t *restrict x, size_t n,
                                    uint32_t *restrict out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = __builtin_bswap32((uint32_t)x[i]);
}

INA_KERNEL void ina_dequantize_i32(const uint32_t *restrict q, size_t n,
                                      int32_t *restrict out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (int32_t)__builtin_bswap32(q[i]);
}

/* The switch's adders, for each value width: accumulate (acc += payload in network
 * order, wrapping as a P4 add of that width does), load (the first packet of a use) and
 * store (the result, back into network order). */
#define INA_SWITCH_KERNELS(bits, swap)                                                  \
INA_KERNEL void ina_accumulate_be##bits(uint##bits##_t *restrict acc,                  \
                                        const uint##bits##_t *restrict q, size_t n)    \
{                                                                                       \
    for (size_t i = 0; i < n; i++)                                                      \
        acc[i] = (uint##bits##_t)(acc[i] + swap(q[i]));                                 \
}                                                                                       \
INA_KERNEL void ina_load_be##bits(uint##bits##_t *restrict acc,                        \
                                  const uint##bits##_t *restrict q, size_t n)          \
{                                                                                       \
    for (size_t i = 0; i < n; i++)                                                      \
        acc[i] = swap(q[i]);                                                            \
}                                                                                       \
INA_KERNEL void ina_store_be##bits(uint##bits##_t *restrict out,                       \
                                   const uint##bits##_t *restrict acc, size_t n)        \
{                                                                                       \
    for (size_t i = 0; i < n; i++)                                                      \
        out[i] = swap(acc[i]);                                                          \
}

INA_SWITCH_KERNELS(32, __builtin_bswap32)
INA_SWITCH_KERNELS(16, __builtin_bswap16)

#endif
