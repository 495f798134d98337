"""This kernel's raw UDP ceilings for one core per side, by system-call path, in one run.

    python -m bench.ceilings.udp_ceiling [--seconds 2] [--json bench/results/udp_ceiling.json]

For 256-, 1500- and 9000-byte datagrams on loopback: one process sends copies of one
datagram as fast as it can (64 per sendmmsg, or as many per UDP_SEGMENT send as 64 KiB
holds), another receives them with recvmmsg, with or without UDP_GRO, and counts them.
Reported: datagrams/s received, payload Gbit/s, and datagrams per send call. These are
the ceilings the worker's and the switch's paths are measured against (issue 15).

Then the echo ceiling: one core that receives every datagram (UDP_GRO) and sends it
straight back (UDP_SEGMENT), fed by a segmented sender on the other core, with no other
work. A switch shard and a worker both receive and send every datagram, so this, not
the one-way figure, is the most either could do on this kernel.
"""
from __future__ import annotations

import socket
import sys

import numpy as np

from bench.ceilings import loadgen_build, loads
from ina_collectives import protocol as P

loadgen = loadgen_build.load()
SIZES = (256, 1500, 9000)


def ceiling(size: int, gso: bool, gro: bool, seconds: float) -> dict:
    """Datagrams/s one process sending copies of a ``size``-byte datagram (sendmmsg, or
    UDP_SEGMENT if ``gso``) gets into another receiving them (recvmmsg, with UDP_GRO if
    ``gro``)."""
    port = loads.free_port()
    sink = loads.start(f"sink(fd, {seconds})", port, gro)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sent, calls = loadgen.blast_batched(s.fileno(), *P.sockaddr_be(("127.0.0.1", port)),
                                                np.zeros(size, np.uint8), seconds + 0.5, gso)
        received = int(sink.communicate(timeout=30)[0].strip())
    finally:
        loads.stop(sink)
    pps = received / seconds
    return {"size": size, "send": "UDP_SEGMENT" if gso else "sendmmsg",
            "receive": "UDP_GRO" if gro else "recvmmsg", "datagrams_per_s": pps,
            "gbit_s": pps * size * 8 / 1e9, "per_send_call": sent / max(calls, 1)}


def echo_ceiling(size: int, seconds: float) -> dict:
    """Datagrams/s one process receiving ``size``-byte datagrams with UDP_GRO sends back
    (UDP_SEGMENT), fed as fast as another process can send them (UDP_SEGMENT)."""
    port = loads.free_port()
    echo = loads.start(f"echo(fd, {seconds})", port, gro=True)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            loadgen.blast_batched(s.fileno(), *P.sockaddr_be(("127.0.0.1", port)),
                                  np.zeros(size, np.uint8), seconds + 0.5, True)
        echoed = int(echo.communicate(timeout=30)[0].strip())
    finally:
        loads.stop(echo)
    pps = echoed / seconds
    return {"size": size, "send": "UDP_SEGMENT", "receive": "UDP_GRO, echoed",
            "datagrams_per_s": pps, "gbit_s": pps * size * 8 / 1e9}


def main() -> int:
    args = loads.parser(__doc__, "udp_ceiling").parse_args()
    records = []
    print(f"{'bytes':>5} {'send':>11} {'receive':>8} {'datagrams/s':>11} {'Gbit/s':>7} "
          f"{'per call':>8}")
    for size in SIZES:
        for gso in (False, True):
            for gro in (False, True):
                r = ceiling(size, gso, gro, args.seconds)
                records.append(r)
                print(f"{size:>5} {r['send']:>11} {r['receive']:>8} "
                      f"{r['datagrams_per_s']:11.0f} {r['gbit_s']:7.2f} "
                      f"{r['per_send_call']:8.1f}", flush=True)
    for size in SIZES:
        r = echo_ceiling(size, args.seconds)
        records.append(r)
        print(f"{size:>5} echoed by one core (receive + send back): "
              f"{r['datagrams_per_s']:11.0f} {r['gbit_s']:7.2f} Gbit/s", flush=True)
    loads.save(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
