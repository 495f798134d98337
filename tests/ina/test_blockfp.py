"""Block floating point: the error bound of docs/quantization.md for both value widths
and every sub-block size, NaN/Inf detection, int32 passthrough, and the compiled kernels
agreeing with the NumPy reference to the bit.

Every test runs against both backends (the ``kernels`` fixture), as msgpack's suite runs
against its C extension and its pure-Python fallback.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ina_collectives.ina import kernels as kernel_module
from ina_collectives.ina.reference import blockfp
from tests.conftest import BACKENDS


def test_the_compiled_backend_is_built_and_default():
    # A silent fallback to NumPy would make every "fast" figure a lie.
    assert kernel_module.BACKEND == "fast"


def aggregate(kernels, xs: np.ndarray, k: int, average: bool = False, b: int = 32,
              bits: int = 32):
    """What the switch and the workers compute together, for the rows of xs (one per
    worker): agreed exponents (max of proposals), int32 or int16 sums, one worker's
    result."""
    n = xs.shape[0]
    proposals = [kernels.block_exponents(x, k, b) for x in xs]
    agreed = np.max([e for e, _ in proposals], axis=0).astype(np.int16)
    qs = np.stack([kernels.quantize(x, agreed, n, k, b, bits).astype(np.int64) for x in xs])
    total = qs.sum(axis=0)
    top = 2 ** (bits - 1) - 1
    assert (np.abs(total) <= top).all(), f"the switch's int{bits} sum overflowed"
    out = np.empty(xs.shape[1], xs.dtype)
    kernels.dequantize(total.astype(">i4" if bits == 32 else ">i2"), agreed, n, k, out,
                       average, b)
    return agreed, out


def exact_sum(xs: np.ndarray) -> np.ndarray:
    return xs.astype(np.longdouble).sum(axis=0)


def unit_floats(dtype):
    return st.floats(min_value=-1, max_value=1, allow_subnormal=True,
                     width=np.finfo(dtype).bits)


@st.composite
def worker_inputs(draw):
    dtype = np.dtype(draw(st.sampled_from(["float16", "float32", "float64"])))
    n = draw(st.integers(1, 32))
    k = draw(st.sampled_from([1, 3, 8, 64, 100]))
    b = draw(st.sampled_from([1, 4, 32, 64]))
    bits = draw(st.sampled_from([32, 16]))
    size = draw(st.integers(0, 3 * k + 1))
    # Magnitudes from 1e-30 to 1e30, as far as the dtype (and a sum of 32) reaches.
    top = float(np.finfo(dtype).max) / 64
    scale = draw(st.sampled_from([s for s in (1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e12, 1e30)
                                  if s <= top]))
    base = draw(hnp.arrays(dtype, (n, size), elements=unit_floats(dtype)))
    with np.errstate(under="ignore"):
        xs = (base.astype(np.float64) * scale).astype(dtype)
    if size and draw(st.booleans()):  # whole blocks of zeros and subnormals
        tiny = np.finfo(dtype).smallest_subnormal
        xs[:, : min(size, k)] = np.where(np.arange(min(size, k)) % 2, 0, tiny)
    return dtype, k, b, bits, xs


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, deadline=None)
@given(case=worker_inputs(), average=st.booleans())
def test_error_within_documented_bound(backend, case, average):
    kernels = kernel_module.load(backend)
    dtype, k, b, bits, xs = case
    n = xs.shape[0]
    agreed, out = aggregate(kernels, xs, k, average, b, bits)
    exact = exact_sum(xs) / (n if average else 1)
    exps = blockfp.element_exponents(agreed, xs.shape[1], k, b)
    bound = blockfp.error_bound(n, exps, dtype, out, average, bits)
    # The reference sum itself is long double: allow its own rounding on top.
    slack = np.abs(exact.astype(np.float64)) * 2.0**-60
    error = np.abs(out.astype(np.longdouble) - exact).astype(np.float64)
    worst = int(np.argmax(error - bound - slack)) if out.size else 0
    assert (error <= bound + slack).all(), (
        f"n={n} k={k} b={b} {bits} bits {dtype}: element {worst} = {out[worst]!r}, "
        f"exact {exact[worst]!r}, "
        f"error {error[worst]:.3g} > bound {bound[worst]:.3g}")


@settings(max_examples=100, deadline=None)
@given(case=worker_inputs(), average=st.booleans(), data=st.data())
def test_compiled_kernels_match_reference_bit_for_bit(case, average, data):
    dtype, k, b, bits, xs = case
    fast, ref = kernel_module.load("fast"), kernel_module.load("numpy")
    x = xs[0]
    ef, nf = fast.block_exponents(x, k, b)
    er, nr = ref.block_exponents(x, k, b)
    assert ef.tobytes() == er.tobytes() and nf == nr
    n = xs.shape[0]
    agreed = np.maximum(ef, data.draw(hnp.arrays(np.int16, ef.shape,
                                                 elements=st.integers(-126, 60))))
    qf, qr = fast.quantize(x, agreed, n, k, b, bits), ref.quantize(x, agreed, n, k, b, bits)
    assert qf.dtype == qr.dtype and qf.tobytes() == qr.tobytes()
    of, orr = np.empty_like(x), np.empty_like(x)
    fast.dequantize(qf, agreed, n, k, of, average, b)
    ref.dequantize(qr, agreed, n, k, orr, average, b)
    assert of.tobytes() == orr.tobytes()


def test_sub_blocks_keep_small_values_of_a_large_packet(kernels):
    """One exponent per sub-block, not per packet: a huge element costs only its own
    sub-block's resolution, whatever K is (the reason for the format)."""
    x = np.full(4096, 1e-3, np.float32)
    x[0] = 1e6
    xs = np.stack([x, x])
    _, per_packet = aggregate(kernels, xs, 4096, b=64)  # one sub-block of 64 has the 1e6
    assert per_packet[64:].tolist() == [np.float32(2e-3)] * (4096 - 64)
    for bits in (32, 16):
        _, out = aggregate(kernels, xs, 4096, b=32, bits=bits)
        rel = np.abs(out[32:] / 2e-3 - 1).max()
        assert rel < (2.0 ** -20 if bits == 32 else 2.0 ** -5), (bits, rel)


