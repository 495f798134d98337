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
    why). While it is unavailable, the chooser asks it to ``reconnect`` at call
    boundaries, after 1, 2, 4 ... calls (at most ``switch_retry_calls`` apart): a restarted
    switch serves again.
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
        self._retry_at: int | None = None  # the call number of the next reconnection
        self._retry_gap = 1
        self._seq = 0  # the number of the call under way (at_call_boundary)
        self._lasting = False  # the last failure was this job's setup: trying again is futile
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
        k = settings.switch_elements or P.MAX_ELEMENTS
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
                                       ports[rank] if settings.job else 0, epoch)
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

    def _collective(self, request: MPI.Request, what: str) -> None:
        wait(request, Deadline(self.settings.timeout),
             lambda: f"all {self.comm.Get_size()} ranks to exchange {what}")

    def close(self) -> None:
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

    def at_call_boundary(self, seq: int) -> None:
        """The chooser calls this before offering call number ``seq`` (the same number on
        every rank): when a reconnection is due, it happens here, on every rank alike."""
        self._seq = seq
        if self._retry_at is not None and self.link is None and seq >= self._retry_at:
            self._reconnect(seq)

    def _reconnect(self, seq: int) -> bool:
        """Collective: if rank 0 finds an aggregator answering at the address, every rank
        joins again (a new job and epoch, or the installed entry); True if it serves."""
        alive = np.zeros(1, np.int8)
        if self.comm.Get_rank() == 0:
            alive[0] = _answers(self.settings.switch,
                                min(0.5, self.settings.switch_join_timeout))
        self._collective(self.comm.Ibcast(alive, root=0), "whether the aggregator answers")
        if alive[0]:
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
        local, nonfinite = self.kernels.block_exponents(x, k)
        first = min(link.slots, local.size)
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
        result = link.stream(x, out, local, agreed, call.op is Op.AVERAGE,
                             self.settings.retransmit_timeout, self.settings.retransmit_min,
                             self.settings.retransmit_max,
                             self.settings.switch_silence,
                             max(0.0, deadline.expires - time.monotonic()))
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


def _answers(address: str, timeout: float) -> bool:
    """Whether an aggregator answers a probe for job 0 at ``address`` within timeout."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return P.control_exchange(s, P.parse_address(address), 0, 0, [P.CTRL_PROBE],
                                      timeout, "probe") == 0
    except (AggregatorUnavailable, ValueError, OSError):
        return False
