"""A tensor staged through host windows (torch/windows.py), on CPU: what runs on a GPU
runs here too but for the side streams and pinned memory (bfloat16 takes this path on
CPU, widened to float32 on its way in)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.settings import Settings
from ina_collectives.torch import staging, windows
from ina_collectives.torch.windows import HostWindows


def test_windows_copy_in_only_what_is_asked_and_write_back_what_arrived():
    t = torch.arange(1000, dtype=torch.bfloat16)
    out = torch.zeros_like(t)
    w = HostWindows(t, out, window_bytes=400)  # 100 float32 values a window
    assert (w.windows, w.host.dtype, w.host.size) == (10, np.float32, 1000)
    w.landed(150, 250)  # windows 1 and 2
    assert w.landed_windows == [False, True, True] + [False] * 7
    assert w.copied_in == 200 * 2  # bfloat16 bytes read
    np.testing.assert_array_equal(w.host[100:300], t[100:300].float().numpy())
    w.host[100:300] *= 2
    w.arrived(100, 300)
    assert w.copied_out == 200 * 2 and out[:100].eq(0).all() and out[300:].eq(0).all()
    np.testing.assert_array_equal(out[100:300].float().numpy(),
                                  2 * t[100:300].float().numpy())
    assert w.finish() is out


def test_a_tensor_and_an_output_that_differ_in_layout_are_refused():
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert not windows.stageable(t.t(), t)
    assert not windows.stageable(t, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="contiguous tensor and an output of its dtype"):
        HostWindows(t, torch.zeros(16, dtype=torch.bfloat16))


@pytest.fixture
def runtime():
    rt = BackgroundRuntime(MPI.COMM_SELF, Settings(partition_bytes=64 << 10, cycle_time=0.001))
    yield rt
    rt.shutdown(10)


def test_the_runtime_reads_each_partition_once_landed_and_returns_it_before_the_next(
        runtime, monkeypatch):
    """A bfloat16 tensor of 8 windows in partitions of 64 KiB: each partition is asked
    for just before it is read, and its results go back before the next one is asked for
    (the stream and the copies overlap), in place, and every value comes back."""
    monkeypatch.setattr(windows, "WINDOW_BYTES", 32 << 10)
    events = []
    landed, arrived = HostWindows.landed, HostWindows.arrived
    monkeypatch.setattr(HostWindows, "landed",
                        lambda self, a, b: (events.append(("in", a, b)), landed(self, a, b)))
    monkeypatch.setattr(HostWindows, "arrived",
                        lambda self, a, b: (events.append(("out", a, b)), arrived(self, a, b)))
    n = 8 * (32 << 10) // 4  # 8 windows of float32
    t = (torch.arange(n, dtype=torch.float32) % 251 - 125).to(torch.bfloat16)
    want = t.clone()
    handle, finish = staging.submit_allreduce(runtime, t, t, "g", staging.Sum)
    handle.wait(30, "the allreduce")
    assert finish(handle.result) is t
    torch.testing.assert_close(t, want, rtol=0, atol=0)
    assert [kind for kind, _, _ in events] == ["in", "out"] * 4  # 4 partitions of 64 KiB
    assert events[0][1:] == (0, n // 4) and events[-1][1:] == (3 * n // 4, n)


def test_a_non_contiguous_tensor_is_staged_whole_and_reduced_alike(runtime):
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8).t()
    want = t.clone()
    handle, finish = staging.submit_allreduce(runtime, t, t, "nc", staging.Sum)
    handle.wait(30, "the allreduce")
    torch.testing.assert_close(finish(handle.result), want, rtol=0, atol=0)


def test_a_copy_to_the_host_that_never_lands_times_out_naming_it():
    """A CUDA window's copy is waited for in short slices, bounded: here an event that
    never completes stands in for a stuck device (the CUDA path's one wait)."""
    from ina_collectives.errors import CollectiveTimeout

    class Stuck:
        def query(self) -> bool:
            return False

    w = HostWindows(torch.zeros(300, dtype=torch.bfloat16), torch.zeros(300,
                    dtype=torch.bfloat16), window_bytes=400, seconds=0.05)
    w.cuda, w.events = True, [Stuck()] * w.windows
    with pytest.raises(CollectiveTimeout, match=r"waited 0.05 s for the copy of elements "
                                                r"100..200 of a cpu tensor to host memory"):
        w.landed(150, 160)
