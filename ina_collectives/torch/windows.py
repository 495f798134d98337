"""A tensor the runtime cannot read in place (on a GPU, or bfloat16) staged through a host
buffer a window at a time, both ways, so that the switch stream starts on the first window
and results return while later ones are still on the wire.

The runtime asks for a range before it reads it (``landed``) and says when a range of
results is final (``arrived``): the background thread calls both, per partition
(runtime/executor.py), so a window's copy meets the partitions that need it.

- **CUDA**: the host buffer is pinned. At submit, a side stream waits on the caller's
  stream (the gradient is produced there) and queues each window's device-to-host copy,
  with an event per window; ``landed`` waits on the events of its range alone. Each
  range of results is copied back on a second side stream as it arrives; ``finish``
  makes the caller's stream wait on that stream's last event: no synchronize.
- **CPU** (bfloat16, widened to float32 on its way in): the same windows, copied when
  the runtime first asks for them, in its thread, and written back as they arrive.

A window is ``WINDOW_BYTES`` of the host buffer (the runtime's partitions are larger:
each waits on its own windows only).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from ..errors import CollectiveTimeout

WINDOW_BYTES = 4 << 20

# One pair of side streams per device, made on first use: (device-to-host, host-to-device).
_STREAMS: dict[torch.device, tuple[Any, Any]] = {}
_STREAMS_LOCK = threading.Lock()


def _side_streams(device: torch.device) -> tuple[Any, Any]:
    with _STREAMS_LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return _STREAMS[device]


def stageable(tensor: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``tensor`` into ``output`` can be staged window by window: both contiguous,
    of one dtype, shape and device (else the whole-tensor copy, torch/staging.py)."""
    return (tensor.is_contiguous() and output.is_contiguous()
            and tensor.dtype == output.dtype and tensor.shape == output.shape
            and tensor.device == output.device)


class HostWindows:
    """``tensor``'s values in a host buffer (``host``, the array the runtime reduces in
    place: float32 for bfloat16), staged a window at a time; ``output`` receives the
    results the same way (it may be ``tensor``)."""

    def __init__(self, tensor: torch.Tensor, output: torch.Tensor,
                 window_bytes: int | None = None, seconds: float = 300.0):
        if not stageable(tensor, output):
            raise ValueError("HostWindows takes a contiguous tensor and an output of its "
                             "dtype, shape and device")
        self.device = tensor.device
        self.cuda = tensor.device.type == "cuda"
        self.source = tensor.detach().reshape(-1)
        self.target = output.detach().reshape(-1)
        self.output = output
        wide = torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype
        self.buffer = torch.empty(self.source.numel(), dtype=wide, pin_memory=self.cuda)
        self.host: np.ndarray = self.buffer.numpy()
        self.step = max(1, (window_bytes or WINDOW_BYTES) // self.buffer.element_size())
        count = -(-self.source.numel() // self.step) if self.source.numel() else 0
        self.windows = count
        self.landed_windows = [False] * count
        self.copied_in = 0    # bytes device (or tensor) to host
        self.copied_out = 0   # bytes host to device (or tensor)
        self.seconds = seconds  # how long ``landed`` waits for a copy (the caller's bound)
        self.events: list[Any] = []  # each window's copy to the host (CUDA)
        self._back_event: Any = None
        if self.cuda:
            self._queue_copies_in()

    def _range(self, w: int) -> tuple[int, int]:
        return w * self.step, min((w + 1) * self.step, self.source.numel())

    def _queue_copies_in(self) -> None:
        to_host, _ = _side_streams(self.device)
        to_host.wait_stream(torch.cuda.current_stream(self.device))  # the producer's work
        with torch.cuda.stream(to_host):
            for w in range(self.windows):
                a, b = self._range(w)
                self.buffer[a:b].copy_(self.source[a:b], non_blocking=True)
                self.events.append(torch.cuda.Event())
                self.events[-1].record(to_host)
        self.source.record_stream(to_host)  # not freed while the copies read it
        self.copied_in = self.buffer.numel() * self.source.element_size()

    def landed(self, start: int, stop: int) -> None:
        """Block until elements [start, stop) are in the host buffer."""
        if stop <= start:
            return
        for w in range(start // self.step, (stop - 1) // self.step + 1):
            if self.landed_windows[w]:
                continue
            if self.cuda:
                self._wait(self.events[w], w)
            else:
                a, b = self._range(w)
                with torch.no_grad():
                    self.buffer[a:b].copy_(self.source[a:b])
                self.copied_in += (b - a) * self.source.element_size()
            self.landed_windows[w] = True

    def _wait(self, event: Any, w: int) -> None:  # noqa: ANN401
        """Until window ``w``'s copy has landed; CollectiveTimeout after ``seconds``."""
        deadline = time.monotonic() + self.seconds
        while not event.query():
            if time.monotonic() >= deadline:
                a, b = self._range(w)
                raise CollectiveTimeout(
                    f"waited {self.seconds:g} s for the copy of elements {a}..{b} of a "
                    f"{self.device} tensor to host memory")
            time.sleep(0.0002)

    def arrived(self, start: int, stop: int) -> None:
        """Elements [start, stop) of the host buffer hold final results: copy them out."""
        if stop <= start:
            return
        with torch.no_grad():
            if self.cuda:
                _, to_device = _side_streams(self.device)
                with torch.cuda.stream(to_device):
                    self.target[start:stop].copy_(self.buffer[start:stop], non_blocking=True)
                    self._back_event = torch.cuda.Event()
                    self._back_event.record(to_device)
                if self.copied_out == 0:  # not freed while the copies write it
                    self.target.record_stream(to_device)
            else:
                self.target[start:stop].copy_(self.buffer[start:stop])
        self.copied_out += (stop - start) * self.target.element_size()

    def finish(self, _result: Any = None) -> torch.Tensor:
        """``output``, once every result is in it: on CUDA, the current stream (of the
        thread that calls this) waits on the last copy back."""
        if self.cuda and self._back_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._back_event)
        return self.output


__all__ = ["HostWindows", "WINDOW_BYTES", "stageable"]