def test_exponent_arrays_have_g_per_chunk_with_the_floor_past_the_end(kernels):
    x = np.ones(70, np.float32)  # K 64, B 32: chunk 0 has 2 sub-blocks, chunk 1 one of 6
    exps, _ = kernels.block_exponents(x, 64, 32)
    assert exps.tolist() == [1, 1, 1, -126]
    with pytest.raises(TypeError, match="int32 tensors .* 32-bit"):
        kernels.quantize(np.ones(4, np.int32), np.zeros(1, np.int16), 2, 4, 32, 16)
    with pytest.raises(ValueError, match="sub-block size B"):
        kernels.block_exponents(x, 64, 48)


def test_agreed_exponent_bounds_every_worker(kernels):
    xs = np.array([[0.75, -3.0, 1e-3], [4.0, 0.5, -1e-3]], np.float32)
    e0, _ = kernels.block_exponents(xs[0], 3)
    e1, _ = kernels.block_exponents(xs[1], 3)
    assert e0.tolist() == [2] and e1.tolist() == [3]  # 3.0 < 2**2, 4.0 < 2**3
    _, out = aggregate(kernels, xs, 3)
    np.testing.assert_allclose(out, xs.sum(axis=0), rtol=0, atol=2.0**(3 + 1 - 30))


def test_zero_blocks_and_extremes(kernels):
    x = np.zeros(10, np.float32)
    exps, bad = kernels.block_exponents(x, 4)
    assert exps.tolist() == [-126] * 3 and not bad
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32)
    exps, _ = kernels.block_exponents(big, 2)
    assert exps.tolist() == [128]
    _, out = aggregate(kernels, np.stack([big / 4, big / 2]), 2)
    np.testing.assert_allclose(out, big * 0.75, rtol=1e-6)
    tiny = np.array([np.finfo(np.float64).smallest_subnormal, 1e-300], np.float64)
    exps, _ = kernels.block_exponents(tiny, 2)
    assert exps.tolist() == [blockfp.EXPONENT_MIN[np.dtype(np.float64)]]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_flagged_in_the_same_pass(kernels, dtype, bad):
    x = np.linspace(-5, 5, 1000).astype(dtype)
    clean, flag = kernels.block_exponents(x, 64, 64)
    assert not flag
    for where in (0, 517, 999):
        y = x.copy()
        y[where] = bad
        exps, flag = kernels.block_exponents(y, 64, 64)
        assert flag, (where, bad)
        others = np.arange(exps.size) != where // 64
        assert (exps[others] == clean[others]).all()


