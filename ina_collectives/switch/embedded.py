"""The embedded software switch: an ``ina-switch`` process started and stopped for a job.

    with embedded_switch() as switch:      # listens on a free loopback port
        env = {"INA_SWITCH": switch.address_text}
        ...                                 # run the ranks
    switch.final_status                     # its last status line

    with embedded_switch(p4runtime=True) as switch:   # also serves P4Runtime
        switch.p4runtime_address            # "127.0.0.1:PORT", for ina_collectives.control

Used by the demo, the tests and launchers; the process is always reaped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence


class EmbeddedSwitch:
    """A running ``ina-switch``: ``host``, ``port`` of its first (or only) shard,
    ``address_text`` every shard's, what INA_SWITCH says."""

    def __init__(self, process: subprocess.Popen, addresses: list[tuple[str, int]],
                 p4runtime_address: str | None = None):
        self.process, self.addresses = process, addresses
        self.host, self.port = addresses[0]
        self.p4runtime_address = p4runtime_address
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def address_text(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.addresses)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def final_status(self) -> str:
        return next((line for line in reversed(self.lines) if line.startswith("ina-switch ")), "")

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code (None if it was killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None
        self._reader.join(timeout)
        return self.process.returncode


@contextmanager
def embedded_switch(*args: str, host: str = "127.0.0.1", start_timeout: float = 15.0,
                    p4runtime: bool = False, launcher: Sequence[str] = (), threads: int = 1
                    ) -> Iterator[EmbeddedSwitch]:
    """Start ``python -m ina_collectives.switch --port 0 --threads N ARGS`` and yield it,
    running; ``p4runtime`` also serves P4Runtime on a free port (``--p4runtime-port 0``).
    ``launcher`` prefixes the command (e.g. ``ip netns exec NS``, which execs it).
    ``threads``: its shards (one by default: a job's results then come from one port,
    as the tests that count them expect; 0: ina-switch's default, one per core)."""
    extra = ["--p4runtime-port", "0"] if p4runtime else []
    if threads:
        extra += ["--threads", str(threads)]
    process = subprocess.Popen(
        [*launcher, sys.executable, "-m", "ina_collectives.switch", "--host", host, "--port", "0",
         *extra, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + start_timeout
        # The lines up to "listening on" name the ports; read them with a bound.
        result: list[str] = []

        def read_start() -> None:
            for line in process.stdout:
                result.append(line)
                if "listening on" in line:
                    return

        reader = threading.Thread(target=read_start, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        first = result[-1] if result else ""
        if reader.is_alive() or "listening on" not in first:
            process.kill()
            rest = process.communicate(timeout=5)[0] if not reader.is_alive() else ""
            raise RuntimeError(f"ina-switch did not start within {start_timeout:g} s: "
                               f"{''.join(result)}{rest}")
        listening = first.split(" on ", 1)[1].strip().split(",")
        addresses = [(host, int(text.rsplit(":", 1)[1])) for text in listening]
        grpc_line = next((line for line in result if "p4runtime on" in line), None)
        if p4runtime and grpc_line is None:
            process.kill()
            raise RuntimeError(f"ina-switch did not serve P4Runtime: {''.join(result)}")
        switch = EmbeddedSwitch(process, addresses,
                                grpc_line.split(" on ", 1)[1].strip() if grpc_line else None)
        switch.lines.extend(line.rstrip("\n") for line in result)
        yield switch
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
