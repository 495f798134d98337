"""The host packet path against this kernel's raw ceiling, in one run (issue 15's targets).

    python -m bench.ceilings.host_path [--seconds 2] [--json bench/results/host_path.json]

At 9000-byte packets (K of a 9000-byte MTU, int32 values), each figure beside the raw
segmented-UDP ceiling of the same datagram size (bench/ceilings/udp_ceiling.py: UDP_SEGMENT
sender, UDP_GRO receiver, one core each):

and beside the echo ceiling (udp_ceiling.echo_ceiling: one core receiving every datagram
and sending it back, no other work; a worker and a switch shard both do that per packet):

* the worker path alone: one worker (n = 1) streams a float32 tensor (quantization,
  packets, the windowed transport) through a switch that only echoes each packet back
  as its result (loadgen.echo, segmented): packets/s the worker completes;
* the switch alone, one shard and two (``ina-switch --threads 2``), under the same load:
  two jobs of n = 2 or 4 replayed workers whose refills leave with UDP_SEGMENT (a
  generator thread each; with two shards, a job on each shard's port): packets/s into
  the switch, elements/s as a multiple of one shard's, the load generator's CPU share.
"""
from __future__ import annotations

import resource
import sys
import time

import numpy as np

from bench.ceilings import loads
from bench.ceilings.switch_ceiling import switch_rate
from bench.ceilings.udp_ceiling import ceiling, echo_ceiling
from ina_collectives import protocol as P
from ina_collectives.ina import kernels
from ina_collectives.ina.link import Timers, WorkerLink
from ina_collectives.ina.plan import StreamPlan

MTU = 9000


def worker_path(k: int, seconds: float, slots: int = 64, chunks: int = 20_000) -> dict:
    """One worker against an echoing switch: packets/s over a stream of ~seconds, each
    call a tensor of ``chunks`` packets (20,000: 173 MB, streamed from memory; a few
    hundred: a tensor the caches hold between calls)."""
    port = loads.free_port()
    server = loads.start(f"echo(fd, {seconds + 30})", port, gro=True)
    try:
        link = WorkerLink(("127.0.0.1", port), P.JobFormat(1, 1, k), 0, slots)
        fast = kernels.load("fast")
        x = np.random.default_rng(0).standard_normal(k * chunks).astype(np.float32)
        local, _ = fast.block_exponents(x, k)
        out = np.empty_like(x)
        best = None
        start = time.monotonic()
        while time.monotonic() - start < seconds or best is None:
            result = link.stream(StreamPlan(x, out, local, local.copy()),
                                 Timers(0.2, 0.05, 1.0, 5.0), 60.0)
            assert result.ok, result.reason
            c = result.counters
            rate = c["sent"] / c["seconds"]
            best = c if best is None or rate > best["sent"] / best["seconds"] else best
        link.close()
        np.testing.assert_allclose(out, x, rtol=0, atol=2.0 ** -20 * np.abs(x).max())
    finally:
        loads.stop(server)
    return {"packets_per_s": best["sent"] / best["seconds"],
            "per_send_call": best["sent"] / max(best["send_calls"], 1),
            "gro_buffers": best["gro_buffers"]}


def main() -> int:
    args = loads.parser(__doc__, "host_path").parse_args()
    k = P.elements_for_mtu(MTU)
    size = P.packet_bytes(k, P.DEFAULT_BLOCK, 32)
    raw = ceiling(size, True, True, args.seconds)["datagrams_per_s"]
    print(f"raw ceiling, {size}-byte datagrams, UDP_SEGMENT + UDP_GRO: {raw:.0f}/s")
    echoed = echo_ceiling(size, args.seconds)["datagrams_per_s"]
    print(f"echo ceiling (one core receives and sends back): {echoed:.0f}/s = "
          f"{echoed / raw:.2f} of the one-way ceiling")
    records = [{"what": "raw ceiling", "bytes": size, "packets_per_s": raw},
               {"what": "echo ceiling", "bytes": size, "packets_per_s": echoed,
                "of_ceiling": echoed / raw}]
    w = worker_path(k, args.seconds)
    records.append({"what": "worker path (echo switch)", "bytes": size, **w,
                    "of_ceiling": w["packets_per_s"] / raw,
                    "of_echo_ceiling": w["packets_per_s"] / echoed})
    print(f"worker path: {w['packets_per_s']:.0f} packets/s = {w['packets_per_s'] / raw:.2f} "
          f"of the ceiling, {w['packets_per_s'] / echoed:.2f} of the echo ceiling "
          f"({w['per_send_call']:.1f} packets per send call)", flush=True)
    # The same with a tensor the caches keep (1.7 MB): what memory traffic costs.
    warm = worker_path(k, args.seconds, chunks=200)
    records.append({"what": "worker path (echo switch), tensor in cache", "bytes": size,
                    **warm, "of_ceiling": warm["packets_per_s"] / raw,
                    "of_echo_ceiling": warm["packets_per_s"] / echoed})
    print(f"worker path, a 1.7 MB tensor (cached): {warm['packets_per_s']:.0f} packets/s = "
          f"{warm['packets_per_s'] / raw:.2f} of the ceiling, "
          f"{warm['packets_per_s'] / echoed:.2f} of the echo ceiling", flush=True)
    one_shard = {}
    for n in (2, 4):
        for shards in (1, 2):
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            r = switch_rate(n, k, 32, args.seconds, gso=True, shards=shards, jobs=2)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / (
                time.monotonic() - t0)
            if shards == 1:
                one_shard[n] = r["elements_per_s"]
            gain = r["elements_per_s"] / one_shard[n]
            records.append({"what": f"switch, {shards} shard(s), 2 jobs of n={n}",
                            "bytes": size,
                            "shards": shards, "packets_per_s": r["packets_per_s"],
                            "elements_per_s": r["elements_per_s"],
                            "of_ceiling": r["packets_per_s"] / raw,
                            "of_echo_ceiling": r["packets_per_s"] / echoed,
                            "of_one_shard": gain,
                            "generator_cpu": cpu})
            print(f"switch, {shards} shard(s), 2 jobs of n={n}: "
                  f"{r['packets_per_s']:.0f} packets/s in = "
                  f"{r['packets_per_s'] / raw:.2f} of the ceiling "
                  f"({r['packets_per_s'] / echoed:.2f} of the echo ceiling), "
                  f"{r['elements_per_s'] / 1e6:.0f} M elements/s = {gain:.2f}x one shard; "
                  f"load generator CPU {cpu:.0%} of a core (with set-up)", flush=True)
    loads.save(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
