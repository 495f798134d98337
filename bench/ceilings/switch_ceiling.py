"""The software switch's ceiling beside this machine's raw UDP receive ceiling, in one run.

    python -m bench.ceilings.switch_ceiling [--seconds 2] [--json bench/results/switch_ceiling.json]

For both value widths (int32, int16; B = 32), n = 2, 4, 8 workers and K at the
1500-byte, 9000-byte and loopback (64 KiB) MTUs: a
load generator (_fast/loadgen.pyx) replays pre-built packets as n workers, S in flight,
clocked by the results (no quantization cost), through an ina-switch process. Reported:
packets/s into the switch, aggregated elements/s (SwitchML's figure: result elements),
payload Gbit/s in, and the raw ceiling: a bare batched receiver (recvmmsg, no work) fed
as fast as one sender can with sendmmsg, with packets of the same size
(bench/ceilings/udp_ceiling.py).
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.ceilings import loadgen_build, loads
from bench.ceilings.udp_ceiling import ceiling
from ina_collectives import protocol as P
from ina_collectives.ina.link import WorkerLink
from ina_collectives.switch.embedded import embedded_switch

loadgen = loadgen_build.load()

SLOTS = 16
MTUS = {"1500": 1500, "9000": 9000, "64KiB": 65535}


def switch_rate(n: int, k: int, bits: int, seconds: float, gso: bool = False,
                shards: int = 1, jobs: int = 1) -> dict:
    """The switch alone, fed by ``jobs`` jobs of n replayed workers (their refills
    segmented if gso), a generator thread each (replay_workers runs without the GIL);
    ``shards``: a switch of that many (--threads), the jobs spread over them in turn.
    The same ``jobs`` for 1 and 2 shards compares the shards under the same load (each
    job's window is S packets: one job alone is bound by its round trips, not the
    switch's core)."""
    with embedded_switch(threads=shards) as sw:
        feeds = [_feed(sw.addresses[j % shards], 4242 + j, n, k, bits)
                 for j in range(max(jobs, shards))]

        def replay(feed: tuple) -> tuple:
            links, rows, address, job = feed
            fds = np.array([link.sock.fileno() for link in links], np.int32)
            return loadgen.replay_workers(fds, P.sockaddr_be(address), rows, rows.shape[1], n,
                                          SLOTS, seconds, gso)

        with ThreadPoolExecutor(len(feeds)) as pool:
            outcomes = list(pool.map(replay, feeds))
        for links, *_ in feeds:
            for link in links:
                link.close()
        sw.stop()
    done = sum(o[0] for o in outcomes)
    elapsed = max(o[1] for o in outcomes)
    pps = done * n / elapsed
    return {"packets_per_s": pps, "elements_per_s": done * k / elapsed,
            "payload_gbit_s": pps * bits // 8 * k * 8 / 1e9, "status": sw.final_status}


def _feed(address: tuple[str, int], job: int, n: int, k: int, bits: int) -> tuple:
    """n workers joined to ``job`` at one aggregator, and their packets (one per slot)."""
    links = [WorkerLink(address, P.JobFormat(job, n, k, value_bits=bits), w, SLOTS)
             for w in range(n)]
    for link in links:
        link.join(5.0)
    rows = np.zeros((n * SLOTS, P.packet_bytes(k, P.DEFAULT_BLOCK, bits)), np.uint8)
    for w in range(n):
        for s in range(SLOTS):
            rows[w * SLOTS + s] = np.frombuffer(P.pack_data(
                np.zeros(k, np.int32), value_bits=bits, flags=0, job=job, worker=w,
                slot_version=0, slot=s, offset=s * k), np.uint8)
    return links, rows, address, job


def main() -> int:
    args = loads.parser(__doc__, "switch_ceiling").parse_args()
    records = []
    print(f"{'bits':>4} {'MTU':>6} {'K':>6} {'n':>2} {'switch pkt/s':>12} {'raw pkt/s':>10} "
          f"{'ratio':>6} {'Melem/s':>8} {'Gbit/s in':>9}")
    for bits in P.VALUE_BITS:
        for mtu_name, mtu in MTUS.items():
            k = P.elements_for_mtu(mtu, P.DEFAULT_BLOCK, bits)
            raw = ceiling(P.packet_bytes(k, P.DEFAULT_BLOCK, bits), False, False,
                          args.seconds)["datagrams_per_s"]
            for n in (2, 4, 8):
                r = switch_rate(n, k, bits, args.seconds)
                r.update(value_bits=bits, mtu=mtu_name, k=k, n=n, raw_packets_per_s=raw,
                         ratio=r["packets_per_s"] / raw)
                records.append(r)
                print(f"{bits:>4} {mtu_name:>6} {k:>6} {n:>2} {r['packets_per_s']:12.0f} "
                      f"{raw:10.0f} {r['ratio']:6.2f} {r['elements_per_s'] / 1e6:8.1f} "
                      f"{r['payload_gbit_s']:9.2f}", flush=True)
    loads.save(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
