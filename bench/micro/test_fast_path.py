"""Fast-path microbenchmarks: 64 MiB of float32 into INA packets and back.

    python -m bench.micro bench/micro/test_fast_path.py    # or plain pytest

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

RANKS = (1,)  # the rank counts python -m bench.micro runs it at

NBYTES = 64 << 20
BLOCK = P.DEFAULT_BLOCK
N_WORKERS = 4
SLOTS = 64
BACKENDS = {"numpy": kernels.load("numpy"), "fast": kernels.load("fast")}
WIDTHS = [32, 16]


def k_for(bits: int) -> int:
    return P.max_elements(P.MAX_DATAGRAM, BLOCK, bits)


@pytest.fixture(scope="module")
def tensor():
    return np.random.default_rng(0).standard_normal(NBYTES // 4).astype(np.float32)


@pytest.fixture(scope="module", params=WIDTHS, ids=lambda b: f"int{b}")
def bits(request):
    return request.param


@pytest.fixture(scope="module")
def ring(tensor, bits):
    k = k_for(bits)
    return np.zeros((-(-tensor.size // k), P.packet_bytes(k, BLOCK, bits)), np.uint8)


@pytest.fixture(scope="module")
def results(tensor, ring, bits):
    """The ring filled with result packets, as the switch would send them back."""
    fast, k = BACKENDS["fast"], k_for(bits)
    exps, _ = fast.block_exponents(tensor, k, BLOCK)
    lengths = fast.pack_chunks(tensor, P.JobFormat(1, N_WORKERS, k, BLOCK, bits), exps, exps,
                               0, ring.shape[0], ring, P.Stamp(0, SLOTS))
    ring[:, P.OFF_FLAGS] |= P.FLAG_RESULT
    return ring.copy(), lengths


def _record(benchmark):
    if benchmark.stats is None:  # --benchmark-disable: run once, nothing measured
        return
    benchmark.extra_info["bandwidth_GBps"] = NBYTES / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["elements_per_s"] = NBYTES / 4 / benchmark.stats.stats.median


def _quantize(backend, tensor, ring, bits):
    k = k_for(bits)
    exps, nonfinite = backend.block_exponents(tensor, k, BLOCK)
    assert not nonfinite
    return backend.pack_chunks(tensor, P.JobFormat(1, N_WORKERS, k, BLOCK, bits), exps, exps,
                               0, ring.shape[0], ring, P.Stamp(0, SLOTS))


@pytest.mark.benchmark(group="quantize-64MiB")
def test_quantize_memcpy(benchmark, tensor):
    dst = np.empty_like(tensor)
    benchmark(np.copyto, dst, tensor)
    _record(benchmark)


@pytest.mark.benchmark(group="quantize-64MiB")
@pytest.mark.parametrize("name", ["numpy", "fast"])
def test_quantize(benchmark, tensor, ring, bits, name):
    benchmark.name = f"test_quantize_int{bits}_{name}"  # names end in _numpy / _fast
    lengths = benchmark(_quantize, BACKENDS[name], tensor, ring, bits)
    k = k_for(bits)
    assert lengths.sum() == sum(P.packet_bytes(min(k, tensor.size - c * k), BLOCK, bits)
                                for c in range(ring.shape[0]))
    _record(benchmark)


@pytest.mark.benchmark(group="dequantize-64MiB")
def test_dequantize_memcpy(benchmark, tensor):
    dst = np.empty_like(tensor)
    benchmark(np.copyto, dst, tensor)
    _record(benchmark)


@pytest.mark.benchmark(group="dequantize-64MiB")
@pytest.mark.parametrize("name", ["numpy", "fast"])
def test_dequantize(benchmark, tensor, results, bits, name):
    benchmark.name = f"test_dequantize_int{bits}_{name}"
    rows, lengths = results
    out = np.empty_like(tensor)
    status = benchmark(BACKENDS[name].unpack_results, rows, lengths, out,
                       P.JobFormat(1, N_WORKERS, k_for(bits), BLOCK, bits))
    assert (status == P.PARSE_OK).all()
    # one worker's values read as the sum of 4: x / 4 * 4 within the width's resolution
    tol = 2.0 ** (-28 if bits == 32 else -12) * 8
    np.testing.assert_allclose(out, tensor, rtol=0, atol=tol * np.abs(tensor).max())
    _record(benchmark)
