"""Block floating point: float tensors to int32 or int16 switch payloads and back (NumPy
reference).

This module is the oracle of the Cython kernels in _fast/ and the fallback when they are
not built (``ina_collectives.kernels`` chooses); both implement the same functions with
the same results to the bit. docs/quantization.md derives the rules and the error bound.

A tensor is cut into chunks of K elements (one chunk = one packet payload), and each
chunk into sub-blocks of B elements (the last of a chunk may be shorter). For sub-block j
every worker proposes ``e_j``, the smallest exponent with max|x| < 2**e_j over its own
sub-block (never below the dtype's floor ``EXPONENT_MIN``); the switch keeps the max over
workers, so all workers scale sub-block j by the same power of two. With V value bits
(32 or 16):

    shift = V - 2 - e - floor(log2 n)         q = round_half_even(x * 2**shift)

Then |q| <= 2**(V - 2 - floor(log2 n)) and n * |q| < 2**(V - 1): the switch's V-bit
sum of n workers cannot overflow. The result is sum(q) * 2**-shift (/ n for AVERAGE).

Exponent arrays hold G = ceil(K / B) entries per chunk, chunk c's at c G .. c G + G - 1;
the last chunk's entries past its end hold the floor (as a sub-block of zeros would).

int32 tensors pass through unscaled (shift 0, 32-bit values only); their ``e`` is the
bit length of max|x|, and a sub-block whose agreed ``e + ceil(log2 n) > 31`` could
overflow the switch's int32 sum: quantizing it raises OverflowError instead of wrapping.
"""
from __future__ import annotations

import numpy as np

from ... import protocol as P

# The smallest block exponent per dtype. float32/16 reach their subnormals exactly;
# float64 stops at 2**-990 so that 2**shift stays a finite double (shift <= 1020):
# float64 values below 2**-990 (1e-298) quantize to 0, within the error bound.
EXPONENT_MIN = {np.dtype(np.float16): -126, np.dtype(np.float32): -126,
                np.dtype(np.float64): -990, np.dtype(np.int32): 0}
DTYPES = tuple(EXPONENT_MIN)  # what the quantizer takes: the dtypes with a floor


