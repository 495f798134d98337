"""torch/staging.py: tensors as the runtime's arrays (views where the memory allows,
host copies elsewhere, bfloat16 widened or as its bits), the ops and checks every torch
binding shares, the requests, and submit_allreduce's four paths (in place, into another
tensor, a window at a time, a whole copy) at 2 ranks in one process over a background
runtime on tests/threadcomm.py's ThreadPeers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ina_collectives.collectives.ops import Op
from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.settings import Settings
from ina_collectives.torch import staging
from ina_collectives.torch.overlap import priority
from tests.threadcomm import ThreadPeers, run_ranks

# -- ops and checks -----------------------------------------------------------------------------


def test_op_of_reads_horovods_op_and_its_deprecated_average():
    assert staging.op_of(None, None) == staging.Average
    assert staging.op_of(None, None, default=staging.Sum) == staging.Sum
    assert staging.op_of(None, True) == staging.Average
    assert staging.op_of(None, False) == staging.Sum
    assert staging.op_of(staging.Max, None) == staging.Max
    with pytest.raises(ValueError, match="give op or the deprecated average, not both"):
        staging.op_of(staging.Sum, True)
    with pytest.raises(NotImplementedError, match="Adasum is not implemented"):
        staging.op_of(staging.Adasum, None)
    with pytest.raises(ValueError, match="unknown op 'median'"):
        staging.op_of("median", None)


def test_check_tensor_names_what_it_refuses():
    t = torch.ones(2)
    assert staging.check_tensor(t, "x") is t
    with pytest.raises(TypeError, match="allreduce takes a torch.Tensor, got ndarray"):
        staging.check_tensor(np.ones(2), "allreduce")
    with pytest.raises(TypeError, match=r"x: dtype torch.bool is not supported; supported: "
                                        r"uint8, int8, int16, int32, int64, float16, "
                                        r"float32, float64, bfloat16"):
        staging.check_tensor(torch.ones(2, dtype=torch.bool), "x")
    with pytest.raises(TypeError, match="x: sparse tensors are not supported"):
        staging.check_tensor(torch.eye(2).to_sparse(), "x")


def test_contiguous_cpu_tensors_are_handed_over_as_their_own_memory():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert staging.direct(t)
    view = staging.to_numpy(t)
    assert view.shape == (6,) and view.dtype == np.int32
    view[0] = 99  # the tensor's own memory
    assert t[0, 0].item() == 99
    strided = torch.arange(12.0).reshape(3, 4).t()
    assert not staging.direct(strided)
    copied = staging.to_numpy(strided)
    assert copied.tolist() == strided.reshape(-1).tolist()
    copied[0] = -1
    assert strided[0, 0].item() == 0.0  # a copy
    assert not staging.direct(torch.ones(2, dtype=torch.bfloat16))


def test_bfloat16_moves_as_its_bits_and_reduces_widened():
    t = torch.tensor([1.5, -2.0, 3.0e38], dtype=torch.bfloat16)
    assert (staging.moved_as(t), staging.reduced_as(t)) == ("int16", "float32")
    assert (staging.moved_as(torch.ones(1, dtype=torch.float16)),
            staging.reduced_as(torch.ones(1, dtype=torch.float16))) == ("float16",
                                                                       "float16")
    bits = staging.to_numpy(t)
    assert bits.dtype == np.int16 and bits.tolist() == t.view(torch.int16).tolist()
    wide = staging.to_numpy(t, widen=True)
    assert wide.dtype == np.float32 and wide.tolist() == t.float().tolist()
    # Back: from the bits exactly, from float32 rounded.
    assert torch.equal(staging.from_numpy(bits, t, (3,)), t)
    back = staging.from_numpy(np.array([1.5, 2.0 ** -3], np.float32), t, (2, 1))
    assert back.dtype == torch.bfloat16 and back.shape == (2, 1)
    assert back.flatten().tolist() == [1.5, 0.125]


def test_copy_from_writes_into_any_layout():
    target = torch.zeros(4, 3).t()  # (3, 4), not contiguous
    staging.copy_from(target, np.arange(12, dtype=np.float32))
    assert target.tolist() == np.arange(12).reshape(3, 4).tolist()
    half = torch.zeros(2, dtype=torch.bfloat16)
    staging.copy_from(half, np.array([0.5, 4.0], np.float32))
    assert half.tolist() == [0.5, 4.0]


def test_the_requests_say_what_every_rank_must_agree_on():
    t = torch.ones(2, 3, dtype=torch.bfloat16)
    moved = staging.data_request("broadcast", t, "w", root=1)
    assert (moved.kind, moved.name, moved.dtype, moved.wire, moved.shape, moved.root) == \
        ("broadcast", "w", "bfloat16", np.dtype(np.int16), (2, 3), 1)
    assert moved.op is None
    reduced = staging.reduction_request("allreduce", t, "g", staging.Average, prescale=2,
                                        postscale=0.5)
    assert (reduced.dtype, reduced.wire, reduced.op) == ("bfloat16", np.dtype(np.float32),
                                                         Op.AVERAGE)
    assert (reduced.prescale, reduced.postscale) == (2.0, 0.5)


# -- submit_allreduce at two ranks --------------------------------------------------------------

def on_runtimes(n, body):
    def rank(comm):
        runtime = BackgroundRuntime(comm, Settings(switch="", timeout=5.0, cycle_time=0.001),
                                    ordered=True)
        try:
            return body(runtime, comm.Get_rank())
        finally:
            runtime.shutdown(10)
    return run_ranks(n, rank, timeout=60, kind=ThreadPeers)


def reduced(runtime, tensor, output, name, op=staging.Sum, **kwargs):
    handle, finish = staging.submit_allreduce(runtime, tensor, output, name, op, **kwargs)
    result = handle.wait(runtime.wait_seconds(), name)
    return handle, finish(result)


def test_submit_allreduce_reduces_in_place_into_another_tensor_and_through_copies():
    def body(runtime, r):
        out = {}
        inplace = torch.full((4,), float(r + 1))
        _, got = reduced(runtime, inplace, inplace, "inplace")
        out["inplace"] = (got is inplace, inplace.tolist())
        source, target = torch.full((3,), float(r)), torch.zeros(3)
        _, got = reduced(runtime, source, target, "into", staging.Max)
        out["into"] = (got is target, source.tolist(), target.tolist())
        half = torch.tensor([0.5, 1.0, -2.0], dtype=torch.bfloat16) * (r + 1)
        _, got = reduced(runtime, half, half, "bfloat16", staging.Average)
        out["bfloat16"] = (half.dtype, half.tolist())
        strided = (torch.arange(6.0).reshape(2, 3) * (r + 1)).t()
        _, got = reduced(runtime, strided, strided, "strided")
        out["strided"] = strided.clone()
        handle, _ = reduced(runtime, torch.ones(2), torch.ones(2), "scaled", prescale=2.0,
                            postscale=0.25)
        out["scaled"] = handle.request.prescale, handle.request.postscale
        return out

    for out in on_runtimes(2, body):
        assert out["inplace"] == (True, [3.0] * 4)
        assert out["into"][0] is True and out["into"][2] == [1.0] * 3  # MAX of 0, 1
        assert out["bfloat16"] == (torch.bfloat16, [0.75, 1.5, -3.0])
        assert torch.equal(out["strided"], (torch.arange(6.0).reshape(2, 3) * 3).t())
        assert out["scaled"] == (2.0, 0.25)


def test_the_source_of_an_allreduce_into_another_tensor_is_left_alone():
    def body(runtime, r):
        source, target = torch.full((3,), float(r)), torch.zeros(3)
        reduced(runtime, source, target, "into")
        return source.tolist(), target.tolist()

    assert on_runtimes(2, body) == [([0.0] * 3, [1.0] * 3), ([1.0] * 3, [1.0] * 3)]


def test_the_priority_comes_from_the_call_or_the_block_around_it():
    def body(runtime, r):
        t = torch.ones(2)
        plain, _ = reduced(runtime, t, t, "plain")
        with priority(7):
            inside, _ = reduced(runtime, t, t, "inside")
            given, _ = reduced(runtime, t, t, "given", priority=-3)
        with pytest.raises(TypeError, match="priority must be an int, got float"):
            staging.submit_allreduce(runtime, t, t, "bad", staging.Sum, priority=1.5)
        return plain.request.priority, inside.request.priority, given.request.priority

    assert on_runtimes(2, body) == [(0, 7, -3)] * 2
