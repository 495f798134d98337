"""The worker's link to the aggregator: its UDP socket, joining a job, streaming tensors.

Control exchanges (join, leave, probe) are rare and live here in Python, each with a
bounded wait (protocol.control_request); the data path is ``_fast/transport.pyx``'s
``Link``, one per WorkerLink (``wire``), which keeps the state that lasts across calls.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import protocol as P
from ..collectives.waiting import peer_failure, waiting_for
from ..errors import AggregatorUnavailable, SystemCallError
from ..protocol import control_request, enable_gro, sockaddr_be, status_text, udp_socket
from ..settings import Settings

if TYPE_CHECKING:
    from .._fast.transport import Result


@dataclass(frozen=True)
class StreamPlan:
    """One stream through one aggregator (``WorkerLink.stream`` says what each is): the
    input ``x`` into ``out``, this worker's exponents ``local`` and the agreed ones
    ``agreed`` (G per chunk); ``value_bits`` (0: the job's), the call's number ``call``
    (mod 65536), its ``quorum`` stamp (0: sync), ``ready`` (the chunks whose exponents
    ``local`` holds; -1: all), ``ident`` (nonzero: a predicted call), ``learn`` (where
    the next prediction's exponents go, or None), ``nonfinite`` (the ready chunks hold a
    NaN or an Inf) and ``absent`` (a quorum call this worker adds nothing to)."""
    x: np.ndarray
    out: np.ndarray
    local: np.ndarray
    agreed: np.ndarray
    average: bool = False
    value_bits: int = 0
    call: int = 0
    quorum: int = 0
    ready: int = -1
    ident: int = 0
    learn: np.ndarray | None = None
    nonfinite: bool = False
    absent: bool = False


@dataclass(frozen=True)
class Timers:
    """How long a stream or an opening waits, built once from Settings (``of``):
    ``first``, the retransmit timeout until a round trip is measured; ``least`` and
    ``most``, its bounds once it follows the measured ones (RFC 6298); ``silence``, how
    long the aggregator may stay silent before the link counts it gone."""

    first: float
    least: float
    most: float
    silence: float

    @classmethod
    def of(cls, settings: Settings) -> Timers:
        return cls(settings.retransmit_timeout, settings.retransmit_min,
                   settings.retransmit_max, settings.switch_silence)


# The next call queued behind a stream (WorkerLink.stream's ``then``): its plan, waits
# and deadline in seconds.
Queued = tuple[StreamPlan, Timers, float]


class WorkerLink:
    """One worker's UDP socket to the aggregator, for one job of ``fmt``'s
    (protocol.JobFormat), with ``slots`` in flight: joined by the worker itself
    (``join``), or installed by a controller at the socket's address (``port`` given)
    and checked with ``probe``. ``epoch``: this run's, the same on every worker
    (docs/protocol.md): the switch takes a cell last used in another epoch for idle.
    ``gso``: new packets may leave with UDP_SEGMENT, results come with UDP_GRO.
    ``members``: the job's workers at this aggregator where that is not fmt.n (a tree's
    leaf serves some of the ranks: ``worker`` is then this rank's place among them; the
    values are still scaled for fmt.n ranks)."""

    def __init__(self, switch: tuple[str, int], fmt: P.JobFormat, worker: int, slots: int,
                 port: int = 0, epoch: int = 0, gso: bool = True, members: int = 0):
        if not 0 <= epoch < 65536:
            raise ValueError(f"epoch {epoch} is not 0..65535")
        from .._fast import transport

        self.switch = switch
        self.format = fmt
        self._last_wait = (0, 0.0)  # (the last stream's call and silence bound: proceed's)
        self.job, self.n, self.k = fmt.job, fmt.n, fmt.k
        self.block, self.value_bits = fmt.block, fmt.value_bits
        self.worker = worker
        self.members = members or fmt.n
        self.asked_slots = slots
        self.reply_slots = -1  # the last control reply's slots value (control_request)
        self.narrow = False  # set by the join or probe reply
        self.capabilities = 0  # the join or probe reply's (CAP_*)
        self.sock = udp_socket("0.0.0.0", port)
        # Results may arrive coalesced (UDP_GRO): the stream splits them. Where the kernel
        # lacks it, one datagram per buffer, as before.
        self.gro = enable_gro(self.sock) if gso else False
        self.joined = False
        # The data path and its state across calls (_fast/transport.pyx: Link): each
        # slot's next version, the streams' and the openings' RTT estimates, the packet
        # numbers and whether the aggregator NACKs, whether new packets may leave with
        # UDP_SEGMENT (``wire.gso``: cleared for good if the kernel refuses the offload,
        # then sendmmsg), the window and its buffers.
        addr_be, port_be = sockaddr_be(switch)
        self._transport = transport
        self.wire = transport.Link(self.sock.fileno(), addr_be, port_be, fmt, worker, slots,
                                   epoch, gso)
        # While the aggregator holds this worker's packets for a late peer, the stream
        # waits on; ina-run's word that a rank failed ends it.
        self.wire.watch = peer_failure

    @property
    def slots(self) -> int:
        """The slots this worker uses (the aggregator may grant fewer than asked)."""
        return self.wire.slots

    @property
    def epoch(self) -> int:
        """This run's epoch, in every packet."""
        return self.wire.epoch

    def new_epoch(self, epoch: int) -> None:
        """A new epoch, every slot from version 0 again (Aggregators.new_epoch)."""
        self.wire.new_epoch(epoch)

    def close(self) -> None:
        self.sock.close()

    def _control(self, body: list[int], timeout: float, what: str) -> int:
        status, capabilities, self.reply_slots, _ = control_request(
            self.sock, self.switch, self.job, self.worker, body, timeout, what)
        # A call may ask for 16-bit values in a job of 32 (the aggregator says it takes them).
        self.capabilities = capabilities
        self.narrow = bool(capabilities & P.CAP_NARROW)
        if capabilities & P.CAP_NACKS:  # the stream may ask for results with headers alone
            self.wire.nacking = True
        return status

    def join(self, timeout: float) -> None:
        """Join the job; the aggregator may grant fewer slots than asked (its pool is
        shared): ``slots`` is then what it granted, ``asked_slots`` what was asked."""
        status = self._control([P.CTRL_JOIN, self.members, self.k, self.asked_slots,
                                self.block, self.value_bits], timeout, "join")
        if status != 0:
            reason = status_text(P.JOIN_STATUS, status)
            if status == P.JOIN_MTU:  # (the reply's 4th value: the switch's MTU)
                reason += f" ({self._mtu_advice(self.reply_slots)})"
            raise AggregatorUnavailable(
                f"the aggregator at {self.switch[0]}:{self.switch[1]} refused job {self.job} "
                f"(worker {self.worker} of {self.members}, K {self.k}, S {self.slots}, B "
                f"{self.block}, {self.value_bits}-bit values): {reason}")
        if 1 <= self.reply_slots < self.asked_slots:  # (a P4 switch's reply has no grant)
            self.wire.resize(self.reply_slots)
        self.joined = True

    def probe(self, timeout: float) -> None:
        """Check that a controller installed this worker of the job at this socket's
        address (a P4 switch answers only then; the software switch says why not)."""
        where = f"{self.switch[0]}:{self.switch[1]}"
        port = self.sock.getsockname()[1]
        try:
            status = self._control([P.CTRL_PROBE], timeout, "probe")
        except AggregatorUnavailable as exc:
            raise AggregatorUnavailable(
                f"{exc} (is job {self.job} installed for worker {self.worker} at UDP port "
                f"{port}? ina-run / ina_collectives.control install it)") from None
        if status != 0:
            reason = status_text(P.PROBE_STATUS, status)
            raise AggregatorUnavailable(
                f"the aggregator at {where} has no entry for worker {self.worker} of job "
                f"{self.job} at UDP port {port}: {reason}")

    def leave(self, timeout: float = 0.5) -> None:
        """Tell the aggregator this worker is done; best effort (it may be gone). A job a
        controller installed is the controller's to remove: nothing is sent."""
        if not self.joined:
            return
        try:
            self._control([P.CTRL_LEAVE], timeout, "leave")
        except AggregatorUnavailable:
            pass

    def value_bits_for(self, asked: int) -> int:
        """The width a call that asks for ``asked``-bit values (0: the job's) gets: 16 in
        a job of 32 only where the aggregator takes narrower calls (CAP_NARROW)."""
        if asked == 16 and (self.value_bits == 16 or self.narrow):
            return 16
        return self.value_bits

    @property
    def opens(self) -> bool:
        """Whether the aggregator takes a call's opening (CAP_OPEN): the ranks then agree
        on a call's identity and first exponents through it, with no host collective."""
        return bool(self.capabilities & P.CAP_OPEN)

    @property
    def quorum_cells(self) -> bool:
        """Whether the aggregator completes a chunk at a call's quorum (CAP_QUORUM): where
        it does not, the ranks stamp every call sync and quorum acts in the runtime only
        (docs/quorum.md)."""
        return bool(self.capabilities & P.CAP_QUORUM)

    @property
    def predicts(self) -> bool:
        """Whether the aggregator takes predicted first windows (CAP_PREDICT): a call that
        repeats one made before then needs no opening (docs/protocol.md, One round
        trip)."""
        return bool(self.capabilities & P.CAP_PREDICT)

    def opening(self, identity: int, proposals: np.ndarray, call: int, timers: Timers,
                deadline: float) -> Result:
        """A call's opening through the aggregator (docs/protocol.md): ``identity`` (48
        bits: what every rank must call alike) and ``proposals`` (S x G int16: the first
        exponents of each slot's first chunk, PROPOSAL_NONE for none), replaced by the
        max over the workers. Returns the Result, its ``reason`` "done", "mismatch" or
        why it failed."""
        result = self.wire.opening(proposals, identity & 0xFFFFFFFF,
                                   _int16((identity >> 32) & 0xFFFF), timers, deadline,
                                   call & 0xFFFF)
        result.reason = self._reason(result)
        return result

    def stream(self, plan: StreamPlan, timers: Timers, deadline: float,
               cancel: np.ndarray | None = None, then: Queued | None = None,
               pause: bool = False) -> Result | None:
        """One call's stream through the aggregator, ``plan`` (ina.link.StreamPlan): allreduce
        plan.x (float32/64, 1-D) into plan.out within ``deadline`` seconds, ``timers`` its
        waits. ``cancel``: a uint8 [0] another thread sets to 1 to end the stream. The
        counters are the caller's to add up (a job striped over several links streams
        them in threads). The plan's fields: ``local``, this worker's exponents, and
        ``agreed``, the agreed ones (G per chunk); value_bits: the call's width (0: the
        job's; see value_bits_for); call: its number (mod 65536); quorum: the k its chunks
        complete at (0: all n, sync). ready: the chunks whose exponents ``local`` holds
        (-1: all); the stream computes the others' as it goes, and counters["nonfinite"]
        says whether it met a NaN or an Inf there (then the result is not the sum).
        ident: nonzero, a predicted call (its identity; ``agreed``'s first window holds the
        prediction); learn: S x G int16 that receives the first window's proposals (the
        next prediction), or None; nonfinite: the ready chunks hold a NaN or an Inf
        (every packet then says so: transport.Link.stream); absent: a quorum call this
        worker adds nothing to (every chunk a result request: docs/quorum.md).
        Returns the Result (``ok``: done, or LOST in a quorum call: done but for the
        chunks ``missing`` names, whose results the switch no longer holds; the engine
        takes them from a peer), with its ``reason`` ("mismatch": a predicted call's
        result said the ranks called differently). ``then``: the next call (a sync
        stream), queued behind this one: the stream adopts it in its drain, with no call
        back into Python (``adopted``, ``resume``; docs/protocol.md, Calls back to
        back). ``pause`` (with no ``then``): None once the stream drains (``paused``),
        for the caller to learn its next call; ``proceed`` goes on with it."""
        self._last_wait = (plan.call, timers.silence)
        with self._waiting(*self._last_wait):
            result = self.wire.stream(plan, timers, deadline, cancel, then, pause)
        return self._ended(result)

    def _waiting(self, call: int, silence: float):
        return waiting_for(lambda: f"the results of call #{call} from the aggregator at "
                                   f"{self.switch[0]}:{self.switch[1]} (silence bound "
                                   f"{silence:g} s)")

    def _ended(self, result: Result | None) -> Result | None:
        if result is not None:
            result.reason = self._reason(result)
        return result

    @property
    def paused(self) -> bool:
        """Whether a stream paused at its drain (``stream``'s ``pause``) waits for
        ``proceed``."""
        return self.wire.paused

    def proceed(self, then: Queued | None = None) -> Result:
        """The paused stream run on to its end, ``then`` queued behind it and adopted at
        once (as ``stream``'s): its Result."""
        with self._waiting(*self._last_wait):
            result = self.wire.proceed(then)
        return self._ended(result)

    @property
    def adopted(self) -> bool:
        """Whether the call queued behind the last stream was adopted in its drain, and
        not yet resumed or abandoned."""
        return self.wire.adopted

    def resume(self, then: Queued | None = None, pause: bool = False) -> Result | None:
        """The adopted call run to its end (``then`` and ``pause``: as ``stream``'s): its
        Result, as ``stream``'s, or None where it paused at its drain."""
        return self._ended(self.wire.resume(then, pause))

    def abandon(self) -> bool:
        """Drop the adopted call, if any (True if there was one)."""
        return self.wire.abandon()

    def settle(self, chunks: int) -> None:
        """The last sync call (``chunks`` chunks), which this worker could not finish,
        was finished from a peer's kept window: the slots as its completion leaves them."""
        self.wire.settle(chunks)

    def _reason(self, result: Result) -> str:
        """How a stream or an opening ended (transport.STATUS; "mismatch": a result said
        the ranks called differently), with the failed system call's own words, as
        OSError would say them: "a send failed: [Errno 111] Connection refused: to
        127.0.0.1:47474", or a receive failure beside a silence."""
        status = result.status
        if status == 0:  # (done: the common case, without a lookup)
            return "done"
        transport = self._transport
        if status == transport.OPEN_MISMATCH:
            return "mismatch"
        failure, call = result.error, result.failed_call
        reason = transport.STATUS[status]
        switch = f"{self.switch[0]}:{self.switch[1]}"
        if failure and call == "send":
            reason = f"{reason}: {SystemCallError(failure, f'to {switch}')}"
            if failure == errno.EMSGSIZE:
                try:
                    mtu = P.path_mtu(self.switch)
                except OSError:
                    mtu = 0
                reason = f"{reason} ({self._mtu_advice(mtu)})"
        elif failure:
            reason = f"{reason}; {call} failed: {SystemCallError(failure, f'from {switch}')}"
        return reason

    def _mtu_advice(self, mtu: int) -> str:
        """What a packet too large for the path's MTU (0: not known) needs: the numbers
        and the fix."""
        size = P.packet_bytes(self.k, self.block, self.value_bits) + P.IP_UDP_HEADER_BYTES
        if mtu <= 0:
            return (f"a packet of K {self.k} values is a {size}-byte datagram, over the "
                    f"path's MTU; leave INA_SWITCH_ELEMENTS unset to size packets to it")
        return (f"a packet of K {self.k} values is a {size}-byte datagram, over the MTU "
                f"{mtu} of the path; K {P.elements_for_mtu(mtu, self.block, self.value_bits)} "
                f"fits it: leave INA_SWITCH_ELEMENTS unset to size packets to the path, or "
                f"set it to that")


def _int16(word: int) -> int:
    """A 16-bit word as the int16 it is on the wire."""
    return word - 0x10000 if word >= 0x8000 else word
