"""Allreduce computed by the aggregator ("the switch"): the INA engine.

It quantizes, streams through the workers' links (ina/link.py) and dequantizes; the
ranks agree on the first window's exponents first (in the chooser's agreement, in the
call's opening through the switch, or in a round of its own) and, where the results
cannot tell, on the outcome last. This module only orders the steps; its pieces, one
job each: ``aggregators`` (the links: joining, losing and regaining them),
``preparing`` (a call made ready: its shares and its first window's proposal),
``opening`` (the call's identity and first exponents agreed in-band), ``prediction``
(a call that repeats one goes without an opening: its first window's exponents
predicted), ``striping`` (how
a call is split across several aggregators, and the shares streamed at once),
``outcome`` (the vote), ``rescue`` (a call that ended without one, or an opening that
failed: the kept window and the rescue), ``repair`` (quorum chunks a rank lost) and
``quorum`` (the mode). It never runs another engine itself:
NaN/Inf in the input or a failed aggregator give the call back to the chooser
(HandOver), which finishes it on the ring.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..collectives.engine import (
    AllreduceCall,
    Gated,
    GateOutcome,
    HandOver,
    HostGate,
    OffloadEngine,
)
from ..collectives.ops import FLOAT_DTYPES, Op
from ..collectives.recovery import ErrorPath
from ..collectives.waiting import Deadline, wait
from ..errors import AgreementError, CommunicatorBroken
from ..settings import Settings
from .aggregators import Aggregators
from .link import Queued, WorkerLink
from .opening import open_call
from .outcome import vote
from .plan import CallPlan, StreamPlan
from .prediction import Predictions
from .preparing import Prepared, Share, prepare, window_size
from .quorum import Quorum
from .repair import repair_share
from .rescue import Kept, Role, stand_by, take_part
from .striping import Shares, Streams
from .windows import WindowServer, fetch_window

if TYPE_CHECKING:
    from .._fast.transport import Result

NONFINITE = "ina: NaN or Inf in the input (exact path)"


class InaEngine(OffloadEngine):
    """Allreduce computed by the aggregator ("the switch"), or by several (INA_SWITCH
    names them comma-separated): each call is then striped across the serving ones in
    contiguous shares of chunks that follow each one's measured throughput, each share
    streamed in a thread of its own (docs/striping.md). Collective to construct (see
    ``Aggregators``), unless given its ``aggregators``: made already, for this ``comm``
    and ``settings`` (a test's, or one joined to in-process switches)."""

    name = "ina"

    def __init__(self, comm: MPI.Intracomm, settings: Settings, errors: ErrorPath,
                 aggregators: Aggregators | None = None):
        from . import kernels

        self.comm, self.settings = comm, settings
        self.kernels = kernels.select(settings.kernels)
        self.calls_by_width: dict[int, int] = {}  # calls served, by value bits
        self.striped_calls = self.partial_handovers = self.standby_takeovers = 0
        self.quorum = Quorum(comm.Get_size(), comm.Get_rank(), settings.quorum,
                             settings.quorum_max_steps)
        self.aggregators = (aggregators if aggregators is not None
                            else Aggregators(comm, settings, self.kernels))
        self.shares = Shares(len(self.aggregators.addresses), self.aggregators.tree_rates)
        self.streams = Streams(len(self.aggregators.addresses), settings,
                               self.aggregators.where)
        # The communicator's error path (collectives/recovery.py), the chooser's: whether
        # the next collective is a gate, and the last window of the last vote-free call
        # (rescue.py: Kept).
        self.errors = errors
        errors.set_rescue(self.help_rescue, settings.switch_silence)
        self.vote_free_calls = self.rescued_calls = 0
        # The kept windows served to the peers and asked of them (ina/windows.py): a rank
        # that lost results of a call a peer finished completes it from that peer's
        # window, without waiting for a gate the peer may never make.
        self.peer_completed_calls = 0
        self.windows, self.window_peers = self._serve_windows()
        self.opened_calls = self.failed_openings = 0
        # Calls that repeat one made before go without an opening (docs/protocol.md, One
        # round trip).
        self.predictions = Predictions(headroom=settings.switch_predict_headroom)
        self.predicted_calls = self.mismatched_predictions = 0
        self._learn = np.empty(0, np.int16)
        # The run of identified calls this engine ran last: its identity and length (a
        # call's place in it keys its prediction: alike on every rank, which run the
        # same calls).
        self._run: tuple[int, int] = (0, 0)
        # Calls back to back (docs/protocol.md): the call whose stream runs now, vote-free
        # (its identity and chunks: what ``adopt`` checks), and the call adopted during its
        # drain, which the chooser's next call is.
        self._running: tuple[int, int, Hashable] | None = None
        self._adopted: _Adopted | None = None
        self.adopted_calls = 0

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

    def news(self) -> int:
        """Non-zero when an aggregator this rank lost answers again."""
        return self.aggregators.answers_again()

    def at_call_boundary(self, seq: int, news: int | None = None) -> bool:
        layout = self.layout()
        self.aggregators.at_call_boundary(seq, news)
        return self.layout() == layout

    def close(self) -> None:
        self.aggregators.release()
        self.streams.close()
        self.windows.close()

    def _serve_windows(self) -> tuple[WindowServer, list[tuple[str, int]]]:
        """Collective: this rank's window server, and every other rank's address, in rank
        order (each rank's is the one it reaches its first aggregator from)."""
        server = WindowServer(lambda: self.errors.kept)
        host = "127.0.0.1"
        if self.aggregators.addresses:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.connect(self.aggregators.addresses[0])
                    host = probe.getsockname()[0]
            except OSError:
                pass
        n, me = self.comm.Get_size(), self.comm.Get_rank()
        rows = np.zeros((n, 2), np.int64)
        rows[me] = (int(ipaddress.IPv4Address(host)), server.port)
        try:
            wait(self.comm.Iallreduce(MPI.IN_PLACE, rows, op=MPI.SUM),
                 Deadline(self.settings.timeout),
                 lambda: "every rank's address for its kept windows")
        except BaseException:
            server.close()
            raise
        peers = [(str(ipaddress.IPv4Address(int(a))), int(p)) for a, p in rows]
        server.peers = {host for r, (host, _) in enumerate(peers) if r != me}
        return server, [peer for r, peer in enumerate(peers) if r != me]

    def report(self) -> dict[str, Any]:
        """stats()'s "kernels" (the quantization and packet kernels this engine runs:
        "fast", compiled, or "numpy", the reference), "transport" (the links' counters)
        and "switch" (without this engine: offload.ABSENT)."""
        return {"kernels": self.kernels.name, "transport": self.aggregators.counts(),
                "switch": self.switch_state()}

    def switch_state(self) -> dict:
        """What stats()["switch"] reports: whether the aggregator serves, its outages and
        returns so far, and the wire format (``wire_format``)."""
        agg = self.aggregators
        return {"configured": True, "serving": agg.link is not None, "outages": agg.outages,
                "returns": agg.returns, **({"tree": dict(agg.tree)} if agg.tree else {}),
                **self.wire_format()}

    def wire_format(self) -> dict:
        """The packets this job sends: K values of ``value_bits`` bits per packet, one
        exponent per ``block`` of them; the aggregators and their shares
        (stats()["switch"])."""
        s, agg = self.settings, self.aggregators
        link = agg.link
        k = link.k if link is not None else agg.elements or s.switch_elements
        gso = link.wire.gso if link is not None else s.switch_gso
        share_of = (dict(zip(agg.serving(), np.diff(self._shares(1 << 20)) / (1 << 20)))
                    if link is not None else {})
        return {"protocol": P.PROTOCOL_VERSION, "elements": k, "path_mtu": agg.path_mtu,
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
                     "outages": agg.lost_counts.get(i, 0),
                     "returns": agg.back_counts.get(i, 0),
                     **({"why_not": agg.missing_reasons[i]}
                        if i in agg.missing_reasons else {})}
                    for i in range(len(agg.addresses))],
                "striped_calls": self.striped_calls,
                # sync calls through one aggregator that ended with no vote, and those
                # of them that a rank finished from a peer's kept window (rescue.py)
                "vote_free_calls": self.vote_free_calls,
                # calls (of any engine) the ranks agreed on through the switch, and
                # openings that failed (docs/protocol.md, A call's opening)
                "opened_calls": self.opened_calls,
                "failed_openings": self.failed_openings,
                # calls whose first window went predicted, with no opening (docs/protocol.md,
                # One round trip), and those the switch said the ranks called differently
                "predicted_calls": self.predicted_calls,
                "mismatched_predictions": self.mismatched_predictions,
                # calls started in the last call's drain (docs/protocol.md, Calls back
                # to back)
                "adopted_calls": self.adopted_calls,
                "rescued_calls": self.rescued_calls,
                # vote-free calls whose lost results this rank took from a peer's kept
                # window (ina/windows.py), and the peers' requests it answered
                "peer_completed_calls": self.peer_completed_calls,
                "windows_served": self.windows.answered,
                "partial_handovers": self.partial_handovers,
                # failed shares a surviving aggregator streamed again (switch_standby)
                "standby_takeovers": self.standby_takeovers,
                "quorum": self.quorum.report()}


    # -- one call ---------------------------------------------------------------------

    def declines(self, call: AllreduceCall) -> str | None:
        if (call.present and call.op is Op.AVERAGE and not self.quorum.active()
                and call.divisor(self.quorum.n) < self.quorum.n):
            # (In sync an absent rank adds zeros and is counted: its caller asks for a
            # SUM and divides, as the Horovod runtime does.)
            return "ina: an AVERAGE some ranks are absent from, in sync mode"
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

    def window_size(self) -> int:
        """The int16 values every rank passes in the gate for a call's first window (the
        same on every rank between call boundaries, whatever each one's call; see
        preparing.window_size); 0 while no aggregator serves."""
        if self.unavailable:
            return 0
        return window_size(self.aggregators.links, self.serving())

    def prepare(self, call: AllreduceCall, width: int | None = None) -> Prepared | None:
        """The call made ready for its exponent agreement (preparing.prepare), split by
        the shares in force; with ``width`` (a gate of that many values), None where its
        proposal does not fit, or it is a quorum call (which agrees on every chunk's
        exponents itself). None for a call this engine declines."""
        if self._adopted is not None and self._adopted.call is call:
            return self._adopted.plan.prepared  # (made when it was adopted)
        if self.declines(call) is not None:
            return None
        prepared = prepare(call, self.aggregators.links, self.serving(), self._shares,
                           0 < self.quorum.k < self.quorum.n,
                           self.kernels)
        if width is not None and (prepared.quorum or prepared.proposal.size > width):
            return None
        return prepared

    # -- a call's opening (docs/protocol.md) ------------------------------------------

    def gates(self) -> bool:
        """Whether the next call opens through the aggregator: it can (``can_open``),
        and there is a gate to report trouble in (collectives/recovery.py)."""
        return self.errors.gated and self.can_open()

    def can_open(self) -> bool:
        """One aggregator named, and it serves and takes openings; sync mode."""
        agg = self.aggregators
        link = agg.link
        return (self.settings.switch_opening and len(agg.addresses) == 1
                and link is not None and link.opens
                and not 0 < self.quorum.k < self.quorum.n)

    def gate(self, ident: int, deadline: Deadline, gate: HostGate) -> Gated:
        """The gate of a call another engine serves, or of another collective: its
        opening through the switch (``opening``), its boundary first; NOT_HERE where the
        next call does not open through the switch (``gates``)."""
        self._check_adopted(None)
        if not self.gates():
            return Gated(GateOutcome.NOT_HERE)
        if not gate.boundary(0):
            return Gated(GateOutcome.RESTART)
        return self.opening(ident, None, deadline)

    def opening(self, ident: int, prepared: Prepared | None, deadline: Deadline) -> Gated:
        """Collective through the switch (``gates()`` must hold, alike on every rank): the
        call's opening, numbered as the next switch call. ``ident``: the call's
        identity (agreement.identity); ``prepared``: a switch call's, whose first window
        of exponents (and whether it holds a NaN or an Inf) the opening agrees on, and
        which learns from it (``predictions``); None for a call another engine serves. A
        rank whose opening fails takes the error path with the others (rescue.py) and
        marks the aggregator lost, as they do."""
        link = self.aggregators.link
        s = self.settings
        # Numbered as the next switch call will be: the switch orders a cell's uses by
        # call number (a quorum's late packets of earlier calls are dropped as late).
        outcome, window, result = open_call(link, ident, prepared,
                                            self.quorum.calls + 1, s, deadline)
        if outcome == "mismatch":
            # The ranks may have opened different slots, some of which wait for packets
            # that never come: a new epoch leaves every cell idle (docs/protocol.md).
            self.aggregators.new_epoch()
            self.predictions.clear()
            return Gated(GateOutcome.MISMATCH)
        if outcome == "done":
            self.opened_calls += 1
            self.errors.forget()  # every rank is past its last call
            if prepared is not None and window is not None and self._learns(prepared):
                self.predictions.learn(ident, self._shape(), window[1:],
                                       place=self._place(ident, prepared))
            return Gated(GateOutcome.AGREED, window)
        self.predictions.clear()
        self.failed_openings += 1
        agg = self.aggregators
        here = f"{agg.where(0)}: {outcome}"
        what = f"the opening of call #{self.aggregators.seq}"
        self.errors.report(f"{what}: {here}")
        got = take_part(self.errors, Role.OPENING, -1, what,
                        opening=self.quorum.calls + 1, seq=agg.seq,
                        switch_calls=self.quorum.calls)
        self.quorum.calls = got.switch_calls
        reason = (f"ina: the aggregator failed at the opening of a call on rank(s) "
                  f"{got.failed}; here: {here}")
        self.shares.forget(0)
        agg.lost([0], reason, got.seq)
        return Gated(GateOutcome.TO_FALLBACK if got.to_ring else GateOutcome.RESTART,
                     reason=reason)

    # -- predicted first windows (prediction.py) ---------------------------------------

    def _shape(self) -> tuple:
        """What a prediction is valid for besides the call: the links' layout, K, S and
        the epoch (a change of any is alike on every rank)."""
        link = self.aggregators.link
        return (self.layout(), link.k, link.slots, link.epoch)

    def _learns(self, prepared: Prepared) -> bool:
        """A sync call of one share through an aggregator that takes predicted windows,
        ended without a vote: its results say what the next such call predicts."""
        link = self.aggregators.link
        return (self.can_open() and link is not None and link.predicts
                and len(prepared.shares) == 1 and not prepared.quorum)

    def _predict(self, ident: int, prepared: Prepared) -> np.ndarray | None:
        """The predicted first window of this call (``ident``: its identity, the
        opening's), where it goes without an opening; None where it opens. Alike on
        every rank (``gates()`` holds)."""
        if (not prepared.shares or not self._learns(prepared)
                or not self.settings.switch_predict):
            return None
        return self.predictions.predict(ident, self._shape(), self._span(prepared),
                                        prepared.wide, self._place(ident, prepared))

    def _place(self, ident: int, prepared: Prepared) -> Hashable:
        """The call's place (Predictions): its caller's key where it has one, else its
        place in its run, how many identified calls of ``ident`` this engine ran just
        before it."""
        if prepared.key is not None:
            return prepared.key
        last, length = self._run
        return length if last == ident else 0

    @staticmethod
    def _span(prepared: Prepared) -> int:
        a, b = prepared.shares[0].window
        return b - a

    def run(self, call: AllreduceCall, deadline: Deadline, gate: HostGate | None = None
            ) -> HandOver | None:
        """One call through the switch: its gate (``_first_window``), the stream, its
        outcome. ``gate``: the chooser's part of the gate (the call boundary, the
        agreement by MPI); None where the caller compared the calls (the boundary made).
        The call ``adopt`` started in the last call's drain is finished where it left
        off (``_resume``)."""
        adopted = self._check_adopted(call)
        try:
            if adopted is not None:
                if gate is not None and not gate.boundary(0):
                    return HandOver("", adopted.plan.prepared.x, rechoose=True)
                return self._resume(adopted, call)
            first = self._first_window(call, deadline, gate)
            if isinstance(first, HandOver):
                return first
            return self._stream(call, deadline, *first)
        except BaseException:
            self._drop_adopted()
            raise

    def _check_adopted(self, call: AllreduceCall | None) -> _Adopted | None:
        """The call started in the last call's drain, where ``call`` is it; None where
        none was. Any other call, or another collective's gate (``call`` None), leaves
        the communicator broken: the call started is due."""
        adopted = self._adopted
        if adopted is None or (call is not None and adopted.call.same_as(call)):
            return adopted
        self._drop_adopted()
        what = (f"a {call.nbytes}-byte allreduce was run" if call is not None
                else "another collective's gate was made")
        raise CommunicatorBroken(f"{what} where the call started during the last one's "
                                 f"drain ({adopted.call.nbytes} bytes) was due")

    def _first_window(self, call: AllreduceCall, deadline: Deadline, gate: HostGate | None
                      ) -> tuple[Prepared, np.ndarray, int, np.ndarray | None] | HandOver:
        """The call's gate, written once: the call made ready and its first window's
        exponents agreed by every rank, with the identity it learns or predicts by (0:
        none) and its predicted exponents (None: agreed). Predicted where it repeats a
        call the switch served; else through an opening of its own where the switch
        takes them; else by MPI: in the chooser's agreement (``gate``) where the window
        fits it, or in a round of its own. A HandOver where nothing moved: ``rechoose``
        where the call starts over (the chooser's gate: without a reason where the
        layout changed), else to the fallback."""
        prepared = self.prepare(call)
        ident = call.ident
        if self.gates():
            predicted = self._predict(ident, prepared)
            if gate is not None and not gate.boundary(0):
                return HandOver("", prepared.x, rechoose=True)
            if predicted is not None:
                return prepared, _predicted_first(predicted), ident, predicted
            opened = self.opening(ident, prepared, deadline)
            if opened.outcome is GateOutcome.MISMATCH:
                if gate is None:  # (the runtime's negotiation compared the calls)
                    raise AgreementError(f"the switch saw the ranks' calls differ at a "
                                         f"{call.nbytes}-byte allreduce")
                return HandOver(opened.reason, prepared.x, rechoose=True, mismatch=True)
            if opened.outcome is not GateOutcome.AGREED:  # nothing moved: chosen again,
                return HandOver(opened.reason, prepared.x,  # or to the ring
                                rechoose=opened.outcome is GateOutcome.RESTART)
            learns = self._learns(prepared)
            return prepared, opened.window, ident if learns else 0, None
        if gate is not None:
            width = self.window_size()
            fits = not prepared.quorum and prepared.proposal.size <= width
            agreed = gate.agree(self.news(), prepared.proposal if fits else None, width)
            if agreed is None or not gate.boundary(agreed.news):
                return HandOver("", prepared.x, rechoose=True)  # (a rescue, a new layout)
            if fits:
                return prepared, agreed.window, 0, None
        agreed_first = np.empty_like(prepared.proposal)
        wait(self.comm.Iallreduce(prepared.proposal, agreed_first, MPI.MAX), deadline,
             lambda: f"all ranks to agree on the exponents of a {call.nbytes}-byte "
                     f"allreduce")
        return prepared, agreed_first, 0, None

    def _stream(self, call: AllreduceCall, deadline: Deadline, prepared: Prepared,
                agreed_first: np.ndarray, ident: int, predicted: np.ndarray | None
                ) -> HandOver | None:
        """The call streamed, its first window agreed (``_first_window``), and ended."""
        shape = self._shape() if ident else None
        place = self._place(ident, prepared)
        if ident:
            self._enter_run(ident)
        predicted = predicted is not None
        _, quorum = self._numbered(call)
        number = self.quorum.calls
        # A sync call through one aggregator needs no vote when the caller's next
        # collective is a gate (collectives/recovery.py): its outcome is in the results.
        vote_free = self.errors.gated and not quorum and len(prepared.shares) == 1
        if not predicted:  # (a predicted call is its own gate: kept until it ends)
            self.errors.forget()
        learn = None
        if ident and vote_free and not quorum:
            link = self.aggregators.links[prepared.shares[0].aggregator]
            learn = self._learn_buffer(2 * link.slots * prepared.g)
        if agreed_first[0]:
            return HandOver(NONFINITE, prepared.x)
        links, shares = self.aggregators.links, prepared.shares
        out = _output(call, prepared)
        if len(shares) == 1:
            bits = links[shares[0].aggregator].value_bits_for(call.value_bits)
        else:
            widths = {links[share.aggregator].value_bits_for(call.value_bits)
                      for share in shares}
            bits = widths.pop() if len(widths) == 1 else self.settings.switch_value_bits
        self.calls_by_width[bits] = self.calls_by_width.get(bits, 0) + 1
        self.striped_calls += len(shares) > 1
        # A vote-free call (sync, one share) may have the next call queued behind it, to
        # start in its drain: its stream pauses there while the next is learned
        # (``_drained``).
        if vote_free:
            self._running = (ident, shares[0].end - shares[0].first, place)
        # The call's plan, once: what every share's stream takes whole.
        plan = CallPlan(prepared, out, prepared.agreed(agreed_first), deadline,
                        call.op is Op.AVERAGE, bits, number, quorum,
                        ident if predicted else 0, learn,
                        predicted and bool(prepared.proposal[0]),
                        call.absent(self.quorum.rank) and bool(quorum))
        try:
            results = self.streams.run(links, plan,
                                       pause=vote_free and call.following is not None)
            if results and results[0] is None:
                results = [self._drained(links[shares[0].aggregator], call)]
        finally:
            self._running = None
            self._unstarted()
        self.predicted_calls += predicted
        if vote_free:
            return self._end_alone(call, plan, results[0], ident, shape, place, predicted)
        return self._finish_by_vote(call, prepared, out, results, bits, deadline)

    def _end_alone(self, call: AllreduceCall, plan: CallPlan, result: Result, ident: int,
                   shape: Any, place: Hashable, predicted: bool) -> HandOver | None:
        """A vote-free call's end (its ``plan``; ``ident``, the identity it was known by,
        predicted or not): a mismatch handed back, else ``_finish_alone``, and what its
        results teach learned."""
        prepared, out, learn, number = plan.prepared, plan.out, plan.learn, plan.number
        if result.reason == "mismatch":
            # Every rank got the mark; some ranks' packets may wait in cells the others
            # never use: a new epoch leaves every cell idle (as after a marked opening).
            self._drop_adopted()
            self.mismatched_predictions += 1
            self.quorum.call_not_made()
            self.aggregators.new_epoch()
            self.predictions.clear()
            return HandOver(f"ina: the switch saw the ranks' calls differ at a "
                            f"{call.nbytes}-byte allreduce", prepared.x, rechoose=True,
                            mismatch=True)
        handover = self._finish_alone(call, prepared.shares[0], result, prepared.x, out,
                                      prepared.k, number, predicted)
        if (learn is not None and handover is None and result.ok
                and self.aggregators.link is not None):
            span, half = self._span(prepared), learn.size // 2
            self.predictions.learn(ident, shape, learn[half:half + span], learn[:span],
                                   result.overflows > 0, place)
        elif learn is not None:
            self.predictions.clear()
        return handover

    # -- calls back to back (docs/protocol.md) -----------------------------------------

    def _drained(self, link: WorkerLink, call: AllreduceCall) -> Result:
        """The stream of ``call`` paused at its drain, its last window in flight: its
        caller's next call learned now (``call.following``) and, where this engine takes
        it (``_adopt``, as the call after this one: ``aggregators.seq``, this call's
        number, plus one), queued behind it, the link adopting it as it goes on; the
        stream's Result. Nothing here is called from the compiled loop: the stream
        returned, and goes on (``proceed``)."""
        try:
            after = call.following() if call.following is not None else None
            then = None
            if after is not None and self.declines(after) is None:
                then = self._adopt(after, self.prepare(after), after.ident,
                                   self.aggregators.seq + 1)
        except BaseException:
            link.abandon()  # (the paused stream given up: the error path follows)
            raise
        return link.proceed(then)

    def _unstarted(self) -> None:
        """A call queued behind the stream that just ended, which it did not adopt
        (the stream ended before its drain), given up as ``_drop_adopted`` gives one up."""
        link = self.aggregators.link
        if self._adopted is not None and (link is None or not link.adopted):
            self._drop_adopted()

    def _adopt(self, call: AllreduceCall, prepared: Prepared | None, ident: int,
               seq: int) -> Queued | None:
        """Queue ``call`` behind the running one, to start in its drain, where every rank
        that starts it only after the running call returned would make it the same: a
        predicted call of one share, sync, every rank present, predicted from nothing the
        running call's learning changes (an entry of its own place, or another identity),
        on a quiet call boundary (``seq``), with room in the table for what the running
        call learns (nothing evicted), that uses every slot the running call used (so
        that no rank can finish it unless every rank holds every result of the running
        call: the all-or-nothing rule). What the link takes (its plan, waits and deadline), or None
        (not queued); ``run`` of this very call finishes it."""
        running, link = self._running, self.aggregators.link
        if (running is None or self._adopted is not None or prepared is None
                or link is None or not self.settings.switch_back_to_back
                or not self.settings.switch_predict or call.present
                or prepared.quorum or self.quorum.generation or not self.gates()
                or not self._learns(prepared) or not self.aggregators.quiet_at(seq)
                or len(self.predictions) + 2 > self.predictions.size):
            return None
        share = prepared.shares[0]
        chunks = share.end - share.first
        if chunks < min(link.slots, running[1]):
            return None
        shape = self._shape()
        place = self._place(ident, prepared)
        if ident == running[0] and not self.predictions.apart(ident, shape, place,
                                                              running[2]):
            return None
        span = self._span(prepared)
        predicted = self.predictions.predict(ident, shape, span, prepared.wide, place,
                                             touch=False)
        if predicted is None:
            return None
        run_before = self._enter_run(ident)
        self._numbered(call)
        agreed = prepared.agreed(_predicted_first(predicted))
        out = _output(call, prepared)
        learn = np.full(2 * link.slots * prepared.g, P.PROPOSAL_NONE, np.int16)
        bits = link.value_bits_for(call.value_bits)
        timeout = self.settings.timeout
        plan = CallPlan(prepared, out, agreed, Deadline(timeout), call.op is Op.AVERAGE,
                        bits, self.quorum.calls, 0, ident, learn,
                        bool(prepared.proposal[0]))
        self._adopted = _Adopted(call, plan, ident, shape, place, run_before)
        return plan.stream(share), self.streams.timers, timeout

    def adopted(self) -> AllreduceCall | None:
        """The call queued behind the last one (``_adopt``) that no ``run`` finished yet
        (None: none)."""
        return self._adopted.call if self._adopted is not None else None

    def _enter_run(self, ident: int) -> tuple[int, int]:
        """An identified call of ``ident`` starts: the run of identities goes on or
        starts again (``_place``); the run as it was before."""
        before = last, length = self._run
        self._run = (ident, length + 1 if last == ident else 1)
        return before

    def _numbered(self, call: AllreduceCall) -> tuple[int, int]:
        """The switch call's number and quorum stamp (Quorum.next_call); sync where an
        aggregator has no quorum cells (a Tofino build: CAP_QUORUM)."""
        self.quorum.cells = all(link.quorum_cells for link in self.aggregators.links
                                if link is not None)
        return self.quorum.next_call(
            (call.recv.size, call.dtype.str, call.op, call.value_bits), call.present)

    def _resume(self, adopted: _Adopted, call: AllreduceCall) -> HandOver | None:
        """The adopted call run to its end (``call``: it, made again, with its own next
        call), and ended as any vote-free call."""
        self._adopted = None
        plan = adopted.plan
        prepared, bits = plan.prepared, plan.value_bits
        link = self.aggregators.link
        self.calls_by_width[bits] = self.calls_by_width.get(bits, 0) + 1
        self.adopted_calls += 1
        self._running = (adopted.ident, prepared.shares[0].end - prepared.shares[0].first,
                         adopted.place)
        try:
            result = link.resume(pause=call.following is not None)
            if result is None:
                result = self._drained(link, call)
        finally:
            self._running = None
            self._unstarted()
        self.predicted_calls += 1
        return self._end_alone(call, plan, result, adopted.ident, adopted.shape,
                               adopted.place, True)

    def _drop_adopted(self) -> None:
        """The adopted call given up on this rank (the running call did not end cleanly
        here): its stream dropped, its number and its place in the run given back. Its
        packets may wait in cells: the rescue that follows starts a new epoch."""
        adopted, self._adopted = self._adopted, None
        if adopted is None:
            return
        link = self.aggregators.link
        if link is not None:
            link.abandon()
        self.quorum.call_not_made()
        self._run = adopted.run_before

    def _learn_buffer(self, size: int) -> np.ndarray:
        """``size`` int16 PROPOSAL_NONE for a stream to fill in what its call teaches
        (one buffer, reused: ``Predictions.learn`` keeps copies)."""
        buffer = self._learn
        if buffer.size != size:
            buffer = self._learn = np.empty(size, np.int16)
        buffer.fill(P.PROPOSAL_NONE)
        return buffer

    def _finish_by_vote(self, call: AllreduceCall, prepared: Prepared, out: np.ndarray,
                        results: list[Result], bits: int, deadline: Deadline
                        ) -> HandOver | None:
        """End a call with the ranks' vote on its outcome: the estimates, the quorum's
        bookkeeping, lost quorum chunks repaired, failed shares taken over or handed to
        the ring."""
        x, k, parts = prepared.x, prepared.k, prepared.shares
        # Every rank learns, for each aggregator, whether any rank's share failed, the
        # longest any rank took for it (the throughput estimates: alike on every rank),
        # and the newest mode its results announced (a quorum asked by the control plane);
        # and whether any stream met a NaN or an Inf past the first window. A bound of its
        # own: a stream that ran out of the call's time must still reach the vote on
        # every rank, or one rank would give up while another hands over.
        agg = self.aggregators
        outcome = vote(self.comm, len(agg.addresses), [p.aggregator for p in parts],
                       results,
                       self.settings.timeout,
                       f"a {call.nbytes}-byte allreduce through the aggregator")
        failed = [p for p in parts if p.aggregator in outcome.failed]
        nonfinite = outcome.nonfinite
        counted_all, counted_any = -1, 0
        for share, result in zip(parts, results):
            if share.aggregator not in outcome.failed:  # (a failed share is the ring's: all count)
                counted_all &= result.counted_all
                counted_any |= result.counted_any
            else:
                counted_any = -1
        # Chunks a lagging rank lost in a quorum (the switch moved their cells on): from
        # a peer that has them, else from the ring.
        ring_ranges: list[tuple[int, int]] = []
        for share, result in zip(parts, results):
            if share.aggregator in outcome.lost:
                ranges, repaired = repair_share(
                    self.comm, share.first, share.end, result.missing if result.ok else
                    np.zeros(0, np.int64), out, x.size, k, agg.collective)
                ring_ranges += ranges
                self.quorum.repaired += repaired
        self.quorum.after_call(counted_all, counted_any, outcome.mode,
                               sum(r.left_out for r in results),
                               sum(r.skipped for r in results))
        for p in parts:
            seconds = outcome.seconds[p.aggregator]
            if p.aggregator not in outcome.failed and seconds > 0 and p.end - p.first >= 2:
                self.shares.measured(p.aggregator, min(p.end * k, x.size) - p.first * k,
                                     seconds)
        if failed:
            here = "; ".join(
                f"{agg.where(p.aggregator)}: {result.reason}, {result.missing.size} "
                f"chunks never completed (first {result.missing[:8].tolist()})"
                for p, result in zip(parts, results) if not result.ok)
            reason = f"ina: aggregator failed mid-operation{'; here: ' + here if here else ''}"
            for share in failed:
                self.shares.forget(share.aggregator)
            agg.lost([share.aggregator for share in failed], reason, agg.seq)
            if len(failed) == len(parts) or nonfinite:
                return HandOver(NONFINITE if nonfinite else reason, x)
            standby = [p.aggregator for p in parts
                       if p.aggregator not in outcome.failed
                       and agg.links[p.aggregator] is not None]
            if self.settings.switch_standby and standby and self._take_over(
                    call, failed, standby[0], x, out, k, bits, deadline):
                failed = []
        if failed:
            # The others' shares are done: only the failed shares take the ring.
            self.partial_handovers += 1
            if out is not call.recv:
                np.copyto(call.recv, out, casting="unsafe")
            return HandOver(reason, x, [(p.first * k, min(p.end * k, x.size))
                                        for p in failed] + ring_ranges)
        if nonfinite:  # (the sums of those chunks are not the values')
            return HandOver(NONFINITE, x)
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        if ring_ranges:
            self.partial_handovers += 1
            return HandOver("ina: quorum chunks that no rank received whole", x, ring_ranges)
        return None

    def _take_over(self, call: AllreduceCall, failed: list[Share],
                   standby: int, x: np.ndarray, out: np.ndarray, k: int, bits: int,
                   deadline: Deadline) -> bool:
        """Collective (every rank learned the same ``failed`` in the vote): stream the
        failed shares again, whole, through aggregator ``standby``, which already serves
        the job (MLfabric's replica instead of the ring). Their exponents are agreed by
        MPI first (this is the error path), each share is a call of its own to the
        switch (a new call number: its cells have served this call's own share), and a
        vote ends each. True when every rank holds every result; False (the standby
        failed too, or the input holds a NaN or an Inf) leaves the shares to the ring."""
        s, agg = self.settings, self.aggregators
        link = agg.links[standby]
        block = link.block
        ranges = [(p.first * k, min(p.end * k, x.size)) for p in failed]
        mine = [self.kernels.block_exponents(x[a:b], k, block) for a, b in ranges]
        proposal = np.concatenate([[any(bad for _, bad in mine)],
                                   *(e for e, _ in mine)]).astype(np.int16)
        agreed = np.empty_like(proposal)
        wait(self.comm.Iallreduce(proposal, agreed, MPI.MAX), deadline,
             lambda: f"all ranks to agree on the exponents of the shares the aggregator "
                     f"at {agg.where(standby)} takes over")
        if agreed[0]:
            return False
        at = 1
        for (a, b), (local, _) in zip(ranges, mine):
            theirs = agreed[at:at + local.size]
            at += local.size
            # (Sync, but for the ranks absent from the call: every chunk's exponents are
            # agreed here, as a quorum's are.)
            self.quorum.cells = link.quorum_cells
            call_number, quorum = self.quorum.next_call(None, call.present)
            remaining = max(0.0, deadline.expires - time.monotonic())
            result = link.stream(
                StreamPlan(x[a:b], out[a:b], local, theirs.copy(), call.op is Op.AVERAGE,
                           bits, call_number, quorum,
                           absent=call.absent(self.quorum.rank) and bool(quorum)),
                self.streams.timers, remaining)
            outcome = vote(self.comm, len(agg.addresses), [standby], [result], s.timeout,
                           f"the {b - a}-element share the aggregator at "
                           f"{agg.where(standby)} took over")
            self.quorum.after_call(result.counted_all, result.counted_any, outcome.mode,
                                   0, 0)
            if outcome.failed or outcome.lost or outcome.nonfinite:
                if outcome.failed:
                    self.shares.forget(standby)
                    agg.lost([standby], f"ina: the aggregator failed while it took over "
                                        f"another's share; here: {result.reason}", agg.seq)
                return False
        self.standby_takeovers += 1
        return True

    # -- a call without a vote (rescue.py) --------------------------------------------

    def _from_a_peer(self, call: AllreduceCall, share: Share, result: Result,
                     out: np.ndarray, k: int, number: int) -> bool:
        """The results this rank lacks of a vote-free call, from a peer that finished it
        (ina/windows.py), asked within the silence bound: True if had, the call then
        complete here as there (the same bits: the switch's results) and kept as any
        vote-free call's; False if no peer finished it (every rank is still in it)."""
        first_missing = int(result.missing[0]) * k if result.missing.size else 0
        got = fetch_window(self.window_peers, number, call.recv.dtype,
                           min(1.0, self.settings.switch_silence))
        if got is None:
            return False
        start, values, _ = got
        if first_missing < start or start + values.size != call.recv.size:
            return False  # (not this call's last window: the rescue decides)
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        call.recv[start:] = values
        self.aggregators.links[share.aggregator].settle(share.end - share.first)
        self.quorum.after_call(-1, -1, 0, 0, 0)
        self.errors.keep(Kept(number, share.aggregator, start, values), number)
        self.vote_free_calls += 1
        self.peer_completed_calls += 1
        return True

    def _finish_alone(self, call: AllreduceCall, share: Share, result: Result,
                      x: np.ndarray, out: np.ndarray, k: int, number: int,
                      predicted: bool = False) -> HandOver | None:
        """End a vote-free call: on this rank's own results when it holds them all and
        none said NaN or Inf (keeping the last window), else through the rescue. A
        ``predicted`` call that failed may have failed on every rank before any moved
        (then every rank chooses its engine again) or after one finished it
        (rescue.py, PREDICTED)."""
        i, c0, c1 = share.aggregator, share.first, share.end
        agg = self.aggregators
        nonfinite = result.nonfinite_seen
        if result.ok and not nonfinite:
            self.quorum.after_call(result.counted_all, result.counted_any, result.mode,
                                   0, 0)
            # (No throughput estimate from this rank's own timing: the shares must be
            # alike on every rank, and only a vote makes them so.)
            if out is not call.recv:
                np.copyto(call.recv, out, casting="unsafe")
            start = max(c0, c1 - agg.links[i].slots) * k
            self.errors.keep(Kept(number, i, start, call.recv[start:].copy()),
                             number)
            self.vote_free_calls += 1
            return None
        if (not result.ok and not predicted and self._adopted is None
                and self._from_a_peer(call, share, result, out, k, number)):
            return None
        self._drop_adopted()  # (before its rescue: this call's number is the last taken)
        what = f"switch call #{number} ({call.nbytes} bytes)"
        role = (Role.NAN_OR_INF if result.ok else Role.PREDICTED if predicted
                else Role.FAILED)
        here = (f"{agg.where(i)}: {result.reason}, {result.missing.size} chunks never "
                f"completed (first {result.missing[:8].tolist()})" if not result.ok
                else "a result said an input held a NaN or an Inf")
        self.errors.report(f"{what}: {here}", number)
        got = take_part(self.errors, role, number, what,
                        opening=number, seq=agg.seq, switch_calls=self.quorum.calls)
        self.quorum.calls = got.switch_calls
        self.predictions.clear()
        self.quorum.after_call(-1, -1, 0, 0, 0)
        if got.failed:
            self.shares.forget(i)
            agg.lost([i], f"ina: the aggregator failed mid-operation on rank(s) "
                          f"{got.failed}; here: {here}", got.seq)
        else:  # (a rank's adopted call may have left packets in cells: none used again)
            agg.new_epoch()
        if got.restart:  # (a predicted call no rank finished: nothing of it moved)
            return HandOver(f"ina: aggregator failed; here: {here}", x, rechoose=True)
        if got.to_ring:
            return HandOver(NONFINITE if nonfinite and not got.failed else
                            f"ina: aggregator failed mid-operation; here: {here}", x)
        # Another rank finished the call: every chunk this rank lacks lies in the last
        # window, which that rank kept (docs/protocol-recovery.md).
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
        self.errors.keep(Kept(number, i, got.start, got.values),
                         number)
        return None

    def help_rescue(self, what: str) -> None:
        """Collective with ranks that could not finish a call (a gate showed TROUBLE):
        this rank finished it, and sends or stands by with its kept window; then marks
        the aggregator lost as they do when a stream failed."""
        self._drop_adopted()
        got, kept = stand_by(self.errors, what, self.aggregators.seq, self.quorum.calls)
        self.quorum.calls = got.switch_calls
        self.predictions.clear()
        if got.failed and kept is not None and self.aggregators.links[kept.aggregator]:
            self.shares.forget(kept.aggregator)
            self.aggregators.lost([kept.aggregator],
                                  f"ina: the aggregator failed mid-operation on rank(s) "
                                  f"{got.failed}", got.seq)
        elif not got.failed:  # (as the ranks in trouble do: _finish_alone)
            self.aggregators.new_epoch()


@dataclass
class _Adopted:
    """A call ``InaEngine._adopt`` queued behind the running one: what its run finishes it with."""

    call: AllreduceCall
    plan: CallPlan           # its plan (its out: call.recv, or wider; its learn)
    ident: int
    shape: Any
    place: Hashable
    run_before: tuple[int, int]  # the engine's run of identities before it (dropped: back)


def _predicted_first(predicted: np.ndarray) -> np.ndarray:
    """A predicted call's first window as an agreement gives it: no NaN or Inf flag, then
    the predicted exponents."""
    first = np.zeros(1 + predicted.size, np.int16)
    first[1:] = predicted
    return first


def _output(call: AllreduceCall, prepared: Prepared) -> np.ndarray:
    """Where the streams write: the call's output, or a wider array it is copied from."""
    return (call.recv if prepared.wide == call.dtype
            else np.empty(call.recv.size, prepared.wide))
