"""The software aggregator's server: one UDP socket, the compiled data path, its control.

A UDP server with the semantics a P4 switch has (docs/protocol.md): the data path is
the compiled ``Aggregator`` (_fast/switch_loop.pyx); this module is its control side:
jobs joining and leaving, idle jobs freed, fault injection, a periodic status line, and
a clean stop on SIGINT/SIGTERM.

Jobs come two ways (docs/control.md): ranks join with control packets (plain
``mpiexec``, no controller), or a controller installs them over P4Runtime
(``--p4runtime-port``, served by switch.p4runtime_service in a thread of this
process, carried out by this loop between batches).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

from .. import protocol as P
from ..control import schema as S
from ..errors import SystemCallError

log = logging.getLogger("ina_collectives.switch")

# What became of a control packet: the switch counts each under one of these (stats(),
# the status line). Every JOIN is a join or a refusal, every LEAVE and PROBE from a worker
# a leave or a probe; "foreign control" is a LEAVE of a worker from another address, or
# fault settings from another machine; "malformed control" anything not taken whole.
CONTROL_OUTCOMES = ("joins", "refusals", "leaves", "probes", "ignored probes", "wakes",
                    "fault settings", "foreign control", "malformed control",
                    "joins sent up", "probes sent up", "parent replies")
# A tree's leaf: how often it asks its parent again (a JOIN or PROBE sent up that has no
# answer yet), and how long a parent's answer counts as the parent being there.
UP_RESEND = 0.1
PARENT_FRESH = 1.0
# The int32 values each op's request carries (the op included).
CONTROL_VALUES = {P.CTRL_JOIN: 6, P.CTRL_LEAVE: 1, P.CTRL_PROBE: 1, P.CTRL_WAKE: 1,
                  P.CTRL_FAULTS: 1 + len(P.FAULT_FIELDS)}


class SoftwareSwitch:
    """An aggregator on one UDP socket."""

    def __init__(self, host: str = "127.0.0.1", port: int = P.UDP_PORT,
                 idle_seconds: float = 60.0, pool_slots: int = 1024,
                 max_elements: int = P.MAX_ELEMENTS, p4runtime_port: int | None = None,
                 device_id: int = 1, job_share: float = 1.0, gso: bool = True,
                 p4runtime_host: str = "127.0.0.1", faults_from: str = "127.0.0.1",
                 like: str | None = None, parent: tuple[str, int] | None = None,
                 up_worker: int = 0, up_n: int = 0):
        """``host``: the address the workers send to (loopback by default). P4Runtime
        (``p4runtime_port``) listens on ``p4runtime_host`` and fault settings are taken
        from ``faults_from``, loopback both by default, whatever ``host`` is: a switch
        that serves other machines keeps its control to this one unless told otherwise.
        ``like``: "tofino" or "tofino2", serve as that Tofino build would
        (control/schema.py's TOFINO): announce its capabilities and drop what they leave
        out, take jobs of its K, B, 32-bit values and n only. ``parent``: this switch is
        a leaf of an aggregation tree (docs/trees.md): each job that joins here joins the
        parent as its worker ``up_worker`` of ``up_n``, and the cells its workers
        complete go up as that worker's packets; it takes no predicted windows and no
        quorum calls."""
        from .._fast.switch_loop import DROP_REASONS, Aggregator

        self.sock = P.udp_socket(host, port)
        self.address = self.sock.getsockname()
        self.aggregator = Aggregator(self.sock.fileno())
        # Batched system calls (issue 15): workers' segmented sends arrive coalesced where
        # the kernel does UDP_GRO (the loop splits them), and each worker's results leave
        # in segmented sends (UDP_SEGMENT, sendmmsg where the kernel refuses it).
        self.gro = P.enable_gro(self.sock)
        self.aggregator.gso = 1 if gso else 0  # (0: sendmmsg, the fallback, forced)
        self.like = None if like is None else S.TOFINO[like]
        if self.like is not None:
            self.aggregator.features = self.like.capabilities
            max_elements = min(max_elements, self.like.k)
        self.parent = parent
        self.up_worker, self.up_n = up_worker, up_n
        self._parent_be = P.sockaddr_be(parent) if parent is not None else None
        self.up: dict[int, tuple[int, int]] = {}  # job -> the parent's (status, slots)
        self._up_room: dict[int, int] = {}  # job -> the slots asked of the parent for it
        self._up_sent: dict[tuple[int, int], float] = {}  # (op, job) -> when it went up
        self._parent_heard = -float("inf")
        # Workers' JOINs held until the parent answers the job's (then taken again).
        self._held_joins: dict[int, list[tuple[bytes, int, int]]] = {}
        if parent is not None:
            self.aggregator.features &= ~(P.CAP_PREDICT | P.CAP_QUORUM)
        self.drop_reasons = DROP_REASONS
        self.idle_seconds = idle_seconds
        # Like a P4 switch's register arrays: a fixed pool of slots shared by the jobs,
        # and a largest K. A job is granted the slots it asks for, or fewer: what is free,
        # at most job_share of the pool; with none free it is refused (its ranks take the
        # ring). A job granted fewer asks again when slots free up (docs/striping.md).
        if not 0 < job_share <= 1:
            raise ValueError(f"job_share must be in (0, 1], got {job_share}")
        self.pool_slots, self.max_elements = pool_slots, max_elements
        self.job_share = job_share
        self.job_slots: dict[int, int] = {}   # granted
        self.job_asked: dict[int, int] = {}
        # Every control packet the loop hands over is counted once, by what became of it
        # (CONTROL_OUTCOMES); "jobs freed idle" counts the idle sweep.
        self.control_counts = {name: 0 for name in CONTROL_OUTCOMES + ("jobs freed idle",)}
        self._warned_at = 0.0  # rate limit of the warnings about refused control packets
        self._unwarned = 0
        self._stop = False
        self.fault_peers: list = []  # other shards' aggregators: fault settings apply to all
        # A fault setting of this (Python) side: no answer to a PROBE of job 0, as a P4
        # switch answers only its installed workers' probes (tests of the return path).
        self.probes_from_installed_only = False
        self.faults_from_be = P.ipv4_be(faults_from)
        self.shard_ports: list[int] = []  # every shard's port (Shards sets it): in replies
        self.p4runtime = self._runner = None
        if p4runtime_port is not None:
            self._serve_p4runtime(p4runtime_host, p4runtime_port, device_id, max_elements)

    def _serve_p4runtime(self, host: str, port: int, device_id: int, max_elements: int
                         ) -> None:
        from .p4runtime_service import LoopRunner, Server, Target

        wake_to = ("127.0.0.1" if self.address[0] == "0.0.0.0" else self.address[0],
                   self.address[1])
        waker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        wake = P.control_packet(0, 0, [P.CTRL_WAKE])
        self._runner = LoopRunner(lambda: waker.sendto(wake, wake_to))
        self.target = Target(self.aggregator, max_elements, device_id)
        try:
            self.p4runtime = Server(self.target, self._runner, host, port)
        except (OSError, RuntimeError) as exc:
            self.sock.close()
            raise OSError(f"cannot serve P4Runtime on {host}:{port}: {exc}") from None

    def stop(self, *_: object) -> None:
        self._stop = True

    def serve(self, stats_interval: float = 0.0, duration: float | None = None,
              status: Callable[[], str] | None = None) -> None:
        """Run until stop() (or SIGINT/SIGTERM, set up by main) or ``duration`` seconds;
        every ``stats_interval`` seconds print ``status()`` (default: status_line)."""
        started = last_stats = last_idle = time.monotonic()
        while not self._stop:
            for packet, addr, port in self.aggregator.run(100):
                self._control(packet, addr, port)
            if self._runner is not None:
                self._runner.run_pending()
            now = time.monotonic()
            if stats_interval and now - last_stats >= stats_interval:
                print((status or self.status_line)(), flush=True)
                last_stats = now
            if now - last_idle >= 1.0:
                for job in self.aggregator.idle_jobs(self.idle_seconds):
                    log.warning("job %d sent nothing for %g s: freed", job, self.idle_seconds)
                    self.aggregator.free_job(job)
                    self._forget(job)
                    self.control_counts["jobs freed idle"] += 1
                if self.parent is not None:
                    self._sweep_up()
                last_idle = now
            if duration is not None and now - started >= duration:
                break
        if self.p4runtime is not None:
            self._runner.close()
            self.p4runtime.stop()
        self.sock.close()

    def stats(self) -> dict:
        a = self.aggregator
        return {"packets_in": a.packets_in, "packets_out": a.packets_out,
                "results": a.results, "retransmits_answered": a.retransmits_answered,
                "nacks": a.nacks, "result_requests": a.result_requests,
                "late_answered": a.late_answered, "openings": a.openings,
                "slots_busy": a.busy_slots(),
                "drops": a.drop_counts(),
                "send_failures": a.send_failures,
                "send_path": "UDP_SEGMENT" if a.gso else "sendmmsg", "send_calls": a.send_calls,
                "receive_path": "UDP_GRO" if self.gro else "recvmmsg",
                "gro_buffers": a.gro_buffers,
                **({"last_send_errno": a.last_errno} if a.send_failures else {}),
                "faults": self.faults(), **self.control_counts,
                "free_slots": self.free_slots(),
                "jobs": {job: {"workers": (a.job_shape(job) or (0,))[0], "slots": slots,
                               "asked": self.job_asked.get(job, slots),
                               "results": a.job_results(job) or 0}
                         for job, slots in self.job_slots.items()},
                "control overflow": a.control_overflow,
                **({"parent": "%s:%d" % self.parent if self.parent is not None
                    else "installed", "sent_up": a.sent_up,
                    "resent_up": a.resent_up, "came_down": a.came_down,
                    "stale_down": a.stale_down, "parent_held": a.parent_held,
                    "parent_nacks": a.parent_nacks}
                   if self.parent is not None or a.leaves else {}),
                **({"p4runtime jobs": len(self.target.jobs)} if self.p4runtime else {})}

    def status_line(self) -> str:
        return status_text("%s:%d" % self.address[:2], self.stats())

    def free_slots(self) -> int:
        return self.pool_slots - sum(self.job_slots.values())

    def _forget(self, job: int) -> None:
        self.job_slots.pop(job, None)
        self.job_asked.pop(job, None)
        if self.parent is not None:
            if self.up.pop(job, None) is not None:
                self._send_up(P.CTRL_LEAVE, job, [P.CTRL_LEAVE], force=True)  # (best effort)
            self._up_room.pop(job, None)
            self._held_joins.pop(job, None)
            for key in [key for key in self._up_sent if key[1] == job]:
                del self._up_sent[key]

    def _sweep_up(self) -> None:
        """A leaf's record of jobs the parent refused or never answered, and that no
        worker asked about since: forgotten after a while (job ids are drawn anew by each
        join of the ranks)."""
        now = time.monotonic()
        for (op, job), sent in list(self._up_sent.items()):
            if now - sent > self.idle_seconds and self.aggregator.job_shape(job) is None:
                self.up.pop(job, None)
                self._forget(job)

    # -- a tree's leaf: the parent ----------------------------------------------------

    def _send_up(self, op: int, job: int, body: list[int], force: bool = False) -> None:
        """A control request to the parent, as this leaf's worker, at most every
        UP_RESEND seconds per (op, job) unless ``force``."""
        now = time.monotonic()
        if not force and now - self._up_sent.get((op, job), -float("inf")) < UP_RESEND:
            return
        self._up_sent[(op, job)] = now
        try:
            self.aggregator.reply(P.control_packet(job, self.up_worker, body),
                                  *self._parent_be)
        except SystemCallError as exc:  # (lost, as on a link: asked again)
            log.debug("to the parent: %s", exc)

    def _from_parent(self, packet: bytes) -> None:
        """The parent's reply to a JOIN or PROBE this leaf sent up."""
        head, body = P.read_control(packet)
        if head["flags"] != P.FLAG_CONTROL | P.FLAG_RESULT or body.size < 2:
            return
        self._parent_heard = time.monotonic()
        if int(body[0]) == P.CTRL_JOIN and head["job"] not in self.up:
            self.up[head["job"]] = (int(body[1]), int(body[3]) if body.size > 3 else 0)
            if int(body[1]) != 0:
                log.warning("the parent %s refused job %d: %s", "%s:%d" % self.parent,
                            head["job"], P.status_text(P.JOIN_STATUS, int(body[1])))
            for held in self._held_joins.pop(head["job"], []):
                self._control(*held)  # (answered now, not at the worker's next try)

    def _join_up(self, job: int, k: int, slots: int, block: int, value_bits: int
                 ) -> tuple:
        """A worker's JOIN at a leaf: the job joins the parent first. Until the parent
        answers, the worker has no answer (it asks again): (outcome, None, ""); then
        (0, the slots the parent granted), or the parent's refusal as this JOIN's
        outcome."""
        up = self.up.get(job)
        if up is None:
            # What this leaf can grant, asked of the parent (once per job: a resend asks
            # the same): every leaf then grants the parent's answer, the same S for every
            # rank (a leaf short of slots asks for fewer; the parent refuses a job asked
            # with two S, and the ranks take the ring).
            room = self._up_room.setdefault(job, min(
                slots, self.free_slots(), max(1, int(self.pool_slots * self.job_share))))
            if room < 1:
                self._up_room.pop(job, None)
                return "refusals", 4, f"job {job}: no free slots at this leaf"
            self._send_up(P.CTRL_JOIN, job, [P.CTRL_JOIN, self.up_n, k, room, block,
                                             value_bits])
            return "joins sent up", None, ""
        if up[0] != 0:
            return "refusals", up[0], (f"the parent {self.parent[0]}:{self.parent[1]} "
                                       f"refused job {job}: "
                                       f"{P.status_text(P.JOIN_STATUS, up[0])}")
        return up

    # -- control packets -------------------------------------------------------------

    def _control(self, packet: bytes, addr_be: int, port_be: int) -> None:
        """One control packet: carried out and answered, or refused; counted either way
        under one of CONTROL_OUTCOMES. Nothing a packet holds ends the loop."""
        if self.parent is not None and (addr_be, port_be) == self._parent_be:
            self.control_counts["parent replies"] += 1
            self._from_parent(packet)
            return
        try:
            outcome, status, why = self._control_request(packet, addr_be, port_be)
        except Exception as exc:  # a bug shown by a strange packet: count it, keep serving
            outcome, status, why = "malformed control", None, f"{type(exc).__name__}: {exc}"
            log.exception("control packet from %s dropped",
                          P.address_text(addr_be, port_be))
        self.control_counts[outcome] += 1
        if why:
            self._warn_refused(outcome, why, addr_be, port_be)
        if status is None:
            return
        head = P.unpack_header(packet)
        op = int.from_bytes(packet[P.HEADER_BYTES:P.HEADER_BYTES + 4], "big", signed=True)
        # The fourth value: the slots granted to a job just joined, or the pool's free ones.
        # A join refused for its packets' size: this switch's MTU towards the worker.
        slots = (self.job_slots.get(head["job"], 0) if op == P.CTRL_JOIN and status == 0
                 else (_mtu_towards(addr_be, port_be) or 0)
                 if op == P.CTRL_JOIN and status == P.JOIN_MTU
                 else self.free_slots() if op == P.CTRL_PROBE and head["job"] == 0 else 0)
        caps = self.aggregator.features | (P.CAP_SHARDS if self.shard_ports else 0)
        try:
            self.aggregator.reply(P.control_packet(head["job"], head["worker"],
                                                   [op, status, caps, slots,
                                                    *self.shard_ports], reply=True),
                                  addr_be, port_be)
        except SystemCallError as exc:  # the reply was refused: the sender retries
            log.warning("%s", exc)

    def set_faults(self, **faults: float) -> None:
        """Fault injection (P.FAULT_FIELDS; those not named are cleared): the data path's
        in this shard's aggregator and its peers', the probe rule here. ValueError if a
        setting is out of range (then nothing changes)."""
        rule = bool(faults.pop("probes_from_installed_only", 0))
        self.aggregator.set_faults(**faults)
        for peer in self.fault_peers:  # plain numbers, read by the peers' loops
            peer.set_faults(**faults)
        self.probes_from_installed_only = rule

    def faults(self) -> dict[str, float]:
        """The faults in force, as set_faults takes them (zero ones left out)."""
        return {**self.aggregator.faults(),
                **({"probes_from_installed_only": 1} if self.probes_from_installed_only
                   else {})}

    def _warn_refused(self, outcome: str, why: str, addr_be: int, port_be: int) -> None:
        """A warning about a refused control packet, at most one a second (a flood of
        them must not flood the log); the counters have them all."""
        now = time.monotonic()
        if now - self._warned_at < 1.0:
            self._unwarned += 1
            return
        more = f" (and {self._unwarned} more since the last warning)" if self._unwarned else ""
        log.warning("%s from %s: %s%s", outcome, P.address_text(addr_be, port_be), why, more)
        self._warned_at, self._unwarned = now, 0

    def _control_request(self, packet: bytes, addr_be: int, port_be: int
                         ) -> tuple[str, int | None, str]:
        """What to do with a control packet: (its outcome, the status to answer or None
        for no answer, why it was refused or ""). A request is taken only whole
        (docs/protocol-recovery.md, Control packets): flags CONTROL alone, count = the number of
        int32 values the datagram carries, as many as its op takes."""
        head, body = P.read_control(packet)
        malformed = "malformed control"
        if head["flags"] != P.FLAG_CONTROL:
            return malformed, None, f"flags {head['flags']:#04x} (a request has CONTROL alone)"
        if head["version"] != P.PROTOCOL_VERSION:
            # A worker of another version: its join or probe is refused in this version's
            # reply (the version byte leads every header), which names both; the rest
            # is dropped.
            why = f"protocol version {head['version']} (this switch: {P.PROTOCOL_VERSION})"
            if body.size and int(body[0]) in (P.CTRL_JOIN, P.CTRL_PROBE):
                return "refusals", P.JOIN_VERSION, why
            return malformed, None, why
        values = (len(packet) - P.HEADER_BYTES) / 4
        if head["count"] != values or not body.size:
            return malformed, None, f"count {head['count']} for {values:g} values"
        op, job, worker = int(body[0]), head["job"], head["worker"]
        if CONTROL_VALUES.get(op) != body.size:
            return malformed, None, f"op {op} with {body.size} values"
        if op == P.CTRL_JOIN:
            n, k, slots, block, bits = (int(v) for v in body[1:])
            new = self.aggregator.job_shape(job) is None
            if self.parent is not None and 1 <= n <= P.MAX_WORKERS:
                up = self._join_up(job, k, slots, block, bits)
                if len(up) == 3:
                    if up[1] is None:  # (at most a few per job: one per worker's try)
                        held = self._held_joins.setdefault(job, [])
                        if len(held) < 2 * P.MAX_WORKERS:
                            held.append((packet, addr_be, port_be))
                    return up
                slots = min(slots, up[1]) if up[1] > 0 else slots
                if new and min(self.free_slots(), int(self.pool_slots * self.job_share)) < slots:
                    # (granting fewer than the parent did would give this leaf's ranks
                    # another S than the others')
                    return "refusals", 4, (f"job {job}: the parent granted {slots} slots, "
                                           f"this leaf has fewer free now")
            status, why = self._join(job, worker, n, k, slots, block, bits, addr_be,
                                     port_be)
            if status == 0 and new and self.parent is not None:
                self.aggregator.set_parent(job, *self._parent_be, self.up_worker)
            return ("joins" if status == 0 else "refusals"), status, why
        if op == P.CTRL_LEAVE:
            # Only the worker itself, from its address, leaves a job (a stranger's LEAVE
            # would free a running job); a job not here (left already, or freed idle) or
            # a controller's (never left by packets) has nothing to do.
            if (self.aggregator.job_shape(job) is not None
                    and not self.aggregator.is_managed(job)
                    and not self.aggregator.worker_at(job, worker, addr_be, port_be)):
                return "foreign control", 1, f"LEAVE of worker {worker} of job {job}"
            if self.aggregator.leave(job, worker):
                self._forget(job)
                log.info("job %d: every worker left, slots freed", job)
            return "leaves", 0, ""
        if op == P.CTRL_PROBE:
            if job == 0 and self.probes_from_installed_only:
                return "ignored probes", None, ""
            if job == 0 and self.parent is not None and (
                    time.monotonic() - self._parent_heard > PARENT_FRESH):
                # A leaf serves only with its parent: it answers once the parent has.
                self._send_up(P.CTRL_PROBE, 0, [P.CTRL_PROBE])
                return "probes sent up", None, ""
            # Job 0: is anyone there? Else: is the sender worker `worker` of the job?
            return "probes", (0 if job == 0 or self.aggregator.worker_at(
                job, worker, addr_be, port_be) else 1), ""
        if op == P.CTRL_WAKE:
            return "wakes", None, ""  # the P4Runtime thread woke the loop: run_pending
        # CTRL_FAULTS: a test facility, from this machine only (faults_from: loopback).
        if addr_be != self.faults_from_be:
            return "foreign control", None, "fault settings from another address"
        if job != 0 or worker != 0:
            return malformed, None, f"fault settings for job {job} worker {worker}"
        was = self.faults()
        try:
            self.set_faults(**P.decode_faults(body[1:]))
        except ValueError as exc:
            return malformed, 1, f"fault settings refused: {exc}"
        if self.faults() != was:
            log.warning("fault injection now %s", self.faults() or "off")
        return "fault settings", 0, ""

    def _join(self, job: int, worker: int, n: int, k: int, slots: int, block: int,
              value_bits: int, addr_be: int, port_be: int) -> tuple[int, str]:
        """A JOIN's status (P.JOIN_STATUS) and, where it is refused for a reason the
        switch's operator should see, why."""
        # max_elements bounds a cell's values in int32s (as a P4 build's 256-byte payload
        # holds 64 int32 or 128 int16); the default, whatever a datagram holds.
        room = P.MAX_DATAGRAM if self.max_elements >= P.MAX_ELEMENTS else 4 * self.max_elements
        if not (1 <= n <= P.MAX_WORKERS and 0 <= worker < n and 1 <= slots <= 65536
                and block in P.BLOCK_SIZES and value_bits in P.VALUE_BITS
                and 1 <= k and k * value_bits // 8 <= room
                and P.packet_bytes(k, block, value_bits) <= P.MAX_DATAGRAM):
            return 1, ""
        like = self.like
        if like is not None and not (n <= like.max_workers and block == like.block
                                     and value_bits == like.value_bits):
            return 1, (f"job {job} asks for n {n}, B {block}, {value_bits}-bit values: "
                       f"this switch serves as the {like.chip} build, which takes n up to "
                       f"{like.max_workers}, B {like.block} and 32-bit values")
        # Its results leave by this host's route to the worker: a packet over that MTU
        # would leave as IP fragments or not at all.
        size = P.packet_bytes(k, block, value_bits) + P.IP_UDP_HEADER_BYTES
        mtu = _mtu_towards(addr_be, port_be)
        if mtu is not None and size > mtu:
            return P.JOIN_MTU, (f"job {job}'s packets of K {k} are {size}-byte datagrams, "
                                f"over this switch's MTU {mtu} towards the worker (K "
                                f"{P.elements_for_mtu(mtu, block, value_bits)} fits)")
        return self._admit(job, worker, n, k, slots, block, value_bits, addr_be,
                           port_be), ""

    def _admit(self, job: int, worker: int, n: int, k: int, slots: int, block: int,
               value_bits: int, addr_be: int, port_be: int) -> int:
        """A well-formed JOIN that fits the path: the job made or matched, the worker's
        address set; its status."""
        if self.aggregator.is_managed(job):
            return 5
        shape = self.aggregator.job_shape(job)
        if shape is None:
            granted = min(slots, self.free_slots(),
                          max(1, int(self.pool_slots * self.job_share)))
            if granted < 1:
                return 4
            if not self.aggregator.add_job(job, n, k, granted, block, value_bits):
                return 4
            self.job_slots[job], self.job_asked[job] = granted, slots
            log.info("job %d: %d workers, K %d, S %d%s, B %d, %d-bit values", job, n, k,
                     granted, f" of {slots} asked" if granted < slots else "", block,
                     value_bits)
        elif (shape[:2] + shape[3:] != (n, k, block, value_bits)
              or slots != self.job_asked.get(job, shape[2])):
            return 2
        if not self.aggregator.set_worker(job, worker, addr_be, port_be):
            return 3
        return 0


def _mtu_towards(addr_be: int, port_be: int) -> int | None:
    """This host's MTU on the path to a worker's address; None without a route."""
    host, _, port = P.address_text(addr_be, port_be).rpartition(":")
    try:
        return P.path_mtu((host, int(port)))
    except OSError:
        return None


def status_text(address: str, s: dict) -> str:
    """The status line of an aggregator's counters (SoftwareSwitch.stats, or several
    shards' added up): ``ina-switch ADDRESS:`` then ``key=value`` fields, a value with no
    spaces (lists as ``name:count,...``, ``none`` when empty); ``parse_status`` reads it
    back."""
    def listed(pairs: list[tuple[str, object]]) -> str:
        return ",".join(f"{k.replace(' ', '_')}:{v}" for k, v in pairs) or "none"

    fields: list[tuple[str, object]] = [
        ("in", s["packets_in"]), ("out", s["packets_out"]), ("results", s["results"]),
        ("openings", s["openings"]), ("busy_slots", s["slots_busy"]),
        ("retransmits_answered", s["retransmits_answered"]), ("nacks", s["nacks"]),
        ("result_requests", s["result_requests"])]
    if s.get("late_answered"):
        fields.append(("late_answered", s["late_answered"]))
    if "p4runtime jobs" in s:
        fields.append(("p4runtime_jobs", s["p4runtime jobs"]))
    if "parent" in s:  # a tree's leaf
        fields += [("parent", s["parent"]), ("sent_up", s["sent_up"]),
                   ("resent_up", s["resent_up"]), ("came_down", s["came_down"]),
                   ("stale_down", s["stale_down"]), ("parent_held", s["parent_held"]),
                   ("parent_nacks", s["parent_nacks"])]
    fields += [("send_calls", s["send_calls"]), ("send_path", s["send_path"]),
               ("gro_buffers", s["gro_buffers"])]
    if s["send_failures"]:
        fields += [("sends_refused", s["send_failures"]),
                   ("last_send_error", os.strerror(s["last_send_errno"]).replace(" ", "_"))]
    fields += [("control", listed([(k, s[k]) for k in CONTROL_OUTCOMES + (
                   "jobs freed idle", "control overflow") if s[k]])),
               ("drops", listed(list(s["drops"].items())))]
    for job, j in sorted(s["jobs"].items()):
        fields.append((f"job{job}", listed([("workers", j["workers"]), ("slots", j["slots"])]
                                           + ([("asked", j["asked"])]
                                              if j["asked"] != j["slots"] else [])
                                           + [("results", j["results"])])))
    return f"ina-switch {address}: " + " ".join(f"{k}={v}" for k, v in fields)


def parse_status(line: str) -> dict[str, object]:
    """A status line (status_text) as a dict: ``address``, each field's value as an int
    where it is one, and the listed fields (control, drops, job<id>) as dicts of ints."""
    words = line.split()
    if len(words) < 2 or words[0] != "ina-switch":
        raise ValueError(f"not an ina-switch status line: {line!r}")
    status: dict[str, object] = {"address": words[1].rstrip(":")}
    for word in words[2:]:
        key, sep, value = word.partition("=")
        try:
            if not sep:
                raise ValueError("no '='")
            if key in ("control", "drops") or key.startswith("job"):
                status[key] = {} if value == "none" else {
                    name: int(count) for name, count in
                    (item.split(":") for item in value.split(","))}
            else:
                status[key] = int(value) if value.isdigit() else value
        except ValueError as exc:
            raise ValueError(f"status line field {word!r} is not key=value "
                             f"(lists name:count,...): {exc}") from None
    return status


def status_summary(line: str) -> str:
    """A status line (status_text) in words, for a person at the end of a job: what the
    switch added up, what it did for lost packets, and what it dropped and why."""
    s = parse_status(line)
    where = s.get("address", "?")
    results, packets = s.get("results", 0), s.get("in", 0)
    if not results:
        return (f"the switch at {where} returned no results ({packets} packets in): no "
                f"call went through it" + _left_installed(s))
    text = f"the switch at {where} returned {results} results, adding {packets} packets"
    again = [f"{s[key]} {what}" for key, what in (
        ("retransmits_answered", "packets sent again"),
        ("result_requests", "requests for lost results")) if s.get(key)]
    if again:
        text += "; it answered " + " and ".join(again)
    drops = s.get("drops") or {}
    if drops:
        text += "; dropped " + ", ".join(
            f"{count} ({reason.replace('_', ' ')})" for reason, count in drops.items())
    return text + _left_installed(s)


def _left_installed(s: dict) -> str:
    """The jobs a controller installed that are still there (a job's teardown failed)."""
    left = s.get("p4runtime_jobs", 0)
    return f"; {left} job(s) still installed over P4Runtime" if left else ""