def nblocks(count: int, k: int) -> int:
    """Chunks of k elements in count."""
    return -(-count // k)


def sub_blocks_per_chunk(k: int, b: int) -> int:
    """G: sub-blocks of b in a chunk of k."""
    return -(-k // b)


def nexponents(count: int, k: int, b: int) -> int:
    """The size of a tensor's exponent array: G per chunk."""
    return nblocks(count, k) * sub_blocks_per_chunk(k, b)


def shift_for(exponent: int, n: int, dtype: np.dtype, bits: int = 32) -> int:
    """The power of two a sub-block with agreed ``exponent`` is scaled by, for n workers."""
    if np.dtype(dtype).kind == "i":
        return 0
    return bits - 2 - int(exponent) - (n.bit_length() - 1)


def check_int32_headroom(exps: np.ndarray, n: int, first: int = 0) -> None:
    """OverflowError naming the first int32 sub-block (numbered from ``first``) whose
    agreed exponent lets n workers' sum overflow int32."""
    bad = np.flatnonzero(exps.astype(np.int64) + (n - 1).bit_length() > 31)
    if bad.size:
        b = int(bad[0])
        raise OverflowError(f"int32 sub-block {first + b} (agreed exponent {int(exps[b])}) "
                            f"could overflow the switch's int32 sum of {n} workers")


def check_kernel_args(x: np.ndarray, k: int, b: int = P.DEFAULT_BLOCK,
                      bits: int = 32) -> None:
    if x.ndim != 1 or not x.flags.c_contiguous:
        raise ValueError(f"expected a 1-D contiguous array, got shape {x.shape}")
    if x.dtype not in DTYPES:
        raise TypeError(f"block floating point takes float16/32/64 or int32, not {x.dtype}")
    if not 1 <= k <= P.MAX_ANY_ELEMENTS:
        raise ValueError(f"K must be 1..{P.MAX_ANY_ELEMENTS} elements per packet, got {k}")
    P.check_format(b, bits)
    if x.dtype.kind == "i" and bits != 32:
        raise TypeError("int32 tensors pass through unscaled: they need 32-bit values, "
                        f"not {bits}")


def _blocks(x: np.ndarray, k: int, b: int, fill) -> np.ndarray:
    """x as [chunks, G, b], padded with ``fill``."""
    nc, g = nblocks(x.size, k), sub_blocks_per_chunk(k, b)
    chunks = np.pad(x, (0, nc * k - x.size), constant_values=fill).reshape(nc, k)
    return np.pad(chunks, ((0, 0), (0, g * b - k)), constant_values=fill).reshape(nc, g, b)


def block_exponents(x: np.ndarray, k: int, b: int = P.DEFAULT_BLOCK
                    ) -> tuple[np.ndarray, bool]:
    """Each sub-block's exponent proposal (int16, G per chunk) and whether x holds a NaN
    or an Inf."""
    check_kernel_args(x, k, b)
    floor = EXPONENT_MIN[x.dtype]
    if x.size == 0:
        return np.empty(0, np.int16), False
    if x.dtype.kind == "i":
        peak = _blocks(np.abs(x.astype(np.int64)), k, b, 0).max(axis=2).ravel()
        exps = np.array([int(v).bit_length() for v in peak], dtype=np.int64)
        return np.maximum(exps, floor).astype(np.int16), False
    wide = np.abs(x.astype(np.float64))
    nonfinite = not np.isfinite(wide).all()
    peak = _blocks(wide, k, b, 0.0).max(axis=2).ravel()
    with np.errstate(invalid="ignore"):
        _, exps = np.frexp(peak)  # peak = m * 2**e with 0.5 <= m < 1: peak < 2**e
    exps = np.where(np.isfinite(peak) & (peak > 0), exps, floor)
    return np.maximum(exps, floor).astype(np.int16), nonfinite


def element_exponents(exps: np.ndarray, count: int, k: int, b: int) -> np.ndarray:
    """Each element's sub-block exponent (int64), from an exponent array."""
    i = np.arange(count)
    return exps.astype(np.int64)[(i // k) * sub_blocks_per_chunk(k, b) + (i % k) // b]


def _shifts(exps: np.ndarray, n: int, count: int, k: int, b: int, bits: int) -> np.ndarray:
    """The per-element power of two."""
    return bits - 2 - element_exponents(exps, count, k, b) - (n.bit_length() - 1)


def _wire(bits: int) -> np.dtype:
    return np.dtype(">i4" if bits == 32 else ">i2")


def quantize(x: np.ndarray, exps: np.ndarray, n: int, k: int, b: int = P.DEFAULT_BLOCK,
             bits: int = 32) -> np.ndarray:
    """x as int32 or int16 (``bits``) in network byte order, sub-block j scaled by its
    agreed exponent exps[j]."""
    check_kernel_args(x, k, b, bits)
    check_exps(exps, x.size, k, b)
    if x.dtype.kind == "i":
        check_int32_headroom(exps, n)
        return x.astype(">i4")
    scaled = np.ldexp(x.astype(np.float64), _shifts(exps, n, x.size, k, b, bits))
    return np.rint(scaled).astype(_wire(bits))


def dequantize(q: np.ndarray, exps: np.ndarray, n: int, k: int, out: np.ndarray,
               average: bool = False, b: int = P.DEFAULT_BLOCK, counted: int = 0) -> None:
    """Write the aggregated payload q (int32 or int16, network order) into out, in out's
    dtype; an AVERAGE divides by ``counted``, the workers the sum counted (0: n)."""
    bits = 8 * q.dtype.itemsize
    check_kernel_args(out, k, b, bits)
    check_exps(exps, out.size, k, b)
    if q.size != out.size:
        raise ValueError(f"{q.size} aggregated values for an output of {out.size}")
    values = q.astype(np.int64)
    if out.dtype.kind == "i":
        if average:
            raise ValueError("AVERAGE is not defined for int32")
        out[...] = values
        return
    scale = np.ldexp(1.0, -_shifts(exps, n, out.size, k, b, bits))
    if average:
        scale = scale / (counted or n)  # folded into the one multiply, as the fast path does
    with np.errstate(over="ignore"):  # a sum beyond the dtype's range is +-inf, as in C
        out[...] = values * scale  # then one rounding from float64 to the output dtype


def error_bound(n: int, exponent: int | np.ndarray, dtype: np.dtype,
                result: np.ndarray | float, average: bool = False,
                bits: int = 32) -> np.ndarray:
    """docs/quantization.md's bound on |result - exact|, element-wise (``exponent`` is each
    element's sub-block exponent, or one for all).

    Each worker's rounding is at most half a quantum 2**-shift; the n roundings add up to
    n/2 quanta (divided by n for AVERAGE); the conversion of the float64 result to the
    dtype adds half an ulp of the result; AVERAGE's 1/n, folded into the scale, adds
    two float64 roundings (2**-52 relative).
    """
    dtype = np.dtype(dtype)
    shift = bits - 2 - np.asarray(exponent, np.int64) - (n.bit_length() - 1)
    quantum = np.ldexp(1.0, -shift)
    term = n * quantum / 2
    if average:
        term = term / n
    r = np.abs(np.asarray(result, dtype=dtype))
    ulp = np.spacing(r).astype(np.float64)
    bound = term * (1 + 2.0 ** -40) + ulp / 2
    if average:
        bound = bound + r.astype(np.float64) * 2.0 ** -52
    return bound


def check_exps(exps: np.ndarray, count: int, k: int, b: int) -> None:
    """ValueError unless ``exps`` holds one exponent per sub-block of ``count`` values
    (the compiled kernels check their arguments with the same functions)."""
    want = nexponents(count, k, b)
    if exps.shape != (want,):
        raise ValueError(f"expected {want} sub-block exponents, got {exps.shape}")
