"""What the controller installs for one job: its workers and its share of the switch, and
the workers file (JSON) that describes them for ``ina-run --workers`` and the CLI."""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .. import protocol as P


@dataclass(frozen=True)
class Worker:
    """Where a worker is, as the switch sees it: its packets' source IPv4 and UDP port,
    and where results for it go (MAC, the switch's egress port towards it)."""
    ip: str
    udp_port: int
    mac: str = "00:00:00:00:00:00"
    switch_port: int = 0

    def __post_init__(self) -> None:
        _check_place("worker", self.ip, self.udp_port, self.mac, self.switch_port)


def _check_place(what: str, ip: str, udp_port: int, mac: str, switch_port: int) -> None:
    """Where a worker or a parent is, as the switch reaches it; ValueError naming ``what``
    and the field that is wrong."""
    ipaddress.IPv4Address(ip)  # ValueError for a malformed address
    if not 0 < udp_port < 65536:
        raise ValueError(f"{what} UDP port {udp_port} is out of range")
    if not P.is_mac(mac):
        raise ValueError(f"{what} MAC {mac!r} is not aa:bb:cc:dd:ee:ff")
    if not 0 <= switch_port < 512:
        raise ValueError(f"switch port {switch_port} does not fit 9 bits")


@dataclass(frozen=True)
class Parent:
    """A tree leaf's parent (docs/trees.md): the aggregator its sums go up to (IPv4 and UDP
    port), this leaf's worker id there, and the MAC and the switch's egress port towards it
    (a P4 switch's; the software switch sends from its socket)."""
    ip: str
    udp_port: int = P.UDP_PORT
    worker: int = 0
    mac: str = "00:00:00:00:00:00"
    switch_port: int = 0

    def __post_init__(self) -> None:
        _check_place("parent", self.ip, self.udp_port, self.mac, self.switch_port)
        if not 0 <= self.worker < P.MAX_WORKERS:
            raise ValueError(f"the leaf's worker id at its parent must be 0.."
                             f"{P.MAX_WORKERS - 1}, got {self.worker}")


@dataclass(frozen=True)
class JobSpec:
    """One job: worker id = index in ``workers`` (= MPI rank); ``slots`` S of the job,
    cells ``slot_base`` .. ``slot_base + slots - 1`` of the pipeline's register pool."""
    job_id: int
    workers: Sequence[Worker]
    slots: int
    slot_base: int = 0
    mcast_grp: int = 0  # 0: the job id
    elements: int = 0   # K the ranks will use; 0: the target's (checked when given)
    value_bits: int = 0  # the values' width the ranks will use (32, 16); 0: the target's
    block: int = 0       # B, values per sub-block the ranks will use; 0: the target's
    parent: Parent | None = None  # a tree's leaf here: where its sums go up

    def __post_init__(self) -> None:
        if not 1 <= self.job_id < 65536:
            raise ValueError(f"job id {self.job_id} must be 1..65535")
        if not 1 <= len(self.workers) <= P.MAX_WORKERS:
            raise ValueError(f"a job has 1..{P.MAX_WORKERS} workers, got {len(self.workers)}")
        if self.slots < 1 or self.slot_base < 0:
            raise ValueError(f"slots {self.slot_base}+{self.slots}: need slots >= 1, base >= 0")
        if self.value_bits not in (0, *P.VALUE_BITS):
            raise ValueError(f"value bits must be 32 or 16 (0: the target's), got "
                             f"{self.value_bits}")
        if self.block not in (0, *P.BLOCK_SIZES):
            raise ValueError(f"sub-block size B must be one of {P.BLOCK_SIZES} (0: the "
                             f"target's), got {self.block}")
        if len({(w.ip, w.udp_port) for w in self.workers}) != len(self.workers):
            raise ValueError("two workers share an address and UDP port")

    @property
    def group(self) -> int:
        return self.mcast_grp or self.job_id


def load_workers(path: Path, count: int | None = None,
                 ports: Sequence[int] | None = None) -> list[Worker]:
    """The workers file: a JSON list, one object per rank, with ``ip`` and optionally
    ``udp_port`` (required unless ``ports`` gives each rank's default), ``mac`` and
    ``switch_port``. ``count``: the number of ranks it must describe. ValueError naming
    the file and the problem otherwise."""
    try:
        described = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"workers file {path}: {exc}") from None
    if not isinstance(described, list) or (count is not None and len(described) != count):
        raise ValueError(f"workers file {path}: a JSON list of "
                         f"{count if count is not None else 'the'} objects (one per rank) "
                         f"expected")
    try:
        return [Worker(str(w["ip"]),
                       int(w["udp_port"] if ports is None else w.get("udp_port", ports[i])),
                       str(w.get("mac", "00:00:00:00:00:00")), int(w.get("switch_port", 0)))
                for i, w in enumerate(described)]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"workers file {path}: {type(exc).__name__} {exc}") from None
