"""Fast-path microbenchmarks: 64 MiB of float32 into INA packets and back.

    python -m pytest bench/test_fast_path.py

Each group holds three tests: ``_memcpy`` (np.copyto of the same 64 MiB: the one-core
memory limit), ``_numpy`` (the reference in ina_collectives) and ``_fast`` (_fast/).
Quantize is the whole sender pass: the exponent scan (proposals and the NaN/Inf flag),
then every chunk quantized into a packet with its header. Dequantize parses every
result packet and writes its chunk into the output. Packets use the loopback K
(64 KiB datagrams) and land in a ring as large as the tensor, so both sides stream
through memory as memcpy does. bandwidth_GBps in extra_info counts tensor bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina import kernels

NBYTES = 64 << 20
K = P.MAX_ELEMENTS
N_WORKERS = 4
SLOTS = 64
BACKENDS = {"numpy": kernels.load("numpy"), "fast": kernels.load("fast")}


@pytest.fixture(scope="module")
def tensor():
    return np.random.default_rng(0).standard_normal(NBYTES // 4).astype(np.float32)


@pytest.fixture(scope="module")
def ring(tensor):
    chunks = -(-tensor.size // K)
    return np.zeros((chunks, P.HEADER_BYTES + P.ELEMENT_BYTES * K), np.uint8)


@pytest.fixture(scope="module")
def results(tensor, ring):
    """The ring filled with result packets, as the switch would send them back."""
    fast = BACKENDS["fast"]
    exps, _ = fast.block_exponents(tensor, K)
    lengths = fast.pack_chunks(tensor, K, N_WORKERS, exps, exps, 0, ring.shape[0], ring,
                               SLOTS, 0, 1, 0)
    ring[:, P.OFF_FLAGS] |= P.FLAG_RESULT
    return ring.copy(), lengths


def _record(benchmark):
    benchmark.extra_info["bandwidth_GBps"] = NBYTES / benchmark.stats.stats.median / 1e9


def _quantize(backend, tensor, ring):
    exps, nonfinite = backend.block_exponents(tensor, K)
    assert not nonfinite
    return backend.pack_chunks(tensor, K, N_WORKERS, exps, exps, 0, ring.shape[0], ring,
                               SLOTS, 0, 1, 0)


@pytest.mark.benchmark(group="quantize-64MiB")
def test_quantize_memcpy(benchmark, tensor):
    dst = np.empty_like(tensor)
    benchmark(np.copyto, dst, tensor)
    _record(benchmark)


@pytest.mark.benchmark(group="quantize-64MiB")
@pytest.mark.parametrize("name", ["numpy", "fast"])
def test_quantize(benchmark, tensor, ring, name):
    benchmark.name = f"test_quantize_{name}"  # the group's names end in _numpy / _fast
    lengths = benchmark(_quantize, BACKENDS[name], tensor, ring)
    assert lengths.sum() == NBYTES + ring.shape[0] * P.HEADER_BYTES
    _record(benchmark)


@pytest.mark.benchmark(group="dequantize-64MiB")
def test_dequantize_memcpy(benchmark, tensor):
    dst = np.empty_like(tensor)
    benchmark(np.copyto, dst, tensor)
    _record(benchmark)


@pytest.mark.benchmark(group="dequantize-64MiB")
@pytest.mark.parametrize("name", ["numpy", "fast"])
def test_dequantize(benchmark, tensor, results, name):
    benchmark.name = f"test_dequantize_{name}"
    rows, lengths = results
    out = np.empty_like(tensor)
    status = benchmark(BACKENDS[name].unpack_results, rows, lengths, out, N_WORKERS, K, 1)
    assert (status == P.PARSE_OK).all()
    np.testing.assert_allclose(out, tensor, rtol=0, atol=2.0**-24 * np.abs(tensor).max())
    _record(benchmark)
