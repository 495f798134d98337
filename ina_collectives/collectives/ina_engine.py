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
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..errors import AggregatorUnavailable, CollectiveTimeout
from ..ina.link import StreamResult, WorkerLink
from ..settings import Settings
from .engine import AllreduceCall, HandOver
from .ops import FLOAT_DTYPES, Op
from .quorum import Quorum
from .waiting import Deadline, wait

log = logging.getLogger("ina_collectives")
REASON_BYTES = 512  # of the first failing rank's reason, sent to every rank
MAX_AGGREGATORS = 63  # one job's: a bit each in the int64 news of a call's agreement
NONFINITE = "ina: NaN or Inf in the input (exact path)"


class InaEngine:
    """Allreduce computed by the aggregator ("the switch"), or by several (INA_SWITCH
    names them comma-separated): each call is then striped across the serving ones in
    contiguous shares of chunks that follow each one's measured throughput, each share
    streamed in a thread of its own (docs/striping.md).

    Collective to construct: every rank joins the job at each aggregator (or, when a
    controller installed the job, settings.job, checks its entry with a probe) and the
    ranks agree; an aggregator that failed on any rank is used by none (``unavailable``
    says why when none serves). While one is missing, rank 0 probes its address without
    waiting (a datagram per call, _AnswerWatch) and its news rides on each call's
    agreement: the call after it answers again, every rank joins it again. A join that
    fails backs off: the next try waits 1, 2, 4 ... calls (at most
    ``switch_retry_calls``). With the agreement check off, rank 0 probes with a wait at
    those calls instead.
    """

    name = "ina"
    # Of a call's chunks, the share each serving aggregator gets at least, over the
    # number of them: a slow one keeps being measured, and so can win its share back.
    MIN_SHARE = 0.25
    # Weight of the newest throughput measurement in each aggregator's estimate.
    SMOOTHING = 0.5
    # Seconds a cancelled stream may take to end (it looks every 20 ms).
    CANCEL_BOUND = 5.0

    def __init__(self, comm: MPI.Intracomm, settings: Settings):
        from ..ina import kernels

        self.comm, self.settings = comm, settings
        self.kernels = kernels
        self.addresses: list[tuple[str, int]] = []
        self.links: list[WorkerLink | None] = []
        self.missing_reasons: dict[int, str] = {}  # aggregator index -> why it is not used
        # elements/s each aggregator reduced its share at, smoothed; 0: not measured yet
        self.capacity = np.zeros(0)
        self.unavailable: str | None = None
        self.totals: dict[str, float] = {}  # the links' counters, over reconnections
        self.outages = self.returns = 0
        self.calls_by_width: dict[int, int] = {}  # calls served, by value bits
        self.striped_calls = self.partial_handovers = 0
        self._retry_at: int | None = None  # the call number of the next reconnection
        self._retry_gap = 1
        # A link granted fewer slots than it asked for asks again from this call on
        # (every rank alike), backing off as reconnections do.
        self._grow_at: int | None = None
        self._grow_gap = 1
        self._seq = 0  # the number of the call under way (at_call_boundary)
        self._lasting = False  # the last failure was this job's setup: trying again is futile
        self._watch: _AnswerWatch | None = None  # rank 0's probes while one is missing
        self._threads: ThreadPoolExecutor | None = None
        self.quorum = Quorum(comm.Get_size(), comm.Get_rank(), settings.quorum,
                             settings.quorum_max_skips)
        if not settings.switch:
            self.unavailable = "ina: no aggregator configured (INA_SWITCH)"
            return
        try:
            self.addresses = P.parse_addresses(settings.switch)
            if len(self.addresses) > MAX_AGGREGATORS:
                raise ValueError(f"INA_SWITCH names {len(self.addresses)} aggregators; at "
                                 f"most {MAX_AGGREGATORS} (a bit each in rank 0's news)")
        except ValueError as exc:
            self.unavailable, self._lasting = f"ina: {exc}", True
            log.warning("%s; calls take the ring", self.unavailable)
            return
        if not settings.job:  # (an installed job's ports are per address as installed)
            self.addresses = self._with_shards(self.addresses)
        self.links = [None] * len(self.addresses)
        self.capacity = np.zeros(len(self.addresses))
        self._connect(list(range(len(self.addresses))))
        if self.missing():
            if self._lasting:
                log.warning("%s; calls take the ring", self.unavailable or self._why_missing())
            else:
                self._schedule(0)
                log.warning("%s; %s (tried again from call #%s on)",
                            self.unavailable or self._why_missing(),
                            "calls take the ring" if self.unavailable
                            else "calls use the other aggregators", self._retry_at)

    # -- the links ------------------------------------------------------------------------

    @property
    def link(self) -> WorkerLink | None:
        """The first serving link (None: no aggregator serves)."""
        return next((link for link in self.links if link is not None), None)

    def serving(self) -> list[int]:
        return [i for i, link in enumerate(self.links) if link is not None]

    def missing(self) -> list[int]:
        return [i for i, link in enumerate(self.links) if link is None]

    def _where(self, i: int) -> str:
        return "%s:%d" % self.addresses[i]

    def _why_missing(self) -> str:
        return "; ".join(f"{self._where(i)} not used: {why}"
                         for i, why in sorted(self.missing_reasons.items()))

    def _connect(self, indices: list[int]) -> None:
        """Every rank makes its links to the aggregators ``indices`` and joins (or probes
        its installed entry); collective. An aggregator that failed on any rank is left
        out on every rank, with the first failing rank's reason (``missing_reasons``);
        ``unavailable`` is set when none serves."""
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
        # An installed job names each rank's port at each aggregator: n per aggregator.
        wanted = n * len(self.addresses)
        if settings.job and error is None and len(ports) != wanted:
            error = (f"job {settings.job} was installed by a controller, but worker_ports "
                     f"(INA_WORKER_PORTS) names {len(ports)} ports for {n} ranks at "
                     f"{len(self.addresses)} aggregator(s): {wanted} are needed")
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
        errors: list[str | None] = [error] * len(indices)
        lasting_of = [lasting] * len(indices)
        for j, i in enumerate(indices):
            if error is not None:
                continue
            try:
                link = WorkerLink(self.addresses[i], job, rank, n, k, settings.switch_slots,
                                  ports[i * n + rank] if settings.job else 0, epoch, block,
                                  bits, settings.switch_gso)
                self.links[i] = link
                if settings.job:  # installed by a controller: worker id = rank
                    link.probe(settings.switch_join_timeout)
                else:
                    link.join(settings.switch_join_timeout)
            except AggregatorUnavailable as exc:  # the aggregator's doing: may pass
                errors[j], lasting_of[j] = str(exc), False
            except (ValueError, OSError) as exc:
                errors[j] = str(exc)
        # Every rank learns, for each aggregator, whether any rank failed (1: it did not
        # answer or refused; 2: this job's setup, which another try would not change) and
        # the first failing rank's reason.
        mine = np.array([0 if e is None else (1 if not lasting_of[j] else 2)
                         for j, e in enumerate(errors)], np.int8)
        flags = np.empty((n, len(indices)), np.int8)
        self._collective(comm.Iallgather(mine, flags),
                         "every rank's outcome of joining the aggregator")
        self._lasting = False
        for j, i in enumerate(indices):
            column = flags[:, j]
            if not column.any():
                self.missing_reasons.pop(i, None)
                continue
            self._lasting = self._lasting or bool((column == 2).any())
            r = int(np.flatnonzero(column)[0])
            text = np.zeros(REASON_BYTES, np.uint8)
            if rank == r:
                raw = str(errors[j]).encode()[:REASON_BYTES]
                text[:len(raw)] = np.frombuffer(raw, np.uint8)
            self._collective(comm.Ibcast(text, root=r), f"rank {r}'s reason")
            self.missing_reasons[i] = text.tobytes().rstrip(b"\0").decode(errors="replace")
            self._close_link(i)
        short = [i for i in indices if self.links[i] is not None
                 and self.links[i].slots < self.links[i].asked_slots]
        for i in short:
            log.warning("the aggregator at %s granted %d of the %d slots asked (its pool is "
                        "shared with other jobs); more are asked for when it has them free",
                        self._where(i), self.links[i].slots, self.links[i].asked_slots)
        if short and self._grow_at is None and settings.switch_retry_calls:
            self._grow_at = self._seq + self._grow_gap
        if self.serving():
            self.unavailable = None
        else:
            first = min(self.missing_reasons)
            r = int(np.flatnonzero(flags[:, indices.index(first)])[0]) if first in indices \
                else 0
            self.unavailable = (f"ina: aggregator unavailable (rank {r}: "
                                f"{self.missing_reasons[first]})")
            self.close()

    def _with_shards(self, addresses: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Collective: every shard of the switches named (rank 0 asks each address with a
        PROBE of job 0; a switch of several shards lists their ports, CAP_SHARDS), in
        order, each once: INA_SWITCH may name one port of ``ina-switch --threads N``."""
        text = np.zeros(4096, np.uint8)
        if self.comm.Get_rank() == 0:
            found: list[tuple[str, int]] = []
            wait_each = min(0.5, self.settings.switch_join_timeout)
            for host, port in addresses:
                ports = _shard_ports((host, port), wait_each) or (port,)
                found += [(host, p) for p in ports if (host, p) not in found]
            raw = P.address_list_text(found).encode()
            if len(raw) <= text.size:
                text[:len(raw)] = np.frombuffer(raw, np.uint8)
        self._collective(self.comm.Ibcast(text, root=0), "the aggregators' shards")
        listed = text.tobytes().rstrip(b"\0").decode()
        if not listed or listed.count(",") >= MAX_AGGREGATORS:
            return addresses
        expanded = [(host, int(port)) for host, _, port in
                    (part.rpartition(":") for part in listed.split(","))]
        if len(expanded) > len(addresses):
            log.info("the aggregators at %s have %d shards: calls stripe across %s",
                     P.address_list_text(addresses), len(expanded), listed)
        return expanded

    def switch_state(self) -> dict:
        """What stats()["switch"] reports: whether the aggregator serves, its outages and
        returns so far, and the wire format (``wire_format``)."""
        return {"serving": self.link is not None, "outages": self.outages,
                "returns": self.returns, **self.wire_format()}

    def wire_format(self) -> dict:
        """The packets this job sends: K values of ``value_bits`` bits per packet, one
        exponent per ``block`` of them; the aggregators and their shares
        (stats()["switch"])."""
        s = self.settings
        link = self.link
        k = link.k if link is not None else s.switch_elements
        gso = link.send_state[0] if link is not None else s.switch_gso
        share_of = (dict(zip(self.serving(), np.diff(self._shares(1 << 20)) / (1 << 20)))
                    if link is not None else {})
        return {"protocol": P.PROTOCOL_VERSION, "elements": k,
                "value_bits": s.switch_value_bits, "block": s.switch_block,
                "calls_by_value_bits": dict(self.calls_by_width),
                "send_path": "UDP_SEGMENT" if gso else "sendmmsg",
                "receive_path": ("UDP_GRO" if link is not None and link.gro
                                 else "recvmmsg"),
                "aggregators": [
                    {"address": self._where(i), "serving": self.links[i] is not None,
                     **({"slots": self.links[i].slots,
                         "slots_asked": self.links[i].asked_slots}
                        if self.links[i] is not None else {}),
                     "share": round(float(share_of.get(i, 0.0)), 3),
                     "elements_per_second": float(self.capacity[i]),
                     **({"why_not": self.missing_reasons[i]}
                        if i in self.missing_reasons else {})}
                    for i in range(len(self.addresses))],
                "striped_calls": self.striped_calls,
                "partial_handovers": self.partial_handovers,
                "quorum": self.quorum.report()}

    def _collective(self, request: MPI.Request, what: str) -> None:
        wait(request, Deadline(self.settings.timeout),
             lambda: f"all {self.comm.Get_size()} ranks to exchange {what}")

    def _close_link(self, i: int) -> None:
        link, self.links[i] = self.links[i], None
        if link is not None:
            link.leave()
            link.close()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for i in range(len(self.links)):
            self._close_link(i)
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    # -- leaving aggregators and coming back ----------------------------------------------

    def _lost(self, indices: list[int], reason: str, seq: int) -> None:
        """Aggregators failed mid-call (on every rank alike): the others serve on, or
        calls take the ring until one is back."""
        for i in indices:
            self.missing_reasons[i] = reason
            self._close_link(i)
            self.capacity[i] = 0.0
        self._retry_gap = 1
        self._schedule(seq)
        if self.serving():
            log.warning("%s; %s not used from now on, calls use the others; tried again "
                        "from call #%d on", reason,
                        ", ".join(self._where(i) for i in indices), self._retry_at)
            return
        self.unavailable = reason
        self.outages += 1
        self.close()
        log.warning("%s; calls take the ring, and the aggregator is tried again from call "
                    "#%d on", reason, self._retry_at)

    def _schedule(self, seq: int) -> None:
        cap = self.settings.switch_retry_calls
        self._retry_at = seq + self._retry_gap if cap else None
        self._retry_gap = min(2 * self._retry_gap, max(cap, 1))

    def answers_again(self) -> int:
        """Rank 0's news for the next call's agreement: a bit per missing aggregator (its
        index) that answered one of its probes since the last call (it may serve again),
        else 0. While one is missing (and tried again), rank 0 sends a probe now and then
        and reads the answers without waiting."""
        missing = self.missing()
        if not missing or self._retry_at is None or self.comm.Get_rank() != 0:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            return 0
        if self._watch is None or self._watch.indices != missing:
            if self._watch is not None:
                self._watch.close()
            self._watch = _AnswerWatch([self.addresses[i] for i in missing], missing)
        return int(self._watch.answered())

    def at_call_boundary(self, seq: int, answers: int | None = None) -> None:
        """The chooser calls this before offering call number ``seq`` (the same number on
        every rank), with rank 0's news (``answers_again``; None when the agreement check
        is off): when a reconnection is due, it happens here, on every rank alike."""
        self._seq = seq
        if self._grow_at is not None and seq >= self._grow_at and self.serving():
            self._grow(seq)
        if self._retry_at is None or not self.missing() or seq < self._retry_at:
            return
        if answers is None:
            self._reconnect(seq)
        elif answers:
            self._reconnect(seq, alive=answers)

    def _reconnect(self, seq: int, alive: int | None = None) -> bool:
        """Collective: the missing aggregators that answer (``alive``, a bit per index, or
        None: rank 0 probes now and tells the others) are joined again by every rank (a
        new job and epoch, or the installed entry); True if one came back."""
        missing = self.missing()
        if alive is None:
            answer = np.zeros(1, np.int64)
            if self.comm.Get_rank() == 0:
                wait_each = min(0.5, self.settings.switch_join_timeout)
                answer[0] = sum(1 << i for i in missing
                                if _answers(self._where(i), wait_each))
            self._collective(self.comm.Ibcast(answer, root=0),
                             "whether the aggregator answers")
            alive = int(answer[0])
        back = [i for i in missing if alive >> i & 1]
        if back:
            was_serving = bool(self.serving())
            if not was_serving:
                self.unavailable = None
            self._connect(back)
            if not was_serving and self.link is not None:
                self.returns += 1
        returned = [i for i in back if self.links[i] is not None]
        if not returned:
            if self._lasting:
                self._retry_at = None
                log.warning("call #%d: %s; not tried again", seq,
                            self.unavailable or self._why_missing())
                return False
            self._schedule(seq)
            log.info("call #%d: the aggregator is still unavailable; next try at call #%d",
                     seq, self._retry_at if self._retry_at is not None else -1)
            return False
        if self.missing():
            self._schedule(seq)
        else:
            self._retry_at, self._retry_gap = None, 1
        log.warning("call #%d: the aggregator at %s serves again; calls return to it",
                    seq, ", ".join(self._where(i) for i in returned))
        return True

    def _grow(self, seq: int) -> None:
        """Collective: rank 0 asks each aggregator that granted fewer slots than asked
        how many it has free (a PROBE of job 0); where some are, every rank leaves that
        aggregator and joins it again, to be granted what is free now."""
        short = [i for i in self.serving() if self.links[i].slots < self.links[i].asked_slots]
        self._grow_at = None
        if not short:
            return
        free = np.zeros(len(short), np.int64)
        if self.comm.Get_rank() == 0:
            wait_each = min(0.5, self.settings.switch_join_timeout)
            free[:] = [_free_slots(self.addresses[i], wait_each) for i in short]
        self._collective(self.comm.Ibcast(free, root=0), "the aggregators' free slots")
        regrow = [i for i, f in zip(short, free) if f > 0]
        for i in regrow:
            self._close_link(i)
        if regrow:  # every rank has left (the job's slots are free) before any joins again
            self._collective(self.comm.Ibarrier(), "every rank to leave the aggregator")
            self._connect(regrow)
            if not self.serving():
                self._lost([], self.unavailable or "ina: the aggregator refused the job",
                           seq)
                return
        if any(self.links[i] is not None and self.links[i].slots < self.links[i].asked_slots
               for i in short):
            cap = max(self.settings.switch_retry_calls, 1)
            self._grow_gap = min(2 * self._grow_gap, cap)
            self._grow_at = seq + self._grow_gap
        else:
            self._grow_gap = 1
            log.warning("call #%d: every aggregator grants the slots asked now", seq)

    # -- one call ---------------------------------------------------------------------

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

    def _shares(self, chunks: int) -> np.ndarray:
        """Chunk boundaries of the serving aggregators' shares of ``chunks`` chunks (one
        more than there are serving ones): contiguous, in proportion to each one's
        measured throughput, at least MIN_SHARE of an equal share each. Computed from
        values every rank holds alike, so every rank splits alike."""
        serving = self.serving()
        measured = self.capacity[serving]
        known = measured[measured > 0]
        weights = np.where(measured > 0, measured, known.mean() if known.size else 1.0)
        weights = weights / weights.sum()
        weights = np.maximum(weights, self.MIN_SHARE / len(serving))
        edges = np.concatenate([[0.0], np.cumsum(weights / weights.sum())])
        return np.round(edges * chunks).astype(np.int64)

    def run(self, call: AllreduceCall, deadline: Deadline) -> HandOver | None:
        serving = self.serving()
        first_link = self.links[serving[0]]
        k, block = first_link.k, first_link.block
        source = call.recv if call.send is None else call.send
        # The input stays intact until the result is whole: the fallback may need it.
        wide = np.float32 if call.dtype == np.float16 else call.dtype
        x = source.astype(wide) if (call.send is None or wide != call.dtype) else source
        g = -(-k // block)
        chunks = -(-x.size // k)
        call_number, quorum = self.quorum.next_call()
        edges = self._shares(chunks)
        parts = [(i, int(edges[j]), int(edges[j + 1])) for j, i in enumerate(serving)
                 if edges[j + 1] > edges[j]]
        # The first window of each share (G exponents per chunk) is agreed here; the rest
        # ride on the results. In a quorum call every chunk's are agreed here: a result
        # carries the proposals of the workers it counted only, and the values of one it
        # left out would not fit them (docs/quorum.md).
        ready = [c1 - c0 if quorum else min(self.links[i].slots, c1 - c0)
                 for i, c0, c1 in parts]
        windows = [(c0 * g, (c0 + r) * g) for (_, c0, _), r in zip(parts, ready)]
        # Only those chunks' own exponents are computed before the stream: the streams
        # compute the rest as they go, while they wait on the network (a pass over the
        # whole tensor here was the largest cost of a call outside its stream).
        local = np.empty(chunks * g, np.int16)
        nonfinite = False
        for (_, c0, _), r in zip(parts, ready):
            local[c0 * g:(c0 + r) * g], bad = self.kernels.block_exponents(
                x[c0 * k:min((c0 + r) * k, x.size)], k, block)
            nonfinite |= bad
        proposal = np.concatenate([[nonfinite], *(local[a:b] for a, b in windows)]
                                  ).astype(np.int16)
        agreed_first = np.empty_like(proposal)
        wait(self.comm.Iallreduce(proposal, agreed_first, MPI.MAX), deadline,
             lambda: f"all ranks to agree on the exponents of a {call.nbytes}-byte allreduce")
        if agreed_first[0]:
            return HandOver(NONFINITE, x)
        agreed = np.empty_like(local)
        at = 1
        for a, b in windows:
            agreed[a:b] = agreed_first[at:at + b - a]
            at += b - a
        out = call.recv if wide == call.dtype else np.empty(call.recv.size, wide)
        widths = {self.links[i].value_bits_for(call.value_bits) for i, _, _ in parts}
        bits = widths.pop() if len(widths) == 1 else self.settings.switch_value_bits
        self.calls_by_width[bits] = self.calls_by_width.get(bits, 0) + 1
        self.striped_calls += len(parts) > 1
        results = self._stream_parts(parts, x, out, local, agreed, g, k,
                                     call.op is Op.AVERAGE, bits, deadline, call_number,
                                     quorum, ready)
        # Every rank learns, for each aggregator, whether any rank's share failed, the
        # longest any rank took for it (the throughput estimates: alike on every rank),
        # and the newest mode its results announced (a quorum asked by the control plane);
        # and whether any stream met a NaN or an Inf past the first window.
        # Bounded: a dead peer never reports. A bound of its own: a stream that ran out of
        # the call's time must still reach the vote on every rank, or one rank would give
        # up while another hands over.
        count = len(self.addresses)
        mine = np.zeros(4 * count + 1)
        for (i, _, _), result in zip(parts, results):
            mine[i] = 0 if result.ok else 1
            mine[count + i] = result.counters.get("seconds", 0.0)
            mine[2 * count + i] = result.mode  # generation << 8 | k: exact in a float64
            mine[3 * count + i] = bool(result.ok and result.missing.size)  # quorum: lost
            mine[4 * count] = max(mine[4 * count], result.counters.get("nonfinite", 0))
        votes = np.empty_like(mine)
        wait(self.comm.Iallreduce(mine, votes, MPI.MAX), Deadline(self.settings.timeout),
             lambda: f"all ranks to report the outcome of a {call.nbytes}-byte allreduce "
                     "through the aggregator (this rank: "
                     f"{'; '.join(r.reason for r in results) or 'nothing to stream'})")
        failed = [(i, c0, c1) for i, c0, c1 in parts if votes[i]]
        nonfinite = bool(votes[4 * count])
        counted_all, counted_any = -1, 0
        for (i, _, _), result in zip(parts, results):
            if not votes[i]:  # (a failed share is the ring's: every worker counts)
                counted_all &= result.counted_all
                counted_any |= result.counted_any
            else:
                counted_any = -1
        # Chunks a lagging rank lost in a quorum (the switch moved their cells on): from
        # a peer that has them, else from the ring.
        ring_ranges: list[tuple[int, int]] = []
        for (i, c0, c1), result in zip(parts, results):
            if votes[3 * count + i] and not votes[i]:
                ring_ranges += self._repair(c0, c1, result.missing if result.ok else
                                            np.zeros(0, np.int64), out, x.size, k)
        self.quorum.after_call(counted_all, counted_any,
                               int(votes[2 * count:3 * count].max(initial=0)),
                               sum(r.counters.get("left_out", 0) for r in results),
                               sum(r.counters.get("skipped", 0) for r in results))
        for i, c0, c1 in parts:
            seconds = votes[count + i]
            if not votes[i] and seconds > 0 and c1 - c0 >= 2:
                rate = (min(c1 * k, x.size) - c0 * k) / seconds
                old = self.capacity[i]
                self.capacity[i] = rate if old <= 0 else (
                    self.SMOOTHING * rate + (1 - self.SMOOTHING) * old)
        if failed:
            here = "; ".join(
                f"{self._where(i)}: {result.reason}, {result.missing.size} chunks never "
                f"completed (first {result.missing[:8].tolist()})"
                for (i, _, _), result in zip(parts, results) if not result.ok)
            reason = f"ina: aggregator failed mid-operation{'; here: ' + here if here else ''}"
            self._lost([i for i, _, _ in failed], reason, self._seq)
            if len(failed) == len(parts) or nonfinite:
                return HandOver(NONFINITE if nonfinite else reason, x)
            # The others' shares are done: only the failed shares take the ring.
            self.partial_handovers += 1
            if out is not call.recv:
                np.copyto(call.recv, out, casting="unsafe")
            return HandOver(reason, x, [(c0 * k, min(c1 * k, x.size))
                                        for _, c0, c1 in failed] + ring_ranges)
        if nonfinite:  # (the sums of those chunks are not the values')
            return HandOver(NONFINITE, x)
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        if ring_ranges:
            self.partial_handovers += 1
            return HandOver("ina: quorum chunks that no rank received whole", x, ring_ranges)
        return None

    def _repair(self, c0: int, c1: int, missing: np.ndarray, out: np.ndarray, size: int,
                k: int) -> list[tuple[int, int]]:
        """Collective, for a share (chunks c0 .. c1) some rank did not finish in a quorum
        call: the chunks any rank lacks (their results were gone from the switch) are
        sent to every rank by the lowest rank that has them all, so every rank holds the
        same bits. Returns the element ranges no rank has whole (for the ring)."""
        comm, rank, n = self.comm, self.comm.Get_rank(), self.comm.Get_size()
        marks = np.zeros(c1 - c0, np.uint8)
        marks[missing] = 1
        union = np.empty_like(marks)
        self._collective(comm.Iallreduce(marks, union, MPI.MAX), "the chunks lost")
        root = np.array([rank if not marks.any() else n], np.int64)
        lowest = np.empty_like(root)
        self._collective(comm.Iallreduce(root, lowest, MPI.MIN),
                         "which rank has every chunk")
        ranges = [((c0 + j) * k, min((c0 + j + 1) * k, size))
                  for j in np.flatnonzero(union).tolist()]
        if lowest[0] == n:
            return ranges
        total = sum(b - a for a, b in ranges)
        buf = (np.concatenate([out[a:b] for a, b in ranges]) if rank == lowest[0]
               else np.empty(total, out.dtype))
        self._collective(comm.Ibcast(buf, root=int(lowest[0])),
                         f"rank {lowest[0]}'s copy of {len(ranges)} chunks")
        at = 0
        for a, b in ranges:
            out[a:b] = buf[at:at + b - a]
            at += b - a
        self.quorum.repaired += len(ranges)
        return []

    def _stream_parts(self, parts: list[tuple[int, int, int]], x: np.ndarray,
                      out: np.ndarray, local: np.ndarray, agreed: np.ndarray, g: int, k: int,
                      average: bool, bits: int, deadline: Deadline, call_number: int = 0,
                      quorum: int = 0, ready: list[int] | None = None) -> list[StreamResult]:
        """Stream each share through its aggregator: the first in this thread, the others
        in threads of their own (the streams run without the GIL). Ctrl-C here cancels
        the others before it propagates. ready: per share, the chunks whose exponents
        ``local`` holds (None: all)."""
        s = self.settings
        remaining = max(0.0, deadline.expires - time.monotonic())
        cancel = np.zeros(1, np.uint8)

        def stream(part: tuple[int, int, int], ready: int = -1) -> StreamResult:
            i, c0, c1 = part
            a, b = c0 * k, min(c1 * k, x.size)
            return self.links[i].stream(x[a:b], out[a:b], local[c0 * g:c1 * g],
                                        agreed[c0 * g:c1 * g], average, s.retransmit_timeout,
                                        s.retransmit_min, s.retransmit_max, s.switch_silence,
                                        remaining, bits, cancel, call_number, quorum, ready)

        if not parts:  # an empty call
            return []
        if len(parts) > 1 and self._threads is None:
            self._threads = ThreadPoolExecutor(len(self.addresses) - 1,
                                               thread_name_prefix="ina-stripe")
        ready = ready or [-1] * len(parts)
        others = [self._threads.submit(stream, part, r)
                  for part, r in zip(parts[1:], ready[1:])]
        # Each stream ends by its own bounds (the call's deadline, the silence bound);
        # these bounds only back them up.
        bound = remaining + s.switch_silence + self.CANCEL_BOUND
        try:
            results = [stream(parts[0], ready[0])]
            for (i, _, _), future in zip(parts[1:], others):
                try:
                    results.append(future.result(timeout=bound))
                except futures.TimeoutError:
                    raise CollectiveTimeout(
                        f"waited {bound:g} s for the stream of a share through the "
                        f"aggregator at {self._where(i)}") from None
        except BaseException:
            cancel[0] = 1
            _, late = futures.wait(others, timeout=self.CANCEL_BOUND)
            if late:
                log.error("%d stream(s) of a striped call did not end within %g s of "
                          "being cancelled", len(late), self.CANCEL_BOUND)
            raise
        for (i, _, _), result in zip(parts, results):
            self._account(self.links[i], result)
        return results

    def _account(self, link: WorkerLink, result: StreamResult) -> None:
        for name, value in result.counters.items():
            self.totals[name] = self.totals.get(name, 0) + value
        self.totals["srtt"], self.totals["rto"] = float(link.rtt[0]), float(link.rtt[2])


class _AnswerWatch:
    """Rank 0's probes of the missing aggregators' addresses: a job-0 PROBE to each at
    each call, at most one per PROBE_INTERVAL seconds, answers read without waiting (so
    the call after the next probe's answer can rejoin). ``indices``: the aggregators'
    places in INA_SWITCH, the bits of ``answered``."""

    PROBE_INTERVAL = 0.001

    def __init__(self, addresses: list[tuple[str, int]], indices: list[int]):
        import socket

        self.addresses, self.indices = addresses, indices
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.probe = P.control_packet(0, 0, [P.CTRL_PROBE])
        self.sent_at = -float("inf")

    def answered(self) -> int:
        """A bit (its index) per aggregator that answered since the last look; sends the
        next probes if due."""
        seen = 0
        while True:
            try:
                data, source = self.sock.recvfrom(65536)
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
                    and reply[0] == P.CTRL_PROBE and reply[1] == 0
                    and source in self.addresses):
                seen |= 1 << self.indices[self.addresses.index(source)]
        now = time.monotonic()
        if now - self.sent_at >= self.PROBE_INTERVAL:
            self.sent_at = now
            for address in self.addresses:
                try:
                    self.sock.sendto(self.probe, address)
                except OSError:
                    pass  # unreachable now: the next probe tries again
        return seen

    def close(self) -> None:
        self.sock.close()


def _probe(address: tuple[str, int], timeout: float) -> P.ControlReply | None:
    """An aggregator's answer to a PROBE of job 0 (is anyone there? its free slots, its
    shards), or None if it does not answer within timeout."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            reply = P.control_request(s, address, 0, 0, [P.CTRL_PROBE], timeout, "probe")
    except (AggregatorUnavailable, ValueError, OSError):
        return None
    return reply if reply.status == 0 else None


def _free_slots(address: tuple[str, int], timeout: float) -> int:
    """The free slots an aggregator's pool has; 0 if it does not answer or say."""
    reply = _probe(address, timeout)
    return max(reply.slots, 0) if reply is not None else 0


def _shard_ports(address: tuple[str, int], timeout: float) -> tuple[int, ...]:
    """The ports of every shard of the switch at ``address``; () if it has one, does
    not answer or does not say."""
    reply = _probe(address, timeout)
    return reply.shard_ports if reply is not None else ()


def _answers(address: str, timeout: float) -> bool:
    """Whether an aggregator answers a probe for job 0 at ``address`` within timeout."""
    try:
        where = P.parse_address(address)
    except ValueError:
        return False
    return _probe(where, timeout) is not None
