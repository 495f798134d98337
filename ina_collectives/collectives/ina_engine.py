"""Allreduce computed by the aggregator ("the switch"): the INA engine.

It quantizes, streams through the workers' links (ina/link.py) and dequantizes; the
ranks agree on the first window's exponents first (in the chooser's agreement, or in a
round of its own) and, where the results cannot tell, on the outcome last. Its pieces,
one job each: ``aggregators`` (the links: joining, losing and regaining them),
``striping`` (how a call is split across several), ``outcome`` (the vote), ``recovery``
(a call that ended without one: the kept window and the rescue), ``repair`` (quorum
chunks a rank lost) and ``quorum`` (the mode). It never runs another engine itself:
NaN/Inf in the input or a failed aggregator give the call back to the chooser
(HandOver), which finishes it on the ring.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..errors import AgreementError, CollectiveTimeout, CommunicatorBroken
from ..ina.link import StreamResult, WorkerLink
from ..settings import Settings
from .aggregators import Aggregators
from .agreement import CallSignature, identity
from .engine import AllreduceCall, HandOver
from .ops import FLOAT_DTYPES, Op, dtype_code
from .outcome import vote
from .quorum import Quorum
from .recovery import CLEAN, FAILED, NAN_OR_INF, OPENING, Kept, rescue
from .repair import repair_share
from .striping import Shares
from .waiting import Deadline, wait

log = logging.getLogger("ina_collectives")
NONFINITE = "ina: NaN or Inf in the input (exact path)"


@dataclass
class Prepared:
    """A switch call made ready for its exponent round (InaEngine.prepare)."""

    x: np.ndarray                       # the input, in the dtype reduced in
    wide: type                          # that dtype
    k: int                              # values per chunk
    g: int                              # sub-blocks per chunk
    parts: list[tuple[int, int, int]]   # (aggregator, first chunk, end chunk) per share
    ready: list[int]                    # per share, the chunks whose exponents are agreed
    windows: list[tuple[int, int]]      # their places in ``local``
    local: np.ndarray                   # this rank's exponents (filled in as streamed)
    proposal: np.ndarray                # [NaN or Inf seen, the windows' exponents], int16
    quorum: bool                        # made for a quorum call (every chunk's window)


@dataclass
class Opened:
    """How a call's opening ended (InaEngine.open), alike on every rank: "agreed" (with
    ``window``, the max of every rank's proposal, for a switch call), "mismatch" (the
    ranks called differently), "restart" (an opening failed and nothing is lost: every
    rank chooses the call's engine again) or "to_ring" (an opening failed while a rank
    was already streaming the call: every rank takes it to the ring)."""

    outcome: str
    window: np.ndarray | None = None
    reason: str = ""


class InaEngine:
    """Allreduce computed by the aggregator ("the switch"), or by several (INA_SWITCH
    names them comma-separated): each call is then striped across the serving ones in
    contiguous shares of chunks that follow each one's measured throughput, each share
    streamed in a thread of its own (docs/striping.md). Collective to construct (see
    ``Aggregators``)."""

    name = "ina"
    # Seconds a cancelled stream may take to end (it looks every 20 ms).
    CANCEL_BOUND = 5.0

    def __init__(self, comm: MPI.Intracomm, settings: Settings):
        from ..ina import kernels

        self.comm, self.settings = comm, settings
        self.kernels = kernels
        self.totals: dict[str, float] = {}  # the links' counters, over reconnections
        self.calls_by_width: dict[int, int] = {}  # calls served, by value bits
        self.striped_calls = self.partial_handovers = 0
        self._threads: ThreadPoolExecutor | None = None
        self.quorum = Quorum(comm.Get_size(), comm.Get_rank(), settings.quorum,
                             settings.quorum_max_skips)
        self.aggregators = Aggregators(comm, settings, kernels)
        self.shares = Shares(len(self.aggregators.addresses))
        # The owner's gate (see recovery.py): posts this rank's TROUBLE row in the
        # collective every rank makes next on the communicator, naming the call; None
        # while the next collective is not a gate (then calls end with a vote).
        self.gate: Callable[[str], None] | None = None
        self.kept: Kept | None = None      # the last window of the last vote-free call
        self.vote_free_calls = self.rescued_calls = 0
        self.opened_calls = self.failed_openings = 0

    # -- the aggregators, as the chooser and stats see them ---------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why no aggregator serves (None while one does)."""
        return self.aggregators.unavailable

    @property
    def link(self) -> WorkerLink | None:
        return self.aggregators.link

    def serving(self) -> list[int]:
        return self.aggregators.serving()

    def answers_again(self) -> int:
        return self.aggregators.answers_again()

    def at_call_boundary(self, seq: int, answers: int | None = None) -> None:
        self.aggregators.at_call_boundary(seq, answers)

    def close(self) -> None:
        self.aggregators.release()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    def switch_state(self) -> dict:
        """What stats()["switch"] reports: whether the aggregator serves, its outages and
        returns so far, and the wire format (``wire_format``)."""
        agg = self.aggregators
        return {"serving": agg.link is not None, "outages": agg.outages,
                "returns": agg.returns, **self.wire_format()}

    def wire_format(self) -> dict:
        """The packets this job sends: K values of ``value_bits`` bits per packet, one
        exponent per ``block`` of them; the aggregators and their shares
        (stats()["switch"])."""
        s, agg = self.settings, self.aggregators
        link = agg.link
        k = link.k if link is not None else s.switch_elements
        gso = link.send_state[0] if link is not None else s.switch_gso
        share_of = (dict(zip(agg.serving(), np.diff(self._shares(1 << 20)) / (1 << 20)))
                    if link is not None else {})
        return {"protocol": P.PROTOCOL_VERSION, "elements": k,
                "value_bits": s.switch_value_bits, "block": s.switch_block,
                "calls_by_value_bits": dict(self.calls_by_width),
                "send_path": "UDP_SEGMENT" if gso else "sendmmsg",
                "receive_path": ("UDP_GRO" if link is not None and link.gro
                                 else "recvmmsg"),
                "aggregators": [
                    {"address": agg.where(i), "serving": agg.links[i] is not None,
                     **({"slots": agg.links[i].slots,
                         "slots_asked": agg.links[i].asked_slots}
                        if agg.links[i] is not None else {}),
                     "share": round(float(share_of.get(i, 0.0)), 3),
                     "elements_per_second": float(self.shares.capacity[i]),
                     **({"why_not": agg.missing_reasons[i]}
                        if i in agg.missing_reasons else {})}
                    for i in range(len(agg.addresses))],
                "striped_calls": self.striped_calls,
                # sync calls through one aggregator that ended with no vote, and those
                # of them that a rank finished from a peer's kept window (recovery.py)
                "vote_free_calls": self.vote_free_calls,
                # calls (of any engine) the ranks agreed on through the switch, and
                # openings that failed (docs/protocol.md, A call's opening)
                "opened_calls": self.opened_calls,
                "failed_openings": self.failed_openings,
                "rescued_calls": self.rescued_calls,
                "partial_handovers": self.partial_handovers,
                "quorum": self.quorum.report()}


    # -- one call ---------------------------------------------------------------------

    def declines(self, call: AllreduceCall) -> str | None:
        return self.declines_kind(call.dtype, call.op, call.nbytes)

    def declines_kind(self, dtype: np.dtype, op: Op, nbytes: int) -> str | None:
        """Why a call of this dtype, op and size would not be served (None: it would)."""
        if self.unavailable:
            return self.unavailable
        if dtype not in FLOAT_DTYPES:
            return f"ina: dtype {dtype} is not a float"
        if op not in (Op.SUM, Op.AVERAGE):
            return f"ina: op {op.name} is not SUM or AVERAGE"
        if nbytes < self.settings.switch_min_bytes:
            return f"ina: below switch_min_bytes ({self.settings.switch_min_bytes})"
        return None

    def _shares(self, chunks: int) -> np.ndarray:
        return self.shares.split(self.serving(), chunks)

    def layout(self) -> tuple:
        """What a prepared call depends on: the serving aggregators and their formats."""
        links = self.aggregators.links
        return (self.unavailable, tuple((i, links[i].slots, links[i].k, links[i].block)
                                        for i in self.serving()))

    # The most int16 values a gate carries for a call's first window: 1,152 bytes a rank,
    # every first window of up to 575 sub-blocks (netsim's at MTU 9000: S 8 x G 70, at
    # MTU 1500 S 8 x G 11); a call with more makes its own exponent round.
    GATE_WINDOW = 576

    def window_size(self) -> int:
        """The int16 values every rank passes in the gate for a call's first window (the
        same on every rank between call boundaries, whatever each one's call): the most
        a ``Prepared.proposal`` may hold (one, then G exponents per slot of each serving
        aggregator), at most GATE_WINDOW; 0 while no aggregator serves."""
        if self.unavailable:
            return 0
        links = self.aggregators.links
        serving = self.serving()
        g = -(-links[serving[0]].k // links[serving[0]].block)
        return min(1 + g * sum(links[i].slots for i in serving), self.GATE_WINDOW)

    def prepare(self, call: AllreduceCall) -> Prepared:
        """What a call needs before its exponents are agreed: the input (widened), the
        shares, and this rank's proposal: [NaN or Inf seen in the first window, the
        first window's exponents of each share]. In a quorum call the window is every
        chunk: a result carries the proposals of the workers it counted only, and the
        values of one it left out would not fit them (docs/quorum.md)."""
        serving = self.serving()
        links = self.aggregators.links
        first_link = links[serving[0]]
        k, block = first_link.k, first_link.block
        source = call.recv if call.send is None else call.send
        # The input stays intact until the result is whole: the fallback may need it.
        wide = np.float32 if call.dtype == np.float16 else call.dtype
        x = source.astype(wide) if (call.send is None or wide != call.dtype) else source
        g = -(-k // block)
        chunks = -(-x.size // k)
        quorum = 0 < self.quorum.k < self.quorum.n
        edges = self._shares(chunks)
        parts = [(i, int(edges[j]), int(edges[j + 1])) for j, i in enumerate(serving)
                 if edges[j + 1] > edges[j]]
        ready = [c1 - c0 if quorum else min(links[i].slots, c1 - c0)
                 for i, c0, c1 in parts]
        # Each window's exponents in ``local``: G per chunk, but only as many of its last
        # chunk's as that chunk has sub-blocks (a small call proposes a few, not G).
        windows = [(c0 * g, c0 * g + (r - 1) * g
                    + -(-(min((c0 + r) * k, x.size) - (c0 + r - 1) * k) // block))
                   for (_, c0, _), r in zip(parts, ready)]
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
        return Prepared(x, wide, k, g, parts, ready, windows, local, proposal, quorum)

    # -- a call's opening (docs/protocol.md) ------------------------------------------

    def opens(self) -> bool:
        """Whether the next call opens through the aggregator: it can (``can_open``),
        and there is a gate to report trouble in (recovery.py)."""
        return self.gate is not None and self.can_open()

    def can_open(self) -> bool:
        """One aggregator named, and it serves and takes openings; sync mode."""
        agg = self.aggregators
        link = agg.link
        return (self.settings.switch_opening and len(agg.addresses) == 1
                and link is not None and link.opens
                and not 0 < self.quorum.k < self.quorum.n)

    def open(self, ident: int, prepared: Prepared | None, deadline: Deadline) -> Opened:
        """Collective through the switch (``opens()`` must hold, alike on every rank): the
        call's opening, numbered as the next switch call. ``ident``: the call's
        identity (agreement.identity); ``prepared``: a switch call's, whose first window
        of exponents (and whether it holds a NaN or an Inf) the opening agrees on; None
        for a call another engine serves. A rank whose opening fails takes the error path
        with the others (recovery.py) and marks the aggregator lost, as they do."""
        link = self.aggregators.link
        s = self.settings
        g = -(-link.k // link.block)
        # One packet per slot of the first window (one for a call of another engine): a
        # small call opens with one packet, as it streams with one.
        used = prepared.ready[0] if prepared is not None and prepared.parts else 1
        proposals = np.full((used, g), P.PROPOSAL_NONE, np.int16)
        span = 0
        if prepared is not None and prepared.parts:
            a, b = prepared.windows[0]
            span = b - a
            proposals.reshape(-1)[:span] = prepared.local[a:b]
            if prepared.proposal[0]:  # a NaN or an Inf in the first window
                proposals[0] = P.NONFINITE_MARK
        remaining = max(0.0, deadline.expires - time.monotonic())
        # Numbered as the next switch call will be: the switch orders a cell's uses by
        # call number (a quorum's late packets of earlier calls are dropped as late).
        seq = self.quorum.calls + 1
        outcome, counters = link.opening(ident, proposals, seq, s.retransmit_timeout,
                                         s.retransmit_min, s.retransmit_max,
                                         s.switch_silence, remaining)
        self._account(link, StreamResult(True, "", counters, np.zeros(0, np.int64)))
        if outcome == "mismatch":
            # The ranks may have opened different slots, some of which wait for packets
            # that never come: a new epoch leaves every cell idle (docs/protocol.md).
            self.aggregators.new_epoch()
            return Opened("mismatch")
        if outcome == "done":
            self.opened_calls += 1
            self.kept = None  # every rank is past its last call
            if prepared is None:
                return Opened("agreed")
            window = np.empty_like(prepared.proposal)
            window[0] = proposals[0, 0] == P.NONFINITE_MARK
            if span:
                window[1:] = proposals.reshape(-1)[:span]
            return Opened("agreed", window)
        self.failed_openings += 1
        agg = self.aggregators
        here = f"{agg.where(0)}: {outcome}"
        what = f"the opening of call #{self.aggregators.seq}"
        self.gate(f"{what}: {here}")
        got = rescue(self.comm, OPENING, -1, self.kept, None, s.timeout, what,
                     opening=self.quorum.calls + 1, seq=agg.seq)
        self.kept = None
        reason = (f"ina: the aggregator failed at the opening of a call on rank(s) "
                  f"{got.failed}; here: {here}")
        self.shares.forget(0)
        agg.lost([0], reason, got.seq)
        return Opened("to_ring" if got.to_ring else "restart", reason=reason)

    def run(self, call: AllreduceCall, deadline: Deadline, prepared: Prepared | None = None,
            agreed_first: np.ndarray | None = None) -> HandOver | None:
        """``prepared`` and ``agreed_first`` (the max of every rank's proposal): the
        caller agreed on the first window's exponents already (the chooser's gate or
        opening); else this opens the call through the switch (``opens``) or makes the
        exponent round by MPI itself."""
        if (prepared is None or agreed_first is None) and self.opens():
            prepared = self.prepare(call)
            opened = self.open(identity(CallSignature(
                CallSignature.ARRAYS, call.recv.size, dtype_code(call.dtype),
                list(Op).index(call.op), ""), call.value_bits), prepared, deadline)
            if opened.outcome == "mismatch":  # (the runtime's negotiation compared them)
                raise AgreementError(f"the switch saw the ranks' calls differ at a "
                                     f"{call.nbytes}-byte allreduce")
            if opened.outcome != "agreed":  # nothing moved: chosen again, or to the ring
                return HandOver(opened.reason, prepared.x,
                                rechoose=opened.outcome == "restart")
            agreed_first = opened.window
        if prepared is None or agreed_first is None:
            prepared = self.prepare(call)
            agreed_first = np.empty_like(prepared.proposal)
            wait(self.comm.Iallreduce(prepared.proposal, agreed_first, MPI.MAX), deadline,
                 lambda: f"all ranks to agree on the exponents of a {call.nbytes}-byte "
                         f"allreduce")
        links = self.aggregators.links
        x, wide, k, g = prepared.x, prepared.wide, prepared.k, prepared.g
        parts, ready, windows, local = (prepared.parts, prepared.ready, prepared.windows,
                                        prepared.local)
        call_number, quorum = self.quorum.next_call()
        # A sync call through one aggregator needs no vote when the caller's next
        # collective is a gate (recovery.py): its outcome is in the results.
        vote_free = self.gate is not None and not quorum and len(parts) == 1
        self.kept = None
        if agreed_first[0]:
            return HandOver(NONFINITE, x)
        agreed = np.empty_like(local)
        at = 1
        for a, b in windows:
            agreed[a:b] = agreed_first[at:at + b - a]
            at += b - a
        out = call.recv if wide == call.dtype else np.empty(call.recv.size, wide)
        widths = {links[i].value_bits_for(call.value_bits) for i, _, _ in parts}
        bits = widths.pop() if len(widths) == 1 else self.settings.switch_value_bits
        self.calls_by_width[bits] = self.calls_by_width.get(bits, 0) + 1
        self.striped_calls += len(parts) > 1
        results = self._stream_parts(parts, x, out, local, agreed, g, k,
                                     call.op is Op.AVERAGE, bits, deadline, call_number,
                                     quorum, ready)
        if vote_free:
            return self._finish_alone(call, parts[0], results[0], x, out, k)
        # Every rank learns, for each aggregator, whether any rank's share failed, the
        # longest any rank took for it (the throughput estimates: alike on every rank),
        # and the newest mode its results announced (a quorum asked by the control plane);
        # and whether any stream met a NaN or an Inf past the first window. A bound of its
        # own: a stream that ran out of the call's time must still reach the vote on
        # every rank, or one rank would give up while another hands over.
        agg = self.aggregators
        outcome = vote(self.comm, len(agg.addresses), [i for i, _, _ in parts], results,
                       self.settings.timeout,
                       f"a {call.nbytes}-byte allreduce through the aggregator")
        failed = [(i, c0, c1) for i, c0, c1 in parts if i in outcome.failed]
        nonfinite = outcome.nonfinite
        counted_all, counted_any = -1, 0
        for (i, _, _), result in zip(parts, results):
            if i not in outcome.failed:  # (a failed share is the ring's: all count)
                counted_all &= result.counted_all
                counted_any |= result.counted_any
            else:
                counted_any = -1
        # Chunks a lagging rank lost in a quorum (the switch moved their cells on): from
        # a peer that has them, else from the ring.
        ring_ranges: list[tuple[int, int]] = []
        for (i, c0, c1), result in zip(parts, results):
            if i in outcome.lost:
                ranges, repaired = repair_share(
                    self.comm, c0, c1, result.missing if result.ok else
                    np.zeros(0, np.int64), out, x.size, k, agg.collective)
                ring_ranges += ranges
                self.quorum.repaired += repaired
        self.quorum.after_call(counted_all, counted_any, outcome.mode,
                               sum(r.counters.get("left_out", 0) for r in results),
                               sum(r.counters.get("skipped", 0) for r in results))
        for i, c0, c1 in parts:
            seconds = outcome.seconds[i]
            if i not in outcome.failed and seconds > 0 and c1 - c0 >= 2:
                self.shares.measured(i, min(c1 * k, x.size) - c0 * k, seconds)
        if failed:
            here = "; ".join(
                f"{agg.where(i)}: {result.reason}, {result.missing.size} chunks never "
                f"completed (first {result.missing[:8].tolist()})"
                for (i, _, _), result in zip(parts, results) if not result.ok)
            reason = f"ina: aggregator failed mid-operation{'; here: ' + here if here else ''}"
            for i, _, _ in failed:
                self.shares.forget(i)
            agg.lost([i for i, _, _ in failed], reason, agg.seq)
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
            return self.aggregators.links[i].stream(x[a:b], out[a:b], local[c0 * g:c1 * g],
                                        agreed[c0 * g:c1 * g], average, s.retransmit_timeout,
                                        s.retransmit_min, s.retransmit_max, s.switch_silence,
                                        remaining, bits, cancel, call_number, quorum, ready)

        if not parts:  # an empty call
            return []
        if len(parts) > 1 and self._threads is None:
            self._threads = ThreadPoolExecutor(len(self.aggregators.addresses) - 1,
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
                        f"aggregator at {self.aggregators.where(i)}") from None
        except BaseException:
            cancel[0] = 1
            _, late = futures.wait(others, timeout=self.CANCEL_BOUND)
            if late:
                log.error("%d stream(s) of a striped call did not end within %g s of "
                          "being cancelled", len(late), self.CANCEL_BOUND)
            raise
        for (i, _, _), result in zip(parts, results):
            self._account(self.aggregators.links[i], result)
        return results

    def _account(self, link: WorkerLink, result: StreamResult) -> None:
        for name, value in result.counters.items():
            self.totals[name] = self.totals.get(name, 0) + value
        self.totals["srtt"], self.totals["rto"] = float(link.rtt[0]), float(link.rtt[2])

    # -- a call without a vote (recovery.py) ------------------------------------------

    def _finish_alone(self, call: AllreduceCall, part: tuple[int, int, int],
                      result: StreamResult, x: np.ndarray, out: np.ndarray, k: int
                      ) -> HandOver | None:
        """End a vote-free call: on this rank's own results when it holds them all and
        none said NaN or Inf (keeping the last window), else through the rescue."""
        i, c0, c1 = part
        agg = self.aggregators
        nonfinite = bool(result.counters.get("nonfinite_seen", 0))
        if result.ok and not nonfinite:
            self.quorum.after_call(result.counted_all, result.counted_any, result.mode,
                                   0, 0)
            # (No throughput estimate from this rank's own timing: the shares must be
            # alike on every rank, and only a vote makes them so.)
            if out is not call.recv:
                np.copyto(call.recv, out, casting="unsafe")
            start = max(c0, c1 - agg.links[i].slots) * k
            self.kept = Kept(self.quorum.calls, i, start, call.recv[start:].copy())
            self.vote_free_calls += 1
            return None
        what = f"switch call #{self.quorum.calls} ({call.nbytes} bytes)"
        role = FAILED if not result.ok else NAN_OR_INF
        here = (f"{agg.where(i)}: {result.reason}, {result.missing.size} chunks never "
                f"completed (first {result.missing[:8].tolist()})" if not result.ok
                else "a result said an input held a NaN or an Inf")
        self.gate(f"{what}: {here}")
        got = rescue(self.comm, role, self.quorum.calls, None, call.recv.dtype,
                     self.settings.timeout, what, seq=agg.seq)
        self.quorum.after_call(-1, -1, 0, 0, 0)
        if got.failed:
            self.shares.forget(i)
            agg.lost([i], f"ina: the aggregator failed mid-operation on rank(s) "
                          f"{got.failed}; here: {here}", got.seq)
        if got.to_ring:
            return HandOver(NONFINITE if nonfinite and not got.failed else
                            f"ina: aggregator failed mid-operation; here: {here}", x)
        # Another rank finished the call: every chunk this rank lacks lies in the last
        # window, which that rank kept (docs/protocol.md).
        first_missing = int(result.missing[0]) * k if result.missing.size else x.size
        if first_missing < got.start:
            raise CommunicatorBroken(
                f"{what}: this rank lacks element {first_missing} on, rank {got.holder} "
                f"kept only from {got.start}: the last-window rule does not hold")
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        call.recv[got.start:] = got.values
        self.rescued_calls += 1
        # Kept like any vote-free call's: if the others were at finalize, this rank's
        # finalize must make the gate they make again (Collectives.finish_calls).
        self.kept = Kept(self.quorum.calls, i, got.start, got.values)
        return None

    def help_rescue(self, what: str) -> None:
        """Collective with ranks that could not finish a call (a gate showed TROUBLE):
        this rank finished it, and sends or stands by with its kept window; then marks
        the aggregator lost as they do when a stream failed."""
        kept = self.kept
        got = rescue(self.comm, CLEAN, -1, kept, None, self.settings.timeout, what,
                     seq=self.aggregators.seq)
        self.kept = None
        if got.failed and kept is not None and self.aggregators.links[kept.aggregator]:
            self.shares.forget(kept.aggregator)
            self.aggregators.lost([kept.aggregator],
                                  f"ina: the aggregator failed mid-operation on rank(s) "
                                  f"{got.failed}", got.seq)
