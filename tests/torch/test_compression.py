"""torch/compression.py: the compressors on their own (what each sends and gives back,
dtype by dtype), switch_values' width for the submissions in its block, and at 2 ranks
in one process (tests/torch/hvd_threads.py) allreduce, grouped allreduce and
DistributedOptimizer with Compression.fp16 (the reduction in float16, the dtype
restored), Compression.switch16 (16-bit values asked of the switch; without one, exact),
and ranks that compress differently (an error on every rank naming the mismatch)."""
from __future__ import annotations

import pytest
import torch

from ina_collectives.torch import handle_table, mpi_ops
from ina_collectives.torch.compression import (
    SWITCH_BITS,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    Switch16Compressor,
    switch_values,
)
from tests.torch.hvd_threads import mismatch, on_hvd, per_thread_world  # noqa: F401

# 1 + 2**-12 is a float32 that float16 (10 bits of mantissa) rounds to 1.0.
FINE = 1 + 2 ** -12


def test_compression_names_horovods_compressors_and_the_switch16_one():
    assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor
    assert Compression.switch16 is Switch16Compressor
    assert issubclass(Switch16Compressor, NoneCompressor)
    assert Switch16Compressor.switch_value_bits == 16
    assert not hasattr(FP16Compressor, "switch_value_bits")
    with pytest.raises(NotImplementedError):
        Compressor.compress(torch.ones(1))
    with pytest.raises(NotImplementedError):
        Compressor.decompress(torch.ones(1), None)


@pytest.mark.parametrize("compressor", [NoneCompressor, Switch16Compressor])
def test_none_and_switch16_send_the_tensor_itself_and_give_it_back(compressor):
    t = torch.full((2, 3), FINE)
    sent, ctx = compressor.compress(t)
    assert sent is t and ctx is None
    assert compressor.decompress(sent, ctx) is sent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fp16_sends_floats_as_float16_and_restores_their_dtype(dtype):
    t = torch.tensor([FINE, 3.0, -0.5, 70000.0], dtype=torch.float32).to(dtype)
    sent, ctx = FP16Compressor.compress(t)
    assert sent.dtype == torch.float16 and ctx == dtype and sent.shape == t.shape
    assert torch.equal(sent, t.to(torch.float16))
    back = FP16Compressor.decompress(sent, ctx)
    assert back.dtype == dtype
    assert torch.equal(back, t.to(torch.float16).to(dtype))
    if dtype != torch.bfloat16:  # (bfloat16 rounds 1 + 2**-12 to 1.0 itself)
        assert back[0].item() == 1.0 and t[0].item() == FINE


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.int64, torch.uint8])
def test_fp16_leaves_float16_and_integer_tensors_as_they_are(dtype):
    t = torch.arange(5).to(dtype)
    sent, ctx = FP16Compressor.compress(t)
    assert sent is t and ctx == dtype
    assert FP16Compressor.decompress(sent, ctx) is sent
    assert FP16Compressor.decompress(sent, None) is sent


def test_switch_values_sets_the_width_of_its_block_only_and_nests():
    assert SWITCH_BITS.get() == 0
    with switch_values(Compression.switch16):
        assert SWITCH_BITS.get() == 16
        with switch_values(Compression.fp16):
            assert SWITCH_BITS.get() == 0
        assert SWITCH_BITS.get() == 16
    assert SWITCH_BITS.get() == 0
    with pytest.raises(KeyError):
        with switch_values(Compression.switch16):
            raise KeyError("out of the block")
    assert SWITCH_BITS.get() == 0


# -- at 2 ranks ---------------------------------------------------------------------------

