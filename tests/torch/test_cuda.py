"""The CUDA path on a GPU: tensors staged through pinned host memory a window at a time
(torch/windows.py), behind the producer's stream and ahead of the consumer's, through the
runtime, and each API in a 2-rank job through the switch. Every test here skips without
a GPU; ``make gpu-check`` (bench/gpu/gpu_check.py) runs them on one and fails if any skips."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from ina_collectives.errors import CollectiveTimeout
from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.settings import Settings
from ina_collectives.torch import staging, windows
from ina_collectives.torch.windows import HostWindows
from tests.integration import mpirun
from tests.integration.torch_cases import torch_input
from tests.torch import cuda_cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (make gpu-check runs these on one)")

# About a second of GPU time: long enough that a copy not ordered after it is caught.
SPIN_CYCLES = 2_000_000_000


def spin(stream: torch.cuda.Stream | None = None) -> None:
    """Keep ``stream`` (the current one by default) busy for about a second."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(SPIN_CYCLES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_cuda_tensor_goes_through_pinned_windows_and_comes_back(dtype):
    n = 3 * (1 << 18) + 5  # 4 windows of 1 MiB of host buffer (bfloat16: as float32)
    t = (torch.arange(n, device="cuda") % 251 - 125).to(dtype)
    out = torch.zeros_like(t)
    w = HostWindows(t, out, window_bytes=1 << 20)
    wide = np.float32 if dtype == torch.bfloat16 else np.dtype(str(dtype).split(".")[1])
    assert w.buffer.is_pinned() and w.host.dtype == wide
    assert len(w.events) == w.windows == -(-n * w.host.itemsize // (1 << 20))
    assert w.copied_in == n * t.element_size()  # queued at once, on the side stream
    w.landed(0, n)
    np.testing.assert_array_equal(w.host, t.float().cpu().numpy().astype(wide))
    w.host *= 2
    w.arrived(0, n // 2)
    w.arrived(n // 2, n)
    assert w.finish() is out and out.device == t.device
    torch.testing.assert_close(out, 2 * t, rtol=0, atol=0)


def test_the_copy_in_waits_for_the_producers_stream():
    """The gradient is written on the caller's stream after a second of other work: the
    side stream's copy must see the written values, not the zeros before them."""
    t = torch.zeros(1 << 20, device="cuda")
    spin()
    t.fill_(3.0)
    w = HostWindows(t, t, window_bytes=1 << 20)
    w.landed(0, t.numel())
    assert (w.host == 3.0).all(), np.unique(w.host)


def test_the_callers_stream_waits_for_the_copy_back():
    """The copy back queues behind a second of work on its side stream: what the caller's
    stream reads after finish() must be the results, with no synchronize in between."""
    t = torch.ones(1 << 20, device="cuda")
    w = HostWindows(t, t, window_bytes=1 << 20)
    w.landed(0, t.numel())
    w.host[:] = 5.0
    spin(windows._side_streams(t.device)[1])
    w.arrived(0, t.numel())
    seen = w.finish().clone()  # on the caller's stream
    assert seen.eq(5.0).all().item(), seen.unique()


def test_a_copy_to_the_host_held_up_on_the_device_times_out_naming_it():
    t = torch.zeros(1 << 20, device="cuda")
    spin()  # the side stream waits on this stream: the copy cannot start for a second
    w = HostWindows(t, t, window_bytes=1 << 20, seconds=0.05)
    with pytest.raises(CollectiveTimeout, match=r"waited 0.05 s for the copy of elements "
                                                r"0..262144 of a cuda:0 tensor to host"):
        w.landed(0, 10)
    torch.cuda.synchronize()


@pytest.fixture
def runtime():
    rt = BackgroundRuntime(MPI.COMM_SELF, Settings(partition_bytes=1 << 20, cycle_time=0.001))
    yield rt
    rt.shutdown(10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_runtime_reduces_a_cuda_tensor_window_by_window(runtime, monkeypatch, dtype):
    """Partitions of 1 MiB over windows of 256 KiB: each partition is asked for before it
    is read and its results go back before the next one (as on CPU, test_windows.py), in
    place and out of place, and every value comes back on the device."""
    monkeypatch.setattr(windows, "WINDOW_BYTES", 256 << 10)
    events = []
    landed, arrived = HostWindows.landed, HostWindows.arrived
    monkeypatch.setattr(HostWindows, "landed",
                        lambda self, a, b: (events.append("in"), landed(self, a, b)))
    monkeypatch.setattr(HostWindows, "arrived",
                        lambda self, a, b: (events.append("out"), arrived(self, a, b)))
    n = 4 * (1 << 20) // 4  # 4 partitions of float32 (bfloat16 reduces as float32)
    t = (torch.arange(n, device="cuda") % 251 - 125).to(dtype)
    want = t.clone()
    out = torch.empty_like(t)
    handle, finish = staging.submit_allreduce(runtime, t, out, "out", staging.Sum)
    handle.wait(30, "the allreduce")
    assert finish(handle.result) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    handle, finish = staging.submit_allreduce(runtime, t, t, "in", staging.Sum)
    handle.wait(30, "the allreduce")
    assert finish(handle.result) is t
    torch.testing.assert_close(t, want, rtol=0, atol=0)
    parts = n * (2 if dtype == torch.float16 else 4) // (1 << 20)  # bytes reduced / 1 MiB
    assert events == ["in", "out"] * parts * 2


def test_a_non_contiguous_cuda_tensor_is_staged_whole(runtime):
    t = torch.arange(64.0, device="cuda").reshape(8, 8).t()
    want = t.clone()
    handle, finish = staging.submit_allreduce(runtime, t, t, "nc", staging.Sum)
    handle.wait(30, "the allreduce")
    torch.testing.assert_close(finish(handle.result), want, rtol=0, atol=0)
    assert t.is_cuda


@pytest.mark.mpi
def test_each_api_reduces_cuda_tensors_through_the_switch(switch):
    """Two ranks (on one GPU, or one each): the Horovod API's allreduce of every float
    dtype, DDP on backend "ina", and DDP on gloo with the hook, all on the device and
    through the switch, against the values computed here and DDP on the CPU."""
    shape, steps = (3, 1 << 20), 3
    env = {"INA_SWITCH": switch.address_text, "INA_SWITCH_MIN_BYTES": "0"}
    results = mpirun.run(2, cuda_cases.cuda_apis,
                         {"device": "cuda", "shape": shape, "steps": steps},
                         env=env, timeout=300)
    for r, out in enumerate(results):
        assert "error" not in out, out
        for dtype in ("float32", "float16", "bfloat16"):
            total = sum(torch_input(dtype, shape, q).double() for q in range(2))
            got, device = out[f"allreduce/{dtype}"]
            assert device.startswith("cuda"), (dtype, device)
            np.testing.assert_array_equal(got, total.numpy(), err_msg=dtype)
            got, device = out[f"allreduce_/{dtype}"]
            assert device.startswith("cuda"), (dtype, device)
            np.testing.assert_array_equal(got, (total / 2).numpy(), err_msg=dtype)
        for engines in ("hvd_engines", "ddp_ina_engines", "hook_engines"):
            assert out[engines].get("ina", 0) > 0, (engines, out[engines])
        for trained in ("ddp_ina", "hook_gloo"):
            for got, ref, first in zip(out[trained], out["ddp_cpu"], results[0][trained]):
                np.testing.assert_array_equal(got, first)  # every rank ends alike
                np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4)