def test_int32_sums_exactly(kernels):
    rng = np.random.default_rng(3)
    n, k = 4, 100
    xs = rng.integers(-(2**29), 2**29, (n, 1000), dtype=np.int32)
    agreed, out = aggregate(kernels, xs, k, b=4)
    assert (agreed <= 30).all()
    np.testing.assert_array_equal(out, xs.astype(np.int64).sum(axis=0))


def test_int32_overflow_is_reported_not_wrapped(kernels):
    xs = np.array([[2**30, 5], [2**30, 7]], np.int32)
    with pytest.raises(OverflowError, match=r"int32 sub-block 0 .*exponent 31.* 2 workers"):
        aggregate(kernels, xs, 2)
    # One worker alone cannot overflow: the same values pass.
    _, out = aggregate(kernels, xs[:1], 2)
    np.testing.assert_array_equal(out, xs[0])
    low = np.array([[-(2**31), 0]], np.int32)
    exps, _ = kernels.block_exponents(low[0], 2)
    assert exps.tolist() == [32]
    with pytest.raises(OverflowError):
        kernels.quantize(low[0], exps, 1, 2)


def test_bad_arguments_name_the_problem(kernels):
    with pytest.raises(TypeError, match="int64"):
        kernels.block_exponents(np.ones(4, np.int64), 2)
    with pytest.raises(ValueError, match="1-D contiguous"):
        kernels.block_exponents(np.ones((4, 4), np.float32)[:, 0], 2)
    with pytest.raises(ValueError, match="K must be"):
        kernels.block_exponents(np.ones(4, np.float32), 0)
    with pytest.raises(ValueError, match="expected 2 sub-block exponents"):
        kernels.quantize(np.ones(4, np.float32), np.zeros(3, np.int16), 2, 2)
    with pytest.raises(ValueError, match="AVERAGE"):
        kernels.dequantize(np.zeros(2, ">i4"), np.zeros(1, np.int16), 2, 2,
                           np.empty(2, np.int32), True)


def test_shift_uses_the_largest_safe_power_of_two():
    for bits in (32, 16):
        for n in range(1, 70):
            for e in (-126, 0, 17):
                shift = blockfp.shift_for(e, n, np.dtype(np.float32), bits)
                # n workers at the largest magnitude fit the width; one more bit would not.
                top = 2 ** (bits - 1) - 1
                assert n * 2.0 ** (e + shift) <= top < n * 2.0 ** (e + shift + 1)


def test_kernels_selector():
    with pytest.raises(ValueError, match="INA_INTERNAL_KERNELS"):
        kernel_module.load("turbo")


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("average", [False, True])
def test_float32_vector_path_matches_reference_at_its_edges(n, average):
    """The AVX2 float32 kernels take float32 arithmetic only where a sub-block's scale is
    a power of two in float32's normal range: exponents on either side of those edges,
    rounding ties, the extreme int32 sums and partial vectors give the reference's bits."""
    fast, ref = kernel_module.load("fast"), kernel_module.load("numpy")
    k, b = 77, 32  # sub-blocks of 32, 32 and 13: whole vectors and a scalar tail
    edges = [-126, -100, -99, -98, -97, -96, -95, -5, 0, 20, 100, 127, 128]
    rng = np.random.default_rng(7)
    for e in edges:
        exps = np.full(3, e, np.int16)
        shift = blockfp.shift_for(e, n, np.dtype(np.float32), 32)
        # Values below 2**e, among them ties (m + 1/2) 2**-shift that round half to even.
        x = (rng.uniform(-1, 1, k) * 2.0 ** e).astype(np.float32)
        ties = (np.arange(-20, 20) + 0.5) * 2.0 ** -shift
        x[:40] = np.where(np.abs(ties) < 2.0 ** e, ties, 0).astype(np.float32)
        quantized = fast.quantize(x, exps, n, k, b)
        assert quantized.tobytes() == ref.quantize(x, exps, n, k, b).tobytes(), e
        q = rng.integers(-2**31, 2**31, k).astype(">i4")
        q[:8] = [2**31 - 1, -2**31, 1, -1, 0, 2**24 + 1, -(2**24 + 3), 2**30 + 64]
        out_fast, out_ref = np.empty(k, np.float32), np.empty(k, np.float32)
        with np.errstate(over="ignore"):
            fast.dequantize(q, exps, n, k, out_fast, average, b)
            ref.dequantize(q, exps, n, k, out_ref, average, b)
        assert out_fast.tobytes() == out_ref.tobytes(), e