@pytest.mark.usefixtures("per_thread_world")
def test_allreduce_with_fp16_reduces_in_float16_and_gives_back_the_input_dtype():
    def body(hvd, r):
        x = torch.full((4,), FINE) + r  # FINE on rank 0, FINE + 1 on rank 1
        x64 = x.double()
        return {"none": hvd.allreduce(x, op=hvd.Sum),
                "fp16": hvd.allreduce(x, op=hvd.Sum, compression=Compression.fp16),
                "fp16 float64": hvd.allreduce(x64, compression=Compression.fp16),
                "grouped": hvd.grouped_allreduce([x, x64, torch.arange(3) * (r + 1)],
                                                 op=hvd.Sum,
                                                 compression=Compression.fp16),
                "input": x}

    for out in on_hvd(2, body):
        assert out["none"].dtype == torch.float32
        assert torch.equal(out["none"], torch.full((4,), 2 * FINE + 1))
        # float16: each rank's FINE is 1.0 on the wire (and FINE + 1 is 2.0).
        assert out["fp16"].dtype == torch.float32
        assert torch.equal(out["fp16"], torch.full((4,), 3.0))
        assert out["fp16 float64"].dtype == torch.float64
        assert torch.equal(out["fp16 float64"], torch.full((4,), 1.5, dtype=torch.float64))
        grouped = out["grouped"]
        assert [g.dtype for g in grouped] == [torch.float32, torch.float64, torch.int64]
        assert torch.equal(grouped[0], torch.full((4,), 3.0))
        assert torch.equal(grouped[1], torch.full((4,), 3.0, dtype=torch.float64))
        assert torch.equal(grouped[2], torch.tensor([0, 3, 6]))
        assert out["input"].dtype == torch.float32 and out["input"][0].item() in (
            FINE, FINE + 1)


@pytest.mark.usefixtures("per_thread_world")
def test_switch16_asks_the_switch_for_16_bit_values_and_without_one_is_exact():
    def body(hvd, r):
        x = torch.full((5,), FINE * (r + 1))
        with switch_values(Compression.switch16):
            handle = mpi_ops.allreduce_async(x, op=hvd.Sum, name="asked")
        bits = handle_table._handles[handle].handles[0].request.switch_bits
        asked = hvd.synchronize(handle)
        plain = mpi_ops.allreduce_async(x, op=hvd.Sum, name="plain")
        plain_bits = handle_table._handles[plain].handles[0].request.switch_bits
        hvd.synchronize(plain)
        through_api = hvd.allreduce(x, op=hvd.Sum, compression=Compression.switch16)
        return bits, plain_bits, asked, through_api

    for bits, plain_bits, asked, through_api in on_hvd(2, body):
        assert (bits, plain_bits) == (16, 0)
        assert torch.equal(asked, torch.full((5,), 3 * FINE))
        assert torch.equal(through_api, torch.full((5,), 3 * FINE))


@pytest.mark.usefixtures("per_thread_world")
def test_ranks_that_compress_differently_fail_on_every_rank_naming_the_mismatch():
    def body(hvd, r):
        def attempt(compression, name):
            try:
                hvd.allreduce(torch.ones(4), compression=compression, name=name)
            except Exception as exc:  # compared by the main thread
                return type(exc).__name__, str(exc)
            return "nothing", ""

        return (attempt([Compression.switch16, Compression.none][r], "bits"),
                attempt([Compression.fp16, Compression.none][r], "fp16"))

    for bits, fp16 in on_hvd(2, body):
        assert bits[0] == fp16[0] == "OperationError"
        assert mismatch(bits[1]) == ("Mismatched switch value bits (compression) of "
                                     "allreduce 'bits'", {0: "16", 1: "0"}), bits
        assert mismatch(fp16[1]) == ("Mismatched dtype of allreduce 'fp16'",
                                     {0: "float16", 1: "float32"}), fp16


@pytest.mark.usefixtures("per_thread_world")
def test_distributed_optimizer_with_fp16_hands_back_float32_gradients_reduced_in_float16():
    def model_of():
        model = torch.nn.Linear(6, 3)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return model

    def data(r):
        g = torch.Generator().manual_seed(10 + r)
        return torch.randn(8, 6, generator=g)

    def body(hvd, r):
        model = model_of()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             compression=Compression.fp16)
        model(data(r)).pow(2).sum().backward()
        optimizer.synchronize()
        return [p.grad.clone() for p in model.parameters()]

    grads = []
    for r in range(2):
        model = model_of()
        model(data(r)).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    exact = [(a + b) / 2 for a, b in zip(*grads)]
    results = on_hvd(2, body)
    for got in results:
        for g, e, other in zip(got, exact, results[0]):
            assert g.dtype == torch.float32 and torch.equal(g, other)
            assert torch.equal(g, g.half().float())  # every value a float16's
            torch.testing.assert_close(g, e, rtol=2e-3, atol=2e-3)
            assert not torch.equal(g, e)  # (float32 sums would not all be float16s)
