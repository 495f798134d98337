"""Deterministic per-rank inputs, their exact reductions and the INA error bound, shared
by the ranks and the checks."""
from __future__ import annotations

import numpy as np

from ina_collectives.ina.reference import blockfp
from ina_collectives.protocol import DEFAULT_BLOCK, MAX_ELEMENTS

OPS = ("sum", "prod", "min", "max", "average")
FLOATS = ("float16", "float32", "float64")
INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def make_input(dtype: str, op: str, count: int, seed: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "f":
        if op == "prod":  # magnitudes near 1 keep a product of n values in range
            x = rng.uniform(0.5, 1.5, count) * rng.choice([-1.0, 1.0], count)
        else:
            x = rng.standard_normal(count) * 10.0
        return x.astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)


def inputs_of_all_ranks(dtype: str, op: str, count: int, seed: int, n: int) -> np.ndarray:
    return np.stack([make_input(dtype, op, count, seed, r) for r in range(n)]).reshape(n, count)


def check_result(result: np.ndarray, dtype: str, op: str, count: int, seed: int,
                 n: int) -> None:
    """Assert that ``result`` is the op-reduction over n ranks (exact for integers and
    MIN/MAX; within n rounding errors of the exact value for float SUM/PROD/AVERAGE)."""
    dt = np.dtype(dtype)
    xs = inputs_of_all_ranks(dtype, op, count, seed, n)
    assert result.dtype == dt and result.shape == (count,), (result.dtype, result.shape)
    if op in ("min", "max"):
        expected = (np.minimum if op == "min" else np.maximum).reduce(xs, axis=0)
        np.testing.assert_array_equal(result, expected)
        return
    if dt.kind in "iu":
        ufunc = np.add if op == "sum" else np.multiply
        with np.errstate(all="ignore"):
            expected = ufunc.reduce(xs, axis=0, dtype=dt)  # wraps, as MPI does
        np.testing.assert_array_equal(result, expected)
        return
    wide = xs.astype(np.float64)
    eps = float(np.finfo(dt).eps)
    if op == "prod":
        exact = np.prod(wide, axis=0)
        bound = 2 * n * eps * np.abs(exact)
    else:
        exact = wide.sum(axis=0)
        bound = 2 * n * eps * np.abs(wide).sum(axis=0)
        if op == "average":
            exact, bound = exact / n, bound / n
    bound = bound + float(np.finfo(dt).tiny)
    error = np.abs(result.astype(np.float64) - exact)
    worst = int(np.argmax(error - bound)) if count else 0
    assert (error <= bound).all(), (
        f"{op} {dtype} n={n}: element {worst} is {result[worst]!r}, exact {exact[worst]!r}, "
        f"error {error[worst]:.3g} > bound {bound[worst]:.3g}")


def check_within_bound(result, dtype, op, count, seed, n, k=MAX_ELEMENTS,
                       block=DEFAULT_BLOCK, bits=32):
    """The bound of docs/quantization.md for every element, from all ranks' inputs."""
    xs = inputs_of_all_ranks(dtype, op, count, seed, n)
    wide = np.float32 if dtype == "float16" else dtype
    agreed = np.max([blockfp.block_exponents(x.astype(wide), k, block)[0] for x in xs],
                    axis=0)
    average = op == "average"
    exact = xs.astype(np.longdouble).sum(axis=0) / (n if average else 1)
    exps = blockfp.element_exponents(agreed, count, k, block)
    bound = blockfp.error_bound(n, exps, wide, result.astype(wide), average, bits)
    if dtype == "float16":  # float32 result rounded once more to float16
        bound = bound + np.spacing(np.abs(result)).astype(np.float64)
    error = np.abs(result.astype(np.longdouble) - exact).astype(np.float64)
    bad = np.flatnonzero(error > bound * (1 + 1e-9) + np.abs(exact).astype(float) * 2**-60)
    assert bad.size == 0, (f"{dtype} {op} n={n}: element {bad[0]} = {result[bad[0]]}, exact "
                           f"{exact[bad[0]]}, error {error[bad[0]]:.3g} > {bound[bad[0]]:.3g}")

