"""Allreduce computed by the aggregator ("the switch"): the INA engine.

It quantizes, streams through the worker's link (ina/link.py) and dequantizes; the ranks
agree on every block's exponent first and on the outcome last. It never runs another
engine itself: NaN/Inf in the input or a failed aggregator give the call back to the
chooser (HandOver), which finishes it on the ring.
"""
from __future__ import annotations

import logging
import random
import time

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..errors import AggregatorUnavailable
from ..ina.link import WorkerLink
from ..settings import Settings
from .engine import AllreduceCall, HandOver
from .ops import FLOAT_DTYPES, Op
from .waiting import Deadline, wait

log = logging.getLogger("ina_collectives")
REASON_BYTES = 512  # of the first failing rank's reason, sent to every rank


class InaEngine:
    """Allreduce computed by the aggregator ("the switch").

    Collective to construct: every rank joins the job at the aggregator (or, when a
    controller installed the job, settings.job, checks its entry with a probe) and the
    ranks agree; if any rank failed, no rank uses the aggregator (``unavailable`` says
    why). While it is unavailable, rank 0 probes the address without waiting (a
    datagram per call, _AnswerWatch) and its news rides on each call's agreement: the call
    after the aggregator answers again, every rank joins it again. A join that fails
    backs off: the next try waits 1, 2, 4 ... calls (at most ``switch_retry_calls``).
    With the agreement check off, rank 0 probes with a wait at those calls instead.
    """

    name = "ina"

    def __init__(self, comm: MPI.Intracomm, settings: Settings):
        from ..ina import kernels

        self.comm, self.settings = comm, settings
        self.kernels = kernels
        self.link: WorkerLink | None = None
        self.unavailable: str | None = None
        self.totals: dict[str, float] = {}  # the links' counters, over reconnections
        self.outages = self.returns = 0
        self.calls_by_width: dict[int, int] = {}  # calls served, by value bits
        self._retry_at: int | None = None  # the call number of the next reconnection
        self._retry_gap = 1
        self._seq = 0  # the number of the call under way (at_call_boundary)
        self._lasting = False  # the last failure was this job's setup: trying again is futile
        self._watch: _AnswerWatch | None = None  # rank 0's probes while unavailable
        if not settings.switch:
            self.unavailable = "ina: no aggregator configured (INA_SWITCH)"
            return
        self._connect()
        if self.unavailable:
            if self._lasting:
                log.warning("%s; calls take the ring", self.unavailable)
            else:
                self._schedule(0)
                log.warning("%s; calls take the ring (the aggregator is tried again from "
                            "call #%s on)", self.unavailable, self._retry_at)

    def _connect(self) -> None:
        """Every rank makes its link and joins (or probes its installed entry); collective.
        Sets ``link``, or ``unavailable`` with the first failing rank's reason."""
        from ..ina.link import WorkerLink

        comm, settings, kernels = self.comm, self.settings, self.kernels
        n, rank = comm.Get_size(), comm.Get_rank()
        block, bits = settings.switch_block, settings.switch_value_bits
        k = settings.switch_elements or P.max_elements(P.MAX_DATAGRAM, block, bits)
        error, lasting = None, True
        if n > P.MAX_WORKERS:
            error = f"{n} ranks exceed the aggregator's {P.MAX_WORKERS} workers"
        elif kernels.BACKEND != "fast":
            error = "the compiled fast path is not built"
        ports = [int(p) for p in settings.worker_ports.split(",") if p.strip()]
        if settings.job and error is None and len(ports) != n:
            error = (f"job {settings.job} was installed by a controller, but worker_ports "
                     f"(INA_WORKER_PORTS) names {len(ports)} ports for {n} ranks")
        # Rank 0's job id (INA_JOB, or a fresh one to join with) for every rank: one
        # collective whatever the ranks' settings say, so that none can wait alone. With
        # it, this run's epoch: every run of the ranks starts its slots at version 0, and
        # the switch takes a cell last used in another epoch for idle (an installed job's
        # cells are used again by each run, with no register reset).
        draw = random.SystemRandom().randrange
        ids = np.array([settings.job or draw(1, 65536), draw(1, 65536)], np.int32)
        self._collective(comm.Ibcast(ids, root=0), "rank 0's job id and epoch")
        job, epoch = int(ids[0]), int(ids[1])
        if error is None and settings.job != (job if settings.job else 0):
            error = f"INA_JOB is {settings.job} here but {job} on rank 0"
        if error is None:
            try:
                self.link = WorkerLink(P.parse_address(settings.switch), job, rank, n, k,
                                       settings.switch_slots,
                                       ports[rank] if settings.job else 0, epoch, block,
                                       bits, settings.switch_gso)
                self.link.totals = self.totals
                if settings.job:  # installed by a controller: worker id = rank
                    self.link.probe(settings.switch_join_timeout)
                else:
                    self.link.join(settings.switch_join_timeout)
            except AggregatorUnavailable as exc:  # the aggregator's doing: may pass
                error, lasting = str(exc), False
            except (ValueError, OSError) as exc:
                error = str(exc)
        # Every rank learns whether any failed (1: the aggregator did not answer or
        # refused; 2: this job's setup, which another try would not change) and the first
        # failing rank's reason.
        flags = np.empty(n, np.int8)
        mine = 0 if error is None else (1 if not lasting else 2)
        self._collective(comm.Iallgather(np.array([mine], np.int8), flags),
                         "every rank's outcome of joining the aggregator")
        self._lasting = bool((flags == 2).any())
        if flags.any():
            r = int(np.flatnonzero(flags)[0])
            text = np.zeros(REASON_BYTES, np.uint8)
            if rank == r:
                raw = str(error).encode()[:REASON_BYTES]
                text[:len(raw)] = np.frombuffer(raw, np.uint8)
            self._collective(comm.Ibcast(text, root=r), f"rank {r}'s reason")
            e = text.tobytes().rstrip(b"\0").decode(errors="replace")
            self.unavailable = f"ina: aggregator unavailable (rank {r}: {e})"
            self.close()
        else:
            self.unavailable = None

    def wire_format(self) -> dict[str, int]:
        """The packets this job sends: K values of ``value_bits`` bits per packet, one
        exponent per ``block`` of them (stats()["switch"])."""
        s = self.settings
        k = self.link.k if self.link is not None else s.switch_elements
        gso = self.link.send_state[0] if self.link is not None else s.switch_gso
        return {"protocol": P.PROTOCOL_VERSION, "elements": k,
                "value_bits": s.switch_value_bits, "block": s.switch_block,
                "calls_by_value_bits": dict(self.calls_by_width),
                "send_path": "UDP_SEGMENT" if gso else "sendmmsg",
                "receive_path": ("UDP_GRO" if self.link is not None and self.link.gro
                                 else "recvmmsg")}

    def _collective(self, request: MPI.Request, what: str) -> None:
        wait(request, Deadline(self.settings.timeout),
             lambda: f"all {self.comm.Get_size()} ranks to exchange {what}")

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.link is not None:
            self.link.leave()
            self.link.close()
            self.link = None

    # -- leaving the aggregator and coming back ----------------------------------------

    def _lost(self, reason: str, seq: int) -> None:
        """The aggregator failed mid-call (on every rank alike): ring until reconnected."""
        self.unavailable = reason
        self.outages += 1
        self.close()
        self._retry_gap = 1
        self._schedule(seq)
        log.warning("%s; calls take the ring, and the aggregator is tried again from call "
                    "#%d on", reason, self._retry_at)

    def _schedule(self, seq: int) -> None:
        cap = self.settings.switch_retry_calls
        self._retry_at = seq + self._retry_gap if cap else None
        self._retry_gap = min(2 * self._retry_gap, max(cap, 1))

    def answers_again(self) -> int:
        """Rank 0's news for the next call's agreement: 1 if the aggregator answered one
        of its probes since the last call (it may serve again), else 0. While the
        aggregator is unavailable (and tried again), rank 0 sends a probe now and then
        and reads the answers without waiting."""
        if self.link is not None or self._retry_at is None or self.comm.Get_rank() != 0:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            return 0
        if self._watch is None:
            self._watch = _AnswerWatch(P.parse_address(self.settings.switch))
        return int(self._watch.answered())

    def at_call_boundary(self, seq: int, answers: int | None = None) -> None:
        """The chooser calls this before offering call number ``seq`` (the same number on
        every rank), with rank 0's news (``answers_again``; None when the agreement check
        is off): when a reconnection is due, it happens here, on every rank alike."""
        self._seq = seq
        if self._retry_at is None or self.link is not None or seq < self._retry_at:
            return
        if answers is None:
            self._reconnect(seq)
        elif answers:
            self._reconnect(seq, alive=True)

    def _reconnect(self, seq: int, alive: bool | None = None) -> bool:
        """Collective: if the aggregator answers (``alive``, or None: rank 0 probes now
        and tells the others), every rank joins again (a new job and epoch, or the
        installed entry); True if it serves."""
        if alive is None:
            answer = np.zeros(1, np.int8)
            if self.comm.Get_rank() == 0:
                answer[0] = _answers(self.settings.switch,
                                     min(0.5, self.settings.switch_join_timeout))
            self._collective(self.comm.Ibcast(answer, root=0),
                             "whether the aggregator answers")
            alive = bool(answer[0])
        if alive:
            self._connect()
        if self.link is None:
            if self._lasting:
                self._retry_at = None
                log.warning("call #%d: %s; the ring from now on", seq, self.unavailable)
                return False
            self._schedule(seq)
            log.info("call #%d: the aggregator is still unavailable; next try at call #%d",
                     seq, self._retry_at if self._retry_at is not None else -1)
            return False
        self.returns += 1
        self._retry_at, self._retry_gap = None, 1
        log.warning("call #%d: the aggregator at %s serves again; calls return to it",
                    seq, self.settings.switch)
        return True

    def declines(self, call: AllreduceCall) -> str | None:
        if self.unavailable:
            return self.unavailable
        if call.dtype not in FLOAT_DTYPES:
            return f"ina: dtype {call.dtype} is not a float"
        if call.op not in (Op.SUM, Op.AVERAGE):
            return f"ina: op {call.op.name} is not SUM or AVERAGE"
        if call.nbytes < self.settings.switch_min_bytes:
            return f"ina: below switch_min_bytes ({self.settings.switch_min_bytes})"
        return None

    def run(self, call: AllreduceCall, deadline: Deadline) -> HandOver | None:
        link, k = self.link, self.link.k
        source = call.recv if call.send is None else call.send
        # The input stays intact until the result is whole: the fallback may need it.
        wide = np.float32 if call.dtype == np.float16 else call.dtype
        x = source.astype(wide) if (call.send is None or wide != call.dtype) else source
        local, nonfinite = self.kernels.block_exponents(x, k, link.block)
        # The first window's exponents (G per chunk) are agreed here; the rest ride on
        # the results.
        first = min(link.slots * -(-k // link.block), local.size)
        proposal = np.empty(1 + first, np.int16)
        proposal[0] = nonfinite
        proposal[1:] = local[:first]
        agreed_first = np.empty_like(proposal)
        wait(self.comm.Iallreduce(proposal, agreed_first, MPI.MAX), deadline,
             lambda: f"all ranks to agree on the exponents of a {call.nbytes}-byte allreduce")
        if agreed_first[0]:
            return HandOver("ina: NaN or Inf in the input (exact path)", x)
        agreed = np.empty_like(local)
        agreed[:first] = agreed_first[1:]
        out = call.recv if wide == call.dtype else np.empty(call.recv.size, wide)
        bits = link.value_bits_for(call.value_bits)
        self.calls_by_width[bits] = self.calls_by_width.get(bits, 0) + 1
        result = link.stream(x, out, local, agreed, call.op is Op.AVERAGE,
                             self.settings.retransmit_timeout, self.settings.retransmit_min,
                             self.settings.retransmit_max,
                             self.settings.switch_silence,
                             max(0.0, deadline.expires - time.monotonic()), bits)
        # Every rank learns whether any rank failed (bounded: a dead peer never reports).
        # A bound of its own: a stream that ran out of the call's time must still reach
        # the vote on every rank, or one rank would give up while another hands over.
        mine = np.array([0 if result.ok else 1], np.int32)
        anyone = np.empty_like(mine)
        wait(self.comm.Iallreduce(mine, anyone, MPI.MAX), Deadline(self.settings.timeout),
             lambda: f"all ranks to report the outcome of a {call.nbytes}-byte allreduce "
                     f"through the aggregator (this rank: {result.reason})")
        if anyone[0]:
            here = ("" if result.ok else f"; here: {result.reason}, {result.missing.size} "
                    f"chunks never completed (first {result.missing[:8].tolist()})")
            self._lost(f"ina: aggregator failed mid-operation{here}", self._seq)
            return HandOver(self.unavailable, x)
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        return None


class _AnswerWatch:
    """Rank 0's probes of an aggregator's address while it is unavailable: a job-0 PROBE
    at each call, at most one per PROBE_INTERVAL seconds, answers read without waiting
    (so the call after the next probe's answer can rejoin)."""

    PROBE_INTERVAL = 0.001

    def __init__(self, address: tuple[str, int]):
        import socket

        self.address = address
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.probe = P.control_packet(0, 0, [P.CTRL_PROBE])
        self.sent_at = -float("inf")

    def answered(self) -> bool:
        """Whether an answer came since the last look; sends the next probe if due."""
        seen = False
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # ICMP port unreachable from an earlier probe: nobody there
                continue
            try:
                head, reply = P.read_control(data)
            except ValueError:
                continue
            wanted = P.FLAG_CONTROL | P.FLAG_RESULT
            if (head["flags"] & wanted == wanted and len(reply) >= 2
                    and reply[0] == P.CTRL_PROBE and reply[1] == 0):
                seen = True
        now = time.monotonic()
        if now - self.sent_at >= self.PROBE_INTERVAL:
            self.sent_at = now
            try:
                self.sock.sendto(self.probe, self.address)
            except OSError:
                pass  # unreachable now: the next probe tries again
        return seen

    def close(self) -> None:
        self.sock.close()


def _answers(address: str, timeout: float) -> bool:
    """Whether an aggregator answers a probe for job 0 at ``address`` within timeout."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return P.control_exchange(s, P.parse_address(address), 0, 0, [P.CTRL_PROBE],
                                      timeout, "probe") == 0
    except (AggregatorUnavailable, ValueError, OSError):
        return False
