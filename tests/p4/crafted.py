"""Crafted packets from installed workers, for the tests of the aggregators' rules packet
by packet (test_predicted_bmv2, test_quorum_rules): the workers' sockets on the namespace
fabric of tests/integration/fabric.py, what comes back to each, and the aggregator's drop
counters as the controller reads them."""
from __future__ import annotations

import dataclasses
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from ina_collectives import protocol as P
from ina_collectives.control import Parent
from ina_collectives.testing.fabric import worker_ip, worker_mac
from tests.integration.fabric import SWITCH_IP, Fabric

SWITCH = (SWITCH_IP, P.UDP_PORT)
PARENT_PORT = 42000  # a tree's parent, played by the socket of the fabric's third namespace


class Workers:
    """The workers' sockets on a fabric, their packet numbers, and what the aggregator
    counted."""

    def __init__(self, fabric: Fabric, socks: list[socket.socket]):
        self.fabric, self.socks = fabric, socks
        self.seq = [0] * len(socks)  # the next new packet's number, by worker

    def number(self, worker: int) -> int:
        """A number for the worker's next new packet (the software switch NACKs the
        numbers a worker skips: its packets must be numbered in order)."""
        seq = self.seq[worker]
        self.seq[worker] = (seq + 1) % 256
        return seq

    def send(self, worker: int, packet: bytes) -> None:
        self.socks[worker].sendto(packet, SWITCH)

    def receive(self, worker: int, timeout: float = 5.0) -> tuple[dict, list, list]:
        """The next packet to ``worker``: (header, [(exponent, proposal)], values)."""
        self.socks[worker].settimeout(timeout)
        data = self.socks[worker].recv(65536)
        head = P.unpack_header(data)
        end = P.HEADER_BYTES + P.PAIR_BYTES * head["blocks"]
        pairs = np.frombuffer(data[P.HEADER_BYTES:end], ">i2").reshape(-1, 2)
        values = np.frombuffer(data[end:], ">i4")
        assert len(values) == head["count"], (head, len(data))
        return head, [tuple(map(int, p)) for p in pairs], values.tolist()

    def silent(self, worker: int) -> bool:
        """Nothing comes to ``worker`` for a while."""
        self.socks[worker].settimeout(0.3)
        try:
            self.socks[worker].recv(65536)
        except OSError:
            return True
        return False

    def drops(self) -> dict[str, int]:
        with self.fabric.controller() as c:
            return c.read_drops()

    def dropped(self, before: dict[str, int], reason: str, count: int) -> None:
        """The aggregator's ``reason`` counter grows by ``count`` from ``before`` (read
        over P4Runtime, a moment behind the packets)."""
        deadline = time.monotonic() + 5
        while (after := self.drops())[reason] - before[reason] < count:
            assert time.monotonic() < deadline, (reason, count, before, after)
            time.sleep(0.05)
        assert after[reason] - before[reason] == count, (reason, before, after)


@contextmanager
def installed(kind: str, job_id: int, k: int, slots: int, block: int, value_bits: int,
              log_dir: Path, leaf: bool = False) -> Iterator[Workers]:
    """Two workers of job ``job_id``, installed by the controller on a fabric whose
    aggregator is ``kind`` (software or bmv2). ``leaf``: the job is a tree's leaf there,
    worker 1 of a parent that a third socket plays (socks[2], in namespace 2 at
    PARENT_PORT)."""
    with Fabric(kind, 3 if leaf else 2, k, slots, block, value_bits,
                log_dir=log_dir) as fabric:
        job = fabric.job(job_id, [0, 1])
        if leaf:
            job = dataclasses.replace(job, parent=Parent(worker_ip(2), PARENT_PORT, 1,
                                                         worker_mac(2), 3))
        fabric.configure(job)
        socks = [fabric.udp_socket(r, w.udp_port) for r, w in enumerate(job.workers)]
        if leaf:
            socks.append(fabric.udp_socket(2, PARENT_PORT))
        try:
            yield Workers(fabric, socks)
        finally:
            for s in socks:
                s.close()
