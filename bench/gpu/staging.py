"""The CUDA staging path's costs (ina_collectives/torch/windows.py): a device tensor
copied to pinned host memory a window at a time and back, beside one plain copy.

    python -m bench.gpu.staging [--device cuda] [--sizes 4M 64M 256M] [--repeats 5]
                            [--json bench/results/staging.json]

For each dtype (float32, bfloat16: widened to float32 on its way in) and size, the
median of the repetitions of:

- ``plain_in_gbs``: one copy of the whole tensor into a pinned buffer, the ceiling;
- ``setup_ms``: HostWindows' constructor (the pinned buffer's allocation, and every
  window's copy queued on the side stream, with an event each);
- ``first_window_ms``: from there until the first window has landed (when the
  runtime's first packets could leave), and ``per_window_ms``: all windows' time in
  over their count; ``in_gbs``: the tensor's bytes over setup and all windows;
- ``out_gbs``: every result copied back (``arrived``) until the caller's stream has
  it (``finish``, then a synchronize);
- ``allreduce_gbs`` and ``host_allreduce_gbs``: a whole allreduce through the runtime
  (one rank: no network, so the staging is all there is to it) of the device tensor
  and of the same values in host memory.

``--device cpu`` runs the same code without a GPU (no pinned memory, no streams): a
check of the benchmark itself, not a measurement of the CUDA path. ``make gpu-check``
runs it on a GPU and prints these figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
from mpi4py import MPI

from bench import RESULTS
from bench.ceilings.loads import save
from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.settings import Settings
from ina_collectives.torch import staging
from ina_collectives.torch.windows import WINDOW_BYTES, HostWindows

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_bytes(text: str) -> int:
    """'64M' -> 67108864 (K, M, G are powers of 1024); a plain number is bytes."""
    unit = UNITS.get(text[-1:].upper(), 1)
    number = text[:-1] if unit > 1 else text
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"size {text!r}: give bytes, or a number with K, "
                                         f"M or G (e.g. 64M)")
    return int(number) * unit


def median_seconds(run: Callable[[], float], repeats: int) -> float:
    """The median of ``repeats`` runs of ``run`` (each returns its own seconds), after
    one run left out (allocator and stream warm-up)."""
    run()
    return statistics.median(run() for _ in range(repeats))


def measure(device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int,
            runtime: BackgroundRuntime) -> dict:
    """One record: every figure of the module's docstring for a tensor of ``nbytes``."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    tensor = (torch.arange(n, device=device) % 251 - 125).to(dtype)
    size = n * tensor.element_size()
    pinned = torch.empty(n, dtype=dtype, pin_memory=cuda)

    def plain() -> float:
        sync()
        start = time.perf_counter()
        pinned.copy_(tensor, non_blocking=True)
        sync()
        return time.perf_counter() - start

    phases: dict[str, list[float]] = {"setup": [], "first": [], "in": [], "out": []}
    windows_count = 0

    def staged() -> float:
        nonlocal windows_count
        out = torch.empty_like(tensor)
        sync()
        start = time.perf_counter()
        w = HostWindows(tensor, out)
        built = time.perf_counter()
        w.landed(0, 1)
        first = time.perf_counter()
        w.landed(0, n)
        landed = time.perf_counter()
        w.arrived(0, n)
        w.finish()
        sync()
        done = time.perf_counter()
        windows_count = w.windows
        for key, seconds in (("setup", built - start), ("first", first - built),
                             ("in", landed - start), ("out", done - landed)):
            phases[key].append(seconds)
        return done - start

    def allreduce(t: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            sync()
            start = time.perf_counter()
            handle, finish = staging.submit_allreduce(runtime, t, t, "bench", staging.Sum)
            handle.wait(300, "the staged allreduce")
            finish(handle.result)
            sync()
            return time.perf_counter() - start
        return run

    plain_s = median_seconds(plain, repeats)
    median_seconds(staged, repeats)
    for key in phases:
        phases[key] = phases[key][1:]  # the warm-up run left out, as median_seconds does
    setup, first, into, out = (statistics.median(phases[k])
                               for k in ("setup", "first", "in", "out"))
    host = tensor.to("cpu") if dtype != torch.bfloat16 else tensor.float().to("cpu")
    device_s = median_seconds(allreduce(tensor), repeats)
    host_s = median_seconds(allreduce(host), repeats)
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "bytes": size, "windows": windows_count, "window_bytes": WINDOW_BYTES,
            "plain_in_gbs": size / plain_s / 1e9, "setup_ms": setup * 1e3,
            "first_window_ms": first * 1e3, "per_window_ms": into / windows_count * 1e3,
            "in_gbs": size / into / 1e9, "out_gbs": size / out / 1e9,
            "allreduce_gbs": size / device_s / 1e9,
            "host_allreduce_gbs": host.numel() * host.element_size() / host_s / 1e9}


HEADER = (f"{'dtype':>8} {'MiB':>5} {'win':>4} {'plain in':>8} {'in':>6} {'out':>6} "
          f"{'setup':>7} {'1st win':>7} {'/win':>6} {'allred':>6} {'host':>6}")


def row(r: dict) -> str:
    """One record as a line under HEADER (GB/s, and ms for setup and windows)."""
    return (f"{r['dtype']:>8} {r['bytes'] / 2**20:5.0f} {r['windows']:4d} "
            f"{r['plain_in_gbs']:8.2f} {r['in_gbs']:6.2f} {r['out_gbs']:6.2f} "
            f"{r['setup_ms']:7.2f} {r['first_window_ms']:7.3f} {r['per_window_ms']:6.3f} "
            f"{r['allreduce_gbs']:6.2f} {r['host_allreduce_gbs']:6.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.staging",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (cuda:N), or cpu to check the "
                                                    "benchmark itself")
    p.add_argument("--sizes", nargs="+", type=size_bytes, default=[4 << 20, 64 << 20,
                                                                     256 << 20],
                   metavar="SIZE", help="tensor sizes in bytes (K, M, G: 1024s)")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                   default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=str(RESULTS / "staging.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (torch.cuda.is_available() is False); --device cpu "
                "checks the benchmark without one")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"staging on {device} ({name}), {WINDOW_BYTES >> 20} MiB windows; GB/s, and ms "
          f"for setup and windows", flush=True)
    print(HEADER, flush=True)
    records = []
    runtime = BackgroundRuntime(MPI.COMM_SELF, Settings())
    try:
        for dtype in args.dtypes:
            for nbytes in args.sizes:
                records.append(measure(device, getattr(torch, dtype), nbytes, args.repeats,
                                       runtime) | {"device_name": name})
                print(row(records[-1]), flush=True)
    finally:
        runtime.shutdown(10)
    save(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
