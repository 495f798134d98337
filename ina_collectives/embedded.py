"""The embedded software switch: an ``ina-switch`` process started and stopped for a job.

    with embedded_switch() as switch:      # listens on a free loopback port
        env = {"INA_SWITCH": switch.address_text}
        ...                                 # run the ranks
    switch.final_status                     # its last status line

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
from typing import Iterator


class EmbeddedSwitch:
    def __init__(self, process: subprocess.Popen, host: str, port: int):
        self.process, self.host, self.port = process, host, port
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def address_text(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def final_status(self) -> str:
        return next((l for l in reversed(self.lines) if l.startswith("ina-switch ")), "")

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
def embedded_switch(*args: str, host: str = "127.0.0.1", start_timeout: float = 15.0
                    ) -> Iterator[EmbeddedSwitch]:
    """Start ``python -m ina_collectives.switch --port 0 ARGS`` and yield it, running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ina_collectives.switch", "--host", host, "--port", "0",
         *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + start_timeout
        first = ""
        # The first line names the port; read it with a bound.
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(process.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        first = result[0] if result else ""
        if "listening on" not in first:
            process.kill()
            rest = process.communicate(timeout=5)[0]
            raise RuntimeError(f"ina-switch did not start within {start_timeout:g} s: "
                               f"{first}{rest}")
        port = int(first.rsplit(":", 1)[1])
        switch = EmbeddedSwitch(process, host, port)
        switch.lines.append(first.rstrip("\n"))
        yield switch
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
