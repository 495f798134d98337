"""Loopback load processes for the benchmarks: a load generator function (loadgen.pyx)
run in a process of its own on a free 127.0.0.1 port, and the benchmarks' common
command line (--seconds, --json) and JSON output."""
from __future__ import annotations

import argparse
import json
import select
import socket
import subprocess
import sys
from pathlib import Path

from bench import RESULTS
from bench.ceilings import loadgen_build
from ina_collectives import protocol as P

START_TIMEOUT = 30.0  # seconds a load process may take to start (Python, the import)


def free_port() -> int:
    """A UDP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(call: str, port: int, gro: bool = False) -> subprocess.Popen:
    """Run ``call`` (a loadgen function called with the socket's descriptor ``fd``, e.g.
    "sink(fd, 2.0)") in a process of its own, on a UDP socket bound to 127.0.0.1:port
    with 4 MiB buffers (and UDP_GRO if ``gro``); returns once the socket is bound. The
    process prints the call's result; read it with communicate()."""
    code = (f"import socket, sys; sys.path.insert(0, {str(loadgen_build.BUILD)!r}); "
            f"import {loadgen_build.NAME} as loadgen; "
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20); "
            + (f"s.setsockopt(socket.IPPROTO_UDP, {P.address.UDP_GRO}, 1); " if gro else "")
            + f"s.bind(('127.0.0.1', {port})); fd = s.fileno(); print('ready', flush=True); "
            f"print(loadgen.{call})")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               text=True)
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT)
    if not ready or process.stdout.readline().strip() != "ready":
        stop(process)
        raise RuntimeError(f"the load process for {call} did not bind 127.0.0.1:{port} "
                           f"within {START_TIMEOUT:g} s")
    return process


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The command line every loopback benchmark takes: --seconds, --json."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", default=str(RESULTS / f"{name}.json"))
    return p


def save(path: str, records: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(records, indent=1))
    print(f"saved {path}")
