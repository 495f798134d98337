# cython: language_level=3
"""The worker's data path: a tensor streamed through the aggregator, windowed and reliable.

One compiled object per link (``Link``) owns what lasts from call to call: the socket and
the switch's address, the job's format, each slot's version, the round-trip estimates,
the packet numbers, the send path and the buffers; its methods ``stream`` and
``opening`` share one loop of timers, NACKs, batched sends and receives (``_run``), and
return a ``Result``.

One packet in flight per slot (S in all), self-clocked by results: the result of chunk c
frees slot c mod S for chunk c + S, whose agreed exponents the result carries (the max of
all workers' proposals; a quorum call's were all agreed before it started). The new
packets a batch of results frees leave together, with UDP segmentation offload where the
kernel has it, else in one sendmmsg (udp_batch.h). A per-slot timer resends with
exponential backoff; each chunk's result is applied to the output exactly once (a result
for a chunk not in flight in its slot, with its version and call number, is stale and
dropped). Runs without the GIL, taking it every 20 ms to let Python see signals: Ctrl-C
ends a blocked stream with KeyboardInterrupt.

The timeout adapts as TCP's does (RFC 6298): SRTT and RTTVAR from the round trips of
chunks sent once (Karn), RTO = SRTT + max(G, 4 RTTVAR), but at least 3/2 SRTT
(AGGREGATION_MARGIN), within [rto_min, rto_max]; a timeout doubles it until the next
sample. The estimate lives in the link, so it carries over from one call to the next (the
link keeps one for its streams and one for its openings, whose small packets meet no
queue).

Each new packet carries the worker's packet number (mod 256, counted across calls); the
software aggregator NACKs numbers it never saw, and the packets in flight with those
numbers are resent at once, without backing off: only the worker whose packet was lost
resends, before the timeouts of the others fire (a P4 switch sends no NACKs; there the
timers recover). With an aggregator that answers them (its join or probe reply says so,
or it has sent a NACK: the link's ``nacking``), a packet in flight that OVERTAKEN results
of later packets have passed asks for its result again with a header alone (a result
request), once until it is sent again: its result was lost on the way back, or another
worker's packet was (then the request is ignored, and that worker NACKed). The first
timeout of a packet asks the same way; full resends are left to the second and later
timeouts.

In a quorum call (``quorum`` k > 0, docs/quorum.md) a chunk completes when k workers
contributed: a result may not count this worker (its contributors say who was counted,
and an AVERAGE divides by their number). Every chunk's exponents are agreed before a
quorum call starts (a result's proposals are those of the workers it counted, which a
left-out worker's values need not fit). Should its values not fit all the same, a worker
sends that chunk's header alone (a result request) instead of clipped values, and is
left out of the chunk.
"""
cimport cython
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

import numpy as np

from blockfp_kernels cimport KIND_F32, KIND_F64, chunk_proposals, ina_prefetch, kind_itemsize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno
from netio cimport (MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll, pollfd,
                    prepare_receive, recvmmsg, sendto, set_sockaddr, sockaddr, sockaddr_in,
                    try_again)

from ina_collectives import protocol as P
from ina_collectives.ina.reference import blockfp as ref_blockfp

include "header.pxi"
include "wire.pxi"

from udp_batch cimport (INA_BATCH_MAX, INA_GRO_CONTROL, ina_attach_controls,
                        ina_segments, ina_send_batch, ina_send_no_room)

cdef enum:
    BATCH = 32
    SEGMENTS = BATCH * 64  # datagrams one receive may bring with UDP_GRO (64 per buffer)
    RX_BYTES = 65536       # one receive buffer

cdef double GRANULARITY = 0.001     # poll() waits in whole milliseconds
# The RTO is at least (1 + AGGREGATION_MARGIN) x SRTT. The aggregator answers a packet
# only when every worker's packet of its chunk is in, as a delayed ACK answers late (QUIC
# bounds that with max_ack_delay). Against a slow target (BMv2) the round trip is mostly
# its queue of n x S packets: steady, so RTTVAR shrinks to a fraction of a millisecond,
# and a timer at SRTT + 4 RTTVAR fired on the queue's ordinary swings; each needless
# result request then lengthened that queue (13% of the packets asked again at 4,000
# packets a second, n = 4, S = 8; none with the margin: docs/reliability.md).
cdef double AGGREGATION_MARGIN = 0.5
RTO_MARGIN = AGGREGATION_MARGIN  # (as Python sees it: the tests' bounds derive from it)
cdef double SIGNAL_CHECK = 0.02     # the GIL is taken this often to see Ctrl-C
cdef double STALLED = 0.1           # a gap between two looks this long: the process was held
# Results of later packets after which a packet in flight asks for its result: more than
# one, so that a little reordering on the way asks nothing (TCP's duplicate-ACK threshold).
cdef int OVERTAKEN = 3
# Once per transmission: a packet that asked stays quiet until it is sent again (by its
# timer). Asking again every OVERTAKEN results made a window of S packets ask up to S / 3
# times while another worker's lost packet was resent, and the asks that arrived after
# the chunk completed each brought its whole result back again (docs/reliability.md).
cdef int32_t ASKED = -(1 << 30)
# Quorum: timeouts of one packet after which its chunk is given up (the others may have
# moved its cell on, and the later chunks that would say so may be lost too); the engine
# takes it from a peer. Its timer has doubled this many times by then.
cdef int QUORUM_TRIES = 5


cdef struct Estimator:  # RFC 6298's state, kept across calls
    double srtt    # 0: no sample yet
    double rttvar
    double rto


cdef struct Slot:  # one slot of the window: its packet in flight
    int64_t chunk          # the chunk in flight (-1: none; an opening's: its slot)
    int64_t latest         # quorum: the slot's latest chunk with a result
    double sent_at         # its last transmission
    double born            # its first (the round trip's start)
    double timer           # its timeout, backed off
    int32_t length         # its packet's bytes (the slot's row)
    int32_t overtaken      # results of later packets since it was sent (ASKED: it asked)
    uint8_t resent         # sent again or asked for: no RTT sample (Karn)
    uint8_t asked          # a timeout asked for its result (a header alone)
    uint8_t seq            # the packet number it went with
    uint8_t tries          # its timeouts (quorum: given up at QUORUM_TRIES)
    uint8_t version        # the slot's next version: kept across calls
    uint8_t first_version  # the version the call's first use of the slot had (use_version)
    uint8_t predicted      # its packet in flight is a predicted first try (FLAG_PREDICTED)
    uint8_t adopted        # its packet in flight is the adopted call's (Link.adopt)


cdef struct Lazy:  # chunks whose exponents the stream computes as it reaches them
    Py_ssize_t have   # the chunks with exponents in local so far
    int32_t floor     # the dtype's smallest exponent
    bint nonfinite    # a NaN or an Inf was seen among them
    const int16_t *flagged  # G proposals of NONFINITE_MARK: what a packet proposes once seen


cdef struct Call:  # one stream's or opening's progress, bounds and counts
    bint opening           # an opening (else a stream)
    Py_ssize_t slots       # the slots it uses (their chunk is -1 when none is in flight)
    Py_ssize_t total       # what completes it: chunks (a stream), slots (an opening)
    Py_ssize_t completed
    bint stop              # an opening's MISMATCH: ends it, the total not reached
    int number             # the call's number (mod 65536), in every packet
    int quorum             # the k its chunks complete at (0: all n)
    bint absent            # this worker contributes nothing: every chunk a result request
    int retransmit         # the flags of a packet sent again
    bint asks              # a first timeout asks for the result (the stream's rule)
    Estimator *est
    double rto, rto_max, rto_min, silence, deadline
    double start, last_result, next_signal_check
    bint held              # the aggregator said it holds a packet of this call
    const uint8_t *cancel  # set to 1 by another thread: CANCELLED (NULL: none)
    int status
    int failure            # a failed send's errno
    int receive_failure, receive_call
    # counts
    Py_ssize_t sent, retransmitted, stale, rejected, nacks, nacked, requests, samples
    Py_ssize_t left_out, skipped, lost, gro_buffers
    long send_calls
    long refused           # datagrams the kernel refused for want of room (lost here)
    # a stream's tensor and format
    const char *x
    char *out
    Py_ssize_t size, nb, g
    Format fmt             # its values' format (the link's k, b and n, the call's rest)
    int16_t *local
    int16_t *agreed
    uint8_t *done          # per chunk: its result applied
    Lazy lazy
    int16_t exponent_ceiling
    bint nonfinite_seen
    bint draining          # every chunk went once: the last window drains (Link.adopt)
    # a predicted call (docs/protocol.md, One round trip): its identity (0: none), what
    # the first window teaches (2 x slots x g; NULL: not kept), its chunks sent again
    uint64_t ident
    int16_t *learn
    Py_ssize_t overflows
    int stop_status        # why ``stop`` ended a stream (OPEN_MISMATCH)
    uint64_t counted_all, counted_any, me
    int64_t mode
    # an opening's identity and proposals (slots x g, replaced by the max)
    uint32_t ident_offset
    int16_t ident_word
    int16_t *proposals
    Py_ssize_t width       # its packets' bytes


cdef inline void rtt_sample(Estimator *est, double r, double rto_min,
                            double rto_max) noexcept nogil:
    """RFC 6298 section 2 with alpha 1/8, beta 1/4; the RTO at least 3/2 SRTT."""
    if est.srtt <= 0:
        est.srtt = r
        est.rttvar = r / 2
    else:
        est.rttvar = (0.75 * est.rttvar
                      + 0.25 * (est.srtt - r if est.srtt > r else r - est.srtt))
        est.srtt = 0.875 * est.srtt + 0.125 * r
    est.rto = max(est.srtt + max(GRANULARITY, 4 * est.rttvar),
                  (1 + AGGREGATION_MARGIN) * est.srtt)
    est.rto = min(max(est.rto, rto_min), rto_max)


cdef inline void fresh_use(Slot *w) noexcept nogil:
    """A slot's state for a call's first use of it (its version kept across calls)."""
    w.latest, w.first_version = -1, w.version
    w.resent = w.asked = w.tries = w.predicted = 0
    w.overtaken = 0


cdef inline int use_version(uint8_t v0, Py_ssize_t c, Py_ssize_t slots) noexcept nogil:
    """The slot version chunk c uses: its slot's first chunk of the call used v0 (the
    slot's ``first_version``), and each later use of the slot the other one."""
    return v0 ^ ((c // slots) & 1)


cdef inline Py_ssize_t next_undone(const uint8_t *done, Py_ssize_t c, Py_ssize_t nb,
                                   Py_ssize_t slots) noexcept nogil:
    """The first chunk c, c + S, ... of a slot without its result yet (nb if none)."""
    while c < nb and done[c]:
        c += slots
    return c if c < nb else nb


cdef inline int bounds_passed(double now, double start, double deadline, double last_result,
                              double silence) noexcept nogil:
    """TIMEOUT once the deadline passed, SILENT once no result came for ``silence``
    seconds, else DONE (go on)."""
    if now - start > deadline:
        return TIMEOUT
    if now - last_result > silence:
        return SILENT
    return DONE


def rtt_update(double[::1] state, double sample, double rto_min, double rto_max):
    """One round-trip sample into state [SRTT, RTTVAR, RTO] (for tests); the new RTO."""
    cdef Estimator est
    est.srtt, est.rttvar, est.rto = state[0], state[1], state[2]
    rtt_sample(&est, sample, rto_min, rto_max)
    state[0], state[1], state[2] = est.srtt, est.rttvar, est.rto
    return est.rto


# What a call's Result.status is.
cdef enum:
    DONE, SILENT, TIMEOUT, SEND_FAILED, CANCELLED, LOST, PEER_LATE
STATUS = ("done", "no result within the silence bound (the aggregator or a peer stopped)",
          "the operation's deadline passed", "a send failed",
          "cancelled (another part of the call was interrupted)",
          "done but for chunks whose results the switch no longer holds (quorum: the "
          "others had moved their cells on)",
          "the operation's deadline passed while the aggregator held this rank's packets "
          "for a peer's (a peer stopped or is slow)")
COMPLETE = (DONE, LOST)
_NONE_MISSING = np.zeros(0, np.intp)  # (read-only: every complete stream's ``missing``)
_NONE_MISSING.flags.writeable = False  # what ended without a failure (LOST: ``missing`` says what)
# An opening's (or a predicted stream's) status besides STATUS's when a result said the
# workers' identities differ (a MISMATCH is complete: every worker learns it).
cdef enum:
    MISMATCHED = 100
OPEN_MISMATCH = MISMATCHED

# The system call whose errno an unfinished call reports (Result.error and
# Result.failed_call, one of CALLS). A send's ends the call (SEND_FAILED); a receive
# failure does not, but is reported if the call then ends without its results.
cdef enum:
    CALL_SEND, CALL_RECVMMSG, CALL_POLL
CALLS = ("send", "recvmmsg", "poll")


cdef struct Counts:  # what one call did; a link's calls all told (Link.totals)
    int64_t sent, open_sent, send_calls, gro_buffers, retransmitted, nacks, nack_resent
    int64_t result_requests, rtt_samples, stale, rejected, left_out, skipped, lost
    int64_t nonfinite, nonfinite_seen, predicted, overflows, adopted, send_refused
    double seconds, open_seconds


cdef inline void add_counts(Counts *into, const Counts *n) noexcept nogil:
    into.sent += n.sent
    into.open_sent += n.open_sent
    into.send_calls += n.send_calls
    into.gro_buffers += n.gro_buffers
    into.retransmitted += n.retransmitted
    into.nacks += n.nacks
    into.nack_resent += n.nack_resent
    into.result_requests += n.result_requests
    into.rtt_samples += n.rtt_samples
    into.stale += n.stale
    into.rejected += n.rejected
    into.left_out += n.left_out
    into.skipped += n.skipped
    into.lost += n.lost
    into.nonfinite += n.nonfinite
    into.nonfinite_seen += n.nonfinite_seen
    into.predicted += n.predicted
    into.overflows += n.overflows
    into.adopted += n.adopted
    into.send_refused += n.send_refused
    into.seconds += n.seconds
    into.open_seconds += n.open_seconds


cdef void counts_of(const Call *c, Counts *n, double seconds) noexcept nogil:
    """A stream's or an opening's counts, from its progress."""
    memset(n, 0, sizeof(Counts))
    n.send_calls, n.retransmitted, n.nacks = c.send_calls, c.retransmitted, c.nacks
    n.nack_resent, n.stale, n.rtt_samples = c.nacked, c.stale, c.samples
    n.send_refused = c.refused
    if c.opening:
        n.open_sent, n.open_seconds = c.slots, seconds
        return
    n.sent, n.gro_buffers, n.result_requests = c.sent, c.gro_buffers, c.requests
    n.rejected, n.left_out, n.skipped, n.lost = c.rejected, c.left_out, c.skipped, c.lost
    n.nonfinite, n.nonfinite_seen = c.lazy.nonfinite, c.nonfinite_seen
    n.predicted, n.overflows, n.seconds = c.ident != 0, c.overflows, seconds


cdef class Result:
    """How one stream or opening ended, built once at its end: ``status`` (an index of
    STATUS, or OPEN_MISMATCH), ``counters`` (its counts by name, made when read: the
    link keeps their totals, ``Link.totals``; the ones the caller decides on are
    attributes of their own: ``seconds``, ``overflows``, ``left_out``, ``skipped``,
    ``nonfinite`` and ``nonfinite_seen``),
    ``missing`` (the chunks not completed), ``counted_all`` and ``counted_any`` (the
    workers every result counted, a bitmap, all ones if no result came; those some result
    counted, all ones (-1) if none came), ``mode`` (the largest mode generation << 8 |
    mode quorum the results announced), ``error`` and ``failed_call`` (the errno of the
    system call that failed, and its name in CALLS; 0 and "" if none). ``reason`` is the
    caller's words for it (WorkerLink fills it in)."""

    cdef readonly int status
    cdef Counts n
    cdef readonly object missing
    cdef readonly object counted_all
    cdef readonly object counted_any
    cdef readonly int64_t mode
    cdef readonly int error
    cdef readonly str failed_call
    cdef public str reason

    def __init__(self, int status=DONE, dict counters=None, missing=None,
                 counted_all=~0, counted_any=~0, int64_t mode=0, int error=0,
                 str failed_call=""):
        self.status = status
        memset(&self.n, 0, sizeof(Counts))
        if counters:  # (made by hand: tests, a caller's own)
            named = <dict>self.n
            unknown = set(counters) - set(named)
            if unknown:
                raise ValueError(f"no such counters: {sorted(unknown)}")
            named.update(counters)
            self.n = named
        self.missing = np.zeros(0, np.int64) if missing is None else missing
        self.counted_all, self.counted_any, self.mode = counted_all, counted_any, mode
        self.error, self.failed_call, self.reason = error, failed_call, ""

    @property
    def ok(self) -> bool:
        """Ended without a failure (LOST included: ``missing`` says what it lacks)."""
        return self.status == DONE or self.status == LOST

    @property
    def counters(self) -> dict:
        """The call's counts by name (a new dict: read, not kept, on the hot path)."""
        return self.n

    @property
    def seconds(self) -> float:
        """How long the stream (or the opening) took."""
        return self.n.seconds + self.n.open_seconds  # (one of them is 0)

    @property
    def overflows(self) -> int:
        """A predicted call's chunks sent again: their values overflowed the prediction."""
        return self.n.overflows

    @property
    def left_out(self) -> int:
        """A quorum call's chunks this worker's values were not counted in."""
        return self.n.left_out

    @property
    def skipped(self) -> int:
        """A quorum call's chunks this worker sent no values for (they did not fit)."""
        return self.n.skipped

    @property
    def nonfinite(self) -> bool:
        """This worker's input held a NaN or an Inf."""
        return self.n.nonfinite != 0

    @property
    def nonfinite_seen(self) -> bool:
        """A result said some worker's input held a NaN or an Inf."""
        return self.n.nonfinite_seen != 0

    def __repr__(self):
        return (f"Result(status={self.status}, reason={self.reason!r}, "
                f"missing={self.missing.size}, error={self.error}, "
                f"failed_call={self.failed_call!r})")


@cython.final
cdef class Link:
    """One worker's data path to one aggregator, for one job: the socket (``fd``, bound
    and owned by the caller, WorkerLink) and the switch's address; the job's format
    (``fmt``, a protocol.JobFormat: job, n, K, B, value bits), the worker, the epoch;
    and the state that lasts from call to call:
    each slot's version, the streams' and the openings' RTT estimates, the packet number
    of the next new packet and whether the aggregator NACKs (``nacking``), whether new
    packets may leave with UDP_SEGMENT (``gso``), and the window (one Slot per slot) with
    its buffers: the packet in flight per slot, the receive buffers.

    ``stream`` and ``opening`` are its calls; each returns a Result."""

    cdef int fd
    cdef sockaddr_in to
    cdef Counts counts                        # its calls' counts all told (``totals``)
    cdef readonly int job, worker, n, value_bits
    cdef readonly Py_ssize_t k, block, groups, slots, row_width
    cdef int _epoch
    cdef Slot *window
    cdef Estimator stream_est, open_est
    cdef uint8_t _next_packet    # the next new packet's number (mod 256, across calls)
    cdef public bint nacking     # the aggregator NACKs (CAP_NACKS, or it sent a NACK)
    # Called (with the GIL) every 20 ms while the aggregator holds this worker's packets
    # and waits for a peer: a non-None answer (a peer failed) ends the call, CANCELLED.
    cdef public object watch
    cdef public int gso          # 1 while UDP_SEGMENT may be used (cleared if refused)
    cdef uint8_t *rows           # the packet in flight per slot: slots x row_width
    cdef uint8_t *rx             # the receive buffers: BATCH x RX_BYTES
    cdef int16_t *flagged        # G x NONFINITE_MARK
    cdef int16_t *scratch        # 2 G: a predicted packet's exponents and proposals
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef char controls[BATCH * 64]            # INA_GRO_CONTROL bytes per message
    cdef uint8_t *seg_ptr[SEGMENTS]           # the datagrams received, split (UDP_GRO)
    cdef int32_t seg_len[SEGMENTS]
    cdef uint8_t *pend_bufs[INA_BATCH_MAX]    # new packets not sent yet (_flush)
    cdef int32_t pend_lens[INA_BATCH_MAX]
    cdef int npend
    cdef uint8_t request[64]                  # a result request: a header alone
    cdef pollfd pfd
    # The queue behind the running call, two deep: the next call (``then``), set up
    # before the running stream starts and started by this loop in its drain
    # (``queued``, then ``has_next``: adopted); the arrays it points into; the running
    # call (NULL: none).
    cdef Call next_call
    cdef object next_keep
    cdef bint queued
    cdef bint has_next
    cdef Call *running
    # A call paused at its drain (``pause``): its state and arrays until ``proceed``;
    # whether the running stream pauses there (once), and whether it did.
    cdef Call paused_call
    cdef object paused_keep
    cdef bint is_paused, paused_adopted
    cdef double paused_at
    cdef bint pause_due
    cdef bint pausing

    def __cinit__(self, int fd, uint32_t switch_addr_be, uint16_t switch_port_be, fmt,
                  int worker, Py_ssize_t slots, int epoch=0, bint gso=True):
        cdef Py_ssize_t j
        if slots < 1:
            raise ValueError(f"a link needs S >= 1, not {slots}")
        self.fd = fd
        set_sockaddr(&self.to, switch_addr_be, switch_port_be)
        self.job, self.worker, self.n = fmt.job, worker, fmt.n
        self.k, self.block, self.value_bits = fmt.k, fmt.block, fmt.value_bits
        self.groups = P.sub_blocks(self.k, self.block)
        # Wide enough for the widest values a call may ask for (value_bits_for).
        self.row_width = P.packet_bytes(self.k, self.block, max(P.VALUE_BITS))
        self.epoch = epoch
        self.gso = 1 if gso else 0
        self.pfd.fd = fd
        self.pfd.events = POLLIN
        self.flagged = <int16_t *>calloc(self.groups, sizeof(int16_t))
        self.scratch = <int16_t *>calloc(2 * self.groups, sizeof(int16_t))
        self.rx = <uint8_t *>calloc(BATCH, RX_BYTES)
        if self.flagged == NULL or self.rx == NULL or self.scratch == NULL:
            raise MemoryError("no memory for the link's buffers")
        for j in range(self.groups):
            self.flagged[j] = NONFINITE_MARK
        self.resize(slots)

    def __dealloc__(self):
        free(self.window)
        free(self.rows)
        free(self.rx)
        free(self.flagged)
        free(self.scratch)

    def resize(self, Py_ssize_t slots):
        """S slots from now on (the aggregator granted fewer than asked), each from
        version 0."""
        if slots < 1:
            raise ValueError(f"a link needs S >= 1, not {slots}")
        cdef Slot *window = <Slot *>calloc(slots, sizeof(Slot))
        cdef uint8_t *rows = <uint8_t *>calloc(slots, self.row_width)
        if window == NULL or rows == NULL:
            free(window)
            free(rows)
            raise MemoryError(f"no memory for a window of {slots} slots")
        free(self.window)
        free(self.rows)
        self.window, self.rows, self.slots = window, rows, slots

    @property
    def epoch(self) -> int:
        """This run's epoch, in every packet: results of another are stale."""
        return self._epoch

    @epoch.setter
    def epoch(self, int epoch):
        if not 0 <= epoch < 65536:
            raise ValueError(f"epoch {epoch} is not 0..65535")
        self._epoch = epoch

    def new_epoch(self, int epoch):
        """A new epoch, every slot from version 0 again (Aggregators.new_epoch)."""
        cdef Py_ssize_t s
        self.epoch = epoch
        for s in range(self.slots):
            self.window[s].version = 0

    @property
    def versions(self):
        """Each slot's next version (a copy)."""
        out = np.empty(self.slots, np.uint8)
        cdef uint8_t[::1] v = out
        cdef Py_ssize_t s
        for s in range(self.slots):
            v[s] = self.window[s].version
        return out

    @property
    def next_packet(self) -> int:
        """The number of this link's next new packet (mod 256, counted across calls)."""
        return self._next_packet

    @property
    def stream_rtt(self):
        """The streams' estimate: (SRTT, RTTVAR, RTO) in seconds (zeros: no sample)."""
        return (self.stream_est.srtt, self.stream_est.rttvar, self.stream_est.rto)

    @property
    def totals(self) -> dict:
        """Its calls' counts all told, by name, as a Result's ``counters``."""
        return self.counts

    @property
    def opening_rtt(self):
        """The openings' own: their small packets meet no queue, and their round trips
        would pull the stream's estimate below its first window's (one per call)."""
        return (self.open_est.srtt, self.open_est.rttvar, self.open_est.rto)

    # -- the calls ------------------------------------------------------------------

    def stream(self, plan, timers, double deadline, const uint8_t[::1] cancel=None,
               then=None, bint pause=False):
        """One call's stream, ``plan`` (ina.link.StreamPlan, read once into this stream's
        C state): allreduce plan.x (1-D float32/float64) into plan.out through the
        aggregator, within ``deadline`` seconds. The plan's fields:

        local: this worker's sub-block exponents (G = ceil(K / block) per chunk); agreed:
        the first window's agreed exponents (the rest are filled in from results).
        timers: the waits (link.Timers: ``first``, the timeout until the first sample;
        ``least`` and ``most``, its bounds; ``silence``). value_bits: this call's width
        (0: the job's). New packets leave in batches: all those a batch of results frees,
        in one system call per run of equal-sized packets.
        cancel: [0], set to 1 by another thread to end the stream (CANCELLED) within 20 ms
        (a call striped over several aggregators streams each part in a thread of its own).
        call: the call's number (mod 65536), in every packet; quorum: the k its chunks
        complete at (0: all n). ready: the chunks whose exponents ``local`` holds already
        (-1: all); the stream fills in the others' as it reaches them (a chunk's are needed
        one window ahead, as the proposals its slot's packet carries), so that the pass over
        the tensor they take runs while the stream waits on the network, not before it; a
        NaN or an Inf among them sets counters["nonfinite"] (the caller must then discard
        the result: those chunks' values were not representable).
        In a quorum call a worker that lags takes the results of its slots' later chunks as
        they pass (they were multicast to it), sending nothing for them; a chunk whose result
        it lost after the others moved its cell on cannot be had from the switch any more:
        the stream ends LOST with those chunks missing (the engine takes them from a peer).
        ident: nonzero, a predicted call (docs/protocol.md, One round trip; sync only):
        the first window goes without an opening, its packets flagged PREDICTED with this
        identity, ``agreed``'s first window holding the predicted exponents (a worker whose
        own are larger sends its own); a result marked OVERFLOW sends its chunk again with
        the result's exponents, one marked MISMATCH ends the stream (status OPEN_MISMATCH).
        nonfinite: the chunks ``local`` holds already (``ready``) have a NaN or an Inf:
        every packet proposes NONFINITE_MARK from the first on (a predicted call, whose
        first window no agreement saw).
        absent: this worker contributes nothing to this quorum call (the runtime ran it
        without this rank's tensor, docs/quorum.md, Running ahead): every chunk goes as a
        result request, its header alone, and the stream takes the results as they pass.
        learn: 2 x S x G int16, or None: what the next prediction is made from. Row 0
        receives the exponents each slot's first chunk was summed with (its result's);
        row 1, the max over the workers of that chunk's own exponents, which the slot's
        last chunk of the call proposes (it has no next chunk to propose for; a last chunk
        shorter than the first proposes its sub-blocks only: PROPOSAL_NONE stays in the
        others).
        then: None, or the next call, queued behind this one (plan, timers, deadline, as
        this call's; a sync stream behind a sync stream): when every chunk of this call
        went once and its last window drains, this loop adopts it, and its chunks leave in
        each slot as soon as that slot's last result of this call is back (docs/protocol.md,
        Calls back to back); ``resume`` runs it to its end. Where this call ends before
        its drain, the next call is dropped unstarted (``adopted`` stays False).
        pause: with no ``then``, the stream returns None when it drains (``paused``),
        for its caller to learn the next call meanwhile; ``proceed(then)`` goes on with
        it where it left off (its packets stay in flight meanwhile). A call complete
        before its drain was seen returns its Result as ever.
        Returns a Result. Its counters include "left_out" (results that did not count this
        worker), "skipped" (chunks whose values did not fit the exponents agreed without
        it: a header sent alone) and "overflows" (predicted chunks sent again).
        """
        if self.has_next or self.is_paused:
            raise RuntimeError("a call is adopted or paused on this link: resume, proceed "
                               "or abandon it first")
        cdef Call c
        done_arr = self._set_up(&c, plan, timers, deadline, cancel)
        if done_arr is None:
            return Result(DONE, None, np.zeros(0, np.int64), ~(<uint64_t>0), ~0)
        if then is not None:
            if c.quorum or c.absent:
                raise ValueError("a call is queued behind a sync stream only")
            self._enqueue(then)
        self._fresh_window()
        cdef Py_ssize_t s, first = min(self.slots, c.nb)
        c.draining = c.nb <= self.slots
        with nogil:
            for s in range(first):
                self._queue(&c, self._write_chunk(&c, s, c.ident != 0))
                c.sent += 1
                if self.npend == INA_BATCH_MAX or s == first - 1:
                    if self._flush(&c) < 0:
                        break
        self.pause_due = pause and then is None
        # (``cancel`` kept with the plan: the paused call's state points into both)
        return self._pause_or_end(&c, (plan, cancel), done_arr, self._drive(&c, done_arr),
                                  False)

    cdef object _pause_or_end(self, Call *c, keep, done_arr, Result result, bint adopted):
        """A stream's end: its Result, or None where it paused at its drain (its state
        kept for ``proceed``, with ``keep``, what it points into; ``adopted``: it is an
        adopted call's)."""
        if result is not None:
            return result
        self.paused_call = c[0]
        self.paused_keep = (keep, done_arr)
        self.paused_adopted = adopted
        self.paused_at = monotonic()
        self.is_paused = True
        return None

    @property
    def paused(self) -> bool:
        """Whether a stream paused at its drain (``pause``) waits for ``proceed``."""
        return self.is_paused

    def proceed(self, then=None):
        """Go on with the paused stream (``then``: the next call, queued behind it and
        adopted at once, as ``stream``'s): its Result."""
        if not self.is_paused:
            raise RuntimeError("no stream is paused on this link")
        cdef Call c = self.paused_call
        cdef double now = monotonic()
        keep, done_arr = self.paused_keep  # (keep: what it points into, alive till here)
        self.is_paused = False
        self.paused_keep = None
        c.next_signal_check = now
        c.last_result += now - self.paused_at  # (its silence counts time it listened)
        if then is not None:
            try:
                self._enqueue(then)
            except BaseException:
                self._forget_window()
                raise
            if c.status == DONE and not c.stop:  # (drained: the free slots take it now)
                with nogil:
                    self._adopt_queued()
        self.pause_due = False
        cdef Result result = self._drive(&c, done_arr)
        del keep
        if self.paused_adopted:
            result.n.adopted = 1
            self.counts.adopted += 1
        return result

    cdef void _forget_window(self):
        """Nothing of a given-up call stays in flight here (its packets are forgotten)."""
        cdef Py_ssize_t s
        for s in range(self.slots):
            self.window[s].chunk = -1
            self.window[s].adopted = 0

    cdef void _enqueue(self, then) except *:
        """The next call (``then``: plan, timers, deadline) set up behind the one about to
        run, unstarted: the running stream's drain adopts it (``_adopt_queued``)."""
        if self.queued:
            raise RuntimeError("a call is queued on this link already")
        plan, timers, deadline = then
        if plan.quorum or plan.absent:
            raise ValueError("a call is queued in sync only (quorum 0)")
        done_arr = self._set_up(&self.next_call, plan, timers, deadline, None)
        if done_arr is None:
            raise ValueError("an empty call is not queued")
        self.next_keep = (plan, done_arr)
        self.queued = True

    cdef void _adopt_queued(self) noexcept nogil:
        """The running stream drains: the queued call is adopted. Each slot the running
        call is done with takes its first chunk for it now, the others as their last
        result of the running call comes back (one packet in flight per slot, as ever)."""
        cdef Call *nc = &self.next_call
        cdef Py_ssize_t s
        self.queued = False
        self.has_next = True
        nc.draining = nc.nb <= self.slots
        for s in range(min(self.slots, nc.nb)):
            if self.window[s].chunk < 0:
                self._start_adopted(s)
                if self.npend == INA_BATCH_MAX:
                    self._flush(nc)
        if self.npend:
            self._flush(nc)

    @property
    def adopted(self) -> bool:
        """Whether a call queued behind the last stream (``then``) was adopted in its
        drain, and not yet resumed or abandoned."""
        return self.has_next

    def resume(self, then=None, bint pause=False):
        """Run the adopted call to its end (``then``: the call queued behind it, as
        ``stream``'s); its Result, as ``stream``'s, counted from its adoption
        (counters["adopted"] 1)."""
        if not self.has_next:
            raise RuntimeError("no call is adopted on this link")
        cdef Call c = self.next_call  # (a copy: the next adoption takes next_call)
        cdef Py_ssize_t s
        keep, self.next_keep = self.next_keep, None
        self.has_next = False
        for s in range(self.slots):
            self.window[s].adopted = 0
        c.last_result = c.next_signal_check = monotonic()  # (its silence from now)
        self.npend = 0
        if then is not None:
            self._enqueue(then)
        self.pause_due = pause and then is None
        ended = self._pause_or_end(&c, keep[0], keep[1], self._drive(&c, keep[1]), True)
        if ended is None:
            return None
        cdef Result result = ended
        result.n.adopted = 1
        self.counts.adopted += 1
        return result

    def abandon(self):
        """Drop the adopted call, if any (its stream is given up on this worker); True
        if there was one."""
        cdef Py_ssize_t s
        self.queued = False
        if self.is_paused:  # (the paused stream is given up too: forgotten here)
            self.is_paused = False
            self.paused_keep = None
            self._forget_window()
        if not self.has_next:
            self.next_keep = None
            return False
        for s in range(self.slots):
            if self.window[s].adopted:
                self.window[s].chunk = -1
                self.window[s].adopted = 0
        self.has_next = False
        self.next_keep = None
        return True

    def settle(self, Py_ssize_t chunks):
        """The last call, a sync stream of ``chunks`` chunks this worker could not finish,
        was finished from a peer's kept window (ina/windows.py): each slot's version as
        the call's completion leaves it (one flip per use), nothing in flight."""
        if self.has_next or self.is_paused or self.running != NULL:
            raise RuntimeError("a call is running, paused or adopted on this link")
        cdef Py_ssize_t s, slots = self.slots
        cdef Slot *w
        for s in range(slots):
            w = &self.window[s]
            if s < chunks:
                w.version = use_version(w.first_version,
                                        s + slots * ((chunks - s + slots - 1) // slots),
                                        slots)
            w.chunk = -1
            w.adopted = 0
        self.npend = 0

    cdef object _set_up(self, Call *c, plan, timers, double deadline,
                        const uint8_t[::1] cancel):
        """A stream's checks and its Call, read once from ``plan``; the per-chunk done
        flags it points into (None: an empty call, nothing set up). The plan keeps the
        arrays the Call points into alive: the caller holds it until the stream ends."""
        x, out = plan.x, plan.out
        cdef int16_t[::1] local = plan.local
        cdef int16_t[::1] agreed = plan.agreed
        cdef int16_t[::1] learn = plan.learn
        cdef int value_bits = plan.value_bits, call = plan.call, quorum = plan.quorum
        cdef Py_ssize_t ready = plan.ready
        cdef uint64_t ident = plan.ident
        cdef bint average = plan.average, nonfinite = plan.nonfinite, absent = plan.absent
        if x.dtype not in (np.float32, np.float64) or out.dtype != x.dtype:
            raise TypeError(f"the stream reduces float32 or float64 into the same dtype, "
                            f"not {x.dtype} into {out.dtype}")
        cdef int bits = value_bits or self.value_bits
        P.check_format(self.block, bits)
        cdef const uint8_t[::1] xin = x.view(np.uint8)
        cdef uint8_t[::1] xout = out.view(np.uint8)
        cdef Py_ssize_t size = x.size, k = self.k, g = self.groups, slots = self.slots
        cdef Py_ssize_t nb = (size + k - 1) // k
        if local.shape[0] != nb * g or agreed.shape[0] != nb * g:
            raise ValueError(f"{nb} chunks of {g} sub-blocks need {nb * g} exponents, got "
                             f"{local.shape[0]} local and {agreed.shape[0]} agreed")
        if nb == 0:
            return None
        if learn is not None and learn.shape[0] < 2 * slots * g:
            raise ValueError(f"learn holds {learn.shape[0]} exponents, not 2 x {slots} x "
                             f"{g}")
        if ident and quorum:
            raise ValueError("a predicted call is sync only (quorum 0)")
        if absent and not quorum:
            raise ValueError("a worker can be absent from a quorum call only (quorum > 0)")
        self._begin(c, timers, deadline, &self.stream_est, slots, nb, call)
        if c.est.srtt > 0:
            c.rto = c.est.rto
        c.retransmit = FLAG_RETRANSMIT
        c.asks = True
        c.quorum = quorum
        c.absent = absent
        c.ident = ident
        c.learn = &learn[0] if learn is not None else NULL
        c.x, c.out, c.size, c.nb, c.g = <const char *>&xin[0], <char *>&xout[0], size, nb, g
        c.fmt = Format(kind=KIND_F64 if x.dtype == np.float64 else KIND_F32, k=self.k,
                       b=self.block, bits=bits, n=self.n, average=average)
        c.local, c.agreed = &local[0], &agreed[0]
        done_arr = np.zeros(nb, np.uint8)
        cdef uint8_t[::1] done = done_arr
        c.done = &done[0]
        c.lazy.have = nb if ready < 0 else min(ready, nb)
        c.lazy.floor = ref_blockfp.EXPONENT_MIN[x.dtype]
        c.lazy.nonfinite = nonfinite
        c.lazy.flagged = self.flagged
        # A result proposing NONFINITE_MARK: some worker met a NaN or an Inf; its slot's
        # next chunk then goes with the dtype's largest exponent (every worker alike), its
        # values being discarded anyway.
        c.exponent_ceiling = <int16_t>(2 - c.lazy.floor)
        c.me = (<uint64_t>1) << (self.worker & 63)
        c.cancel = &cancel[0] if cancel is not None else NULL
        return done_arr

    cdef void _fresh_window(self):
        """Every slot free for a call's first use, nothing in flight (its version kept)."""
        cdef Py_ssize_t s
        cdef Slot *w
        self.npend = 0
        for s in range(self.slots):
            w = &self.window[s]
            w.chunk = -1
            w.adopted = 0
            fresh_use(w)

    cdef inline void _start_adopted(self, Py_ssize_t s) noexcept nogil:
        """The adopted call's first chunk for slot s (free now) written and queued."""
        cdef Call *nc = &self.next_call
        cdef Slot *w = &self.window[s]
        w.adopted = 1
        fresh_use(w)
        self._queue(nc, self._write_chunk(nc, s, nc.ident != 0))
        nc.sent += 1

    cdef Result _drive(self, Call *c, done_arr):
        """A stream whose first window is out, run to its end (``_run``): its Result. A
        call queued behind it is adopted in its drain, or dropped unstarted. None where
        the stream paused at its drain (``pause_due``)."""
        self.running = c
        self.pausing = False
        try:
            with nogil:
                self._run(c)
                # (complete before its loop ran: an adopted call whose results all
                # came in the last one's)
                if self.queued and c.draining and c.status == DONE and not c.stop:
                    self._adopt_queued()
        except BaseException:
            self.abandon()
            raise
        finally:
            self.running = NULL
            self.pause_due = False
            if self.queued:  # (this call ended before its drain: the next one not started)
                self.queued = False
                self.next_keep = None
        if self.pausing:
            self.pausing = False
            return None
        missing = (_NONE_MISSING if c.completed == c.nb
                   else np.flatnonzero(done_arr == 0))
        cdef Py_ssize_t s, nb = c.nb, slots = self.slots
        cdef Slot *w
        if c.quorum:  # every use of each slot passed at the switch, whoever sent it
            for s in range(min(slots, nb)):
                w = &self.window[s]
                w.version = use_version(w.first_version,
                                        s + slots * ((nb - s + slots - 1) // slots), slots)
        status = c.stop_status if c.status == DONE and c.stop else c.status
        return self._result(c, status, missing)

    def opening(self, int16_t[:, ::1] proposals, uint32_t ident_offset, int16_t ident_word,
                timers, double deadline, int call):
        """A call's opening (docs/protocol.md): one packet per slot of the call's first
        window (``proposals`` has a row per slot, slots 0 .. m - 1), each with no values
        (count 0) and G pairs: the call's identity (the packets' offset and
        every pair's exponent) and the proposals of the slot's first chunk of the call
        (``proposals``, S x G; PROPOSAL_NONE where the call has none). The aggregator
        keeps the max of the proposals and marks a cell whose packets' identities differ.
        On return ``proposals`` holds the max over the workers, the slots' versions have
        moved on one use of each of those slots (if every result came) and the openings'
        RTT estimate holds the samples taken. A result that says MISMATCH ends the
        opening at once: the workers may have opened different numbers of slots, and the
        caller starts a new epoch.

        Returns a Result: status DONE when every slot's result came and every identity
        was this worker's, OPEN_MISMATCH when a result said the workers' differ (the
        MISMATCH flag, or an identity not this worker's), else as stream's. Reliable as
        the stream is, by the same loop: a timer per slot resends the whole (small)
        packet, a NACK resends the packets it names, and the silence bound and the
        deadline end it. Ctrl-C ends it with KeyboardInterrupt."""
        cdef Py_ssize_t slots = proposals.shape[0], g = proposals.shape[1]
        cdef Py_ssize_t width = HEADER + PAIR * g, s
        if self.slots < slots or slots < 1 or g < 1 or width > RX_BYTES:
            raise ValueError(f"opening: {slots} x {g} proposals for {self.slots} slots")
        if width > self.row_width:
            raise ValueError("opening: scratch buffers too small")
        cdef Call c
        self._begin(&c, timers, deadline, &self.open_est, slots, slots, call)
        if c.est.rto > 0:
            c.rto = c.est.rto
        c.opening = True
        c.retransmit = FLAG_OPEN | FLAG_RETRANSMIT
        c.ident_offset, c.ident_word = ident_offset, ident_word
        c.proposals, c.g, c.width = &proposals[0, 0], g, width
        if self.has_next or self.is_paused:
            raise RuntimeError("a call is adopted or paused on this link: resume, proceed "
                               "or abandon it first")
        self._fresh_window()
        with nogil:
            for s in range(slots):
                self._queue(&c, self._write_opening(&c, s))
                if self.npend == INA_BATCH_MAX or s == slots - 1:
                    if self._flush(&c) < 0:
                        break
            self._run(&c)
        if c.completed == slots:
            for s in range(slots):
                self.window[s].version ^= 1
        status = OPEN_MISMATCH if c.status == DONE and c.stop else c.status
        return self._result(&c, status, np.zeros(0, np.int64))

    # -- what both share --------------------------------------------------------------

    cdef void _begin(self, Call *c, timers, double deadline, Estimator *est,
                     Py_ssize_t slots, Py_ssize_t total, int call):
        """A call's bounds from ``timers`` (link.Timers), its clocks started, its counts
        zero."""
        memset(c, 0, sizeof(Call))
        c.rto, c.rto_min, c.rto_max = timers.first, timers.least, timers.most
        c.silence, c.deadline, c.est = timers.silence, deadline, est
        c.slots, c.total, c.number = slots, total, call
        c.status, c.receive_call = DONE, CALL_RECVMMSG
        c.counted_all = ~(<uint64_t>0)
        c.start = monotonic()
        c.last_result = c.next_signal_check = c.start
        c.held = False

    cdef Result _result(self, Call *c, int status, missing):
        """The call's Result, its counts added to the link's: the failed system call's
        errno (a send's; a receive's if the call ended without its results)."""
        cdef int error = 0, failed = -1
        if c.failure:
            error, failed = c.failure, CALL_SEND
        elif c.receive_failure and c.status != DONE:
            error, failed = c.receive_failure, c.receive_call
        cdef Result r = Result.__new__(Result)
        counts_of(c, &r.n, monotonic() - c.start)
        add_counts(&self.counts, &r.n)
        r.status, r.missing, r.mode, r.error = status, missing, c.mode, error
        r.counted_all = c.counted_all
        r.counted_any = c.counted_any if c.counted_any else ~0  # (no result: nothing known)
        r.failed_call = CALLS[failed] if failed >= 0 else ""
        r.reason = ""
        return r

    cdef int _run(self, Call *c) except -1 nogil:
        """The loop of a stream and of an opening, once its first window is out: until
        every chunk (slot) has its result, or the bounds end it. Waits for what comes
        until the next timer (at most 20 ms: then Ctrl-C and ``cancel`` are looked at),
        takes each datagram (``_take``), sends the new packets that freed in one batch,
        and resends what timed out (``_timeouts``)."""
        cdef double now, next_timer
        cdef int wait_ms
        cdef Py_ssize_t nseg, i, s
        cdef Slot *w
        cdef bint idle
        cdef double looked = monotonic()
        while c.status == DONE and c.completed < c.total and not c.stop:
            now = monotonic()
            if now - looked > STALLED:
                # This process did not run meanwhile (stopped, descheduled): the silence
                # bound counts only the time it listened.
                c.last_result += now - looked
            looked = now
            if now >= c.next_signal_check:  # Ctrl-C ends the call (KeyboardInterrupt)
                c.next_signal_check = now + SIGNAL_CHECK
                with gil:
                    PyErr_CheckSignals()
                    if c.held and self.watch is not None and self.watch() is not None:
                        c.status = CANCELLED
                if c.status != DONE:
                    break
                if c.cancel != NULL and c.cancel[0]:
                    c.status = CANCELLED
                    break
            if now - c.start > c.deadline:
                c.status = PEER_LATE if c.held else TIMEOUT
                break
            next_timer = now + SIGNAL_CHECK
            for s in range(c.slots):
                w = &self.window[s]
                if w.chunk >= 0 and w.sent_at + w.timer < next_timer:
                    next_timer = w.sent_at + w.timer
            wait_ms = <int>((next_timer - now) * 1000) if next_timer > now else 0
            nseg = self._receive(c, wait_ms)
            now = monotonic()
            if now - looked > STALLED + wait_ms / 1000.0:  # (held in the wait itself)
                c.last_result += now - looked - wait_ms / 1000.0
            looked = now
            for i in range(nseg):
                self._take(c, self.seg_ptr[i], self.seg_len[i], now)
                if c.status != DONE or c.stop:
                    break
            # The silence bound, once what has come is taken: a rank the machine held up
            # past the bound (stopped, descheduled) finds the results queued meanwhile
            # before it calls the aggregator dead.
            if c.status == DONE and not c.stop:
                c.status = bounds_passed(now, c.start, c.deadline, c.last_result,
                                         c.silence)
                if c.status == TIMEOUT and c.held:
                    c.status = PEER_LATE
                if c.status != DONE:
                    break
            if c.lost and c.quorum:  # nothing in flight, nothing to send: the rest is gone
                idle = True
                for s in range(c.slots):
                    if self.window[s].chunk >= 0:
                        idle = False
                        break
                if idle and self.npend == 0:
                    c.status = LOST
                    break
            # The new packets this batch of results freed: out in one go.
            if c.status == DONE and self.npend:
                self._flush(c)
            self._timeouts(c, now)
            if c.status == DONE and self.npend:  # (the next chunks of slots given up)
                self._flush(c)
            if c.draining and c.status == DONE:
                if self.queued:
                    self._adopt_queued()  # (once: the call queued behind this one)
                elif self.pause_due:  # (once: back to the caller, to learn the next)
                    self.pause_due = False
                    self.pausing = True
                    break
        return 0

    cdef Py_ssize_t _receive(self, Call *c, int wait_ms) noexcept nogil:
        """What has come on the socket, waiting up to ``wait_ms`` if nothing has: up to
        BATCH buffers, each split into its datagrams (UDP_GRO may bring several results
        back to back) in seg_ptr / seg_len; their number. A failed receive or poll leaves
        its errno in the call's ``receive_failure`` and the call (CALLS) in
        ``receive_call``."""
        cdef int got, i, n_in
        cdef Py_ssize_t nseg = 0
        prepare_receive(self.msgs, self.iovs, self.rx, RX_BYTES, BATCH, NULL)
        ina_attach_controls(self.msgs, self.controls, INA_GRO_CONTROL, BATCH)
        got = recvmmsg(self.fd, self.msgs, BATCH, MSG_DONTWAIT, NULL)
        if got < 0 and not try_again(errno):
            c.receive_failure, c.receive_call = errno, CALL_RECVMMSG
        if got <= 0:
            if wait_ms > 0 and poll(&self.pfd, 1, wait_ms) < 0 and not try_again(errno):
                c.receive_failure, c.receive_call = errno, CALL_POLL
            got = 0
        for i in range(got):
            n_in = ina_segments(&self.msgs[i].msg_hdr, self.rx + i * RX_BYTES,
                                self.msgs[i].msg_len, &self.seg_ptr[nseg],
                                &self.seg_len[nseg], SEGMENTS - nseg)
            c.gro_buffers += n_in > 1
            nseg += n_in
        return nseg

    cdef void _take(self, Call *c, const uint8_t *pkt, Py_ssize_t length,
                    double now) noexcept nogil:
        """One datagram received: stale if not of this job and epoch, a NACK, or a
        result (the stream's or the opening's)."""
        if length < HEADER:
            if c.opening:
                c.stale += 1
            else:
                c.rejected += 1
            return
        if get16(pkt + OFF_JOB) != self.job or get16(pkt + OFF_EPOCH) != <uint16_t>self._epoch:
            c.stale += 1
            return
        if pkt[OFF_FLAGS] & FLAG_NACK:
            self._nacked(c, pkt, now)
        elif c.opening:
            self._opening_result(c, pkt, length, now)
        else:
            self._stream_result(c, pkt, length, now)

    cdef inline Call *_owner(self, Call *c, Py_ssize_t s) noexcept nogil:
        """The call slot s's packet in flight is of: the adopted one, or ``c``."""
        return &self.next_call if self.window[s].adopted else c

    cdef void _nacked(self, Call *c, const uint8_t *pkt, double now) noexcept nogil:
        """Packets the aggregator never saw (a NACK names their numbers): resent now,
        without backing off."""
        cdef Py_ssize_t first = pkt[OFF_SEQ], count = get16(pkt + OFF_COUNT), s
        cdef Slot *w
        cdef Call *o
        if count == 0:
            # Held: the aggregator has this worker's resent packet and waits for a peer's
            # (a stopped or slow rank). It is alive: a stream's silence bound waits on;
            # the call's deadline, and a peer's failure (``watch``), still end the wait.
            # Not an opening's: a peer that could not finish its last call waits for
            # this rank at the error path's gate, which an opening that fails by the
            # silence bound reaches (docs/protocol.md, The error path).
            if not c.opening:
                c.last_result = now
                c.held = True
            return
        c.nacks += 1
        self.nacking = True
        for s in range(c.slots):
            w = &self.window[s]
            if w.chunk >= 0 and ((w.seq - first) & 255) < count:
                o = self._owner(c, s)
                if self._resend(o, s) < 0:
                    return
                w.resent = 1
                w.sent_at = now
                o.nacked += 1

    cdef void _timeouts(self, Call *c, double now) noexcept nogil:
        """Retransmit what timed out, backing off; new chunks start from the backed-off
        timeout until a sample says otherwise (RFC 6298 5.5-5.7). With an aggregator
        that NACKs, a stream's first timeout of a packet asks for its result with a
        header alone: had the packet been lost, it would most likely have been NACKed, so
        another worker's packet is missing (that worker is NACKed) or the result was
        lost. Only the next timeout resends the whole packet: a lost packet stalls every
        worker's timer, and n full resends where one is needed were most of the bytes
        loss cost (docs/reliability.md). An opening's packets are small: resent whole."""
        cdef Py_ssize_t s, nxt, slots = c.slots
        cdef Slot *w
        cdef Call *o
        for s in range(slots):
            w = &self.window[s]
            o = self._owner(c, s)  # (the adopted call's slots time out alike)
            if (c.status == DONE and o.status == DONE and not o.stop and w.chunk >= 0
                    and now - w.sent_at >= w.timer):
                if o.quorum and w.tries >= QUORUM_TRIES and self.npend < INA_BATCH_MAX:
                    o.lost += 1  # given up: on with the slot's next chunk not had
                    nxt = next_undone(o.done, max(w.chunk, w.latest) + slots, o.nb, slots)
                    w.chunk = -1
                    if nxt < o.nb:
                        w.version = use_version(w.first_version, nxt, slots)
                        self._queue(o, self._write_chunk(o, nxt, False))
                        o.sent += 1
                    continue
                w.tries += 1
                if o.asks and self.nacking and not w.asked:
                    if self._request(o, s) < 0:
                        break
                    w.asked = 1
                    o.requests += 1
                else:
                    if self._resend(o, s) < 0:
                        break
                    o.retransmitted += 1
                w.resent = 1
                w.sent_at = now
                w.overtaken = 0
                # (at most half the silence bound: a switch that holds the packet for a
                # late peer says so to a resend, and the bound must see one first)
                w.timer = min(w.timer * 2, o.rto_max, o.silence / 2)
                o.rto = max(o.rto, w.timer)

    cdef inline void _queue(self, Call *c, Py_ssize_t s) noexcept nogil:
        """Slot s's new packet into the next batch (``_flush`` sends it). A worker absent
        from the call sends nothing new: the results come to it multicast, and a timeout
        asks for one (an answer to a request sent at once would double its downlink's
        bytes, as answering a quorum's late first copies did: docs/quorum.md)."""
        if c.absent:
            return
        self.pend_bufs[self.npend] = self.rows + s * self.row_width
        self.pend_lens[self.npend] = self.window[s].length
        self.npend += 1

    cdef int _flush(self, Call *c) noexcept nogil:
        """The batch out, in one system call per run of equal-sized packets; -1 (the
        call SEND_FAILED) if a send failed."""
        if ina_send_batch(self.fd, &self.to, self.pend_bufs, self.pend_lens, self.npend,
                          &self.gso, &c.send_calls, &c.refused) < 0:
            c.status, c.failure = SEND_FAILED, errno
            return -1
        self.npend = 0
        return 0

    cdef int _resend(self, Call *c, Py_ssize_t s) noexcept nogil:
        """Send slot s's packet again, marked as a retransmission; -1 (the call
        SEND_FAILED) if sendto failed."""
        cdef uint8_t *row = self.rows + s * self.row_width
        row[OFF_FLAGS] = c.retransmit | (FLAG_PREDICTED if self.window[s].predicted else 0)
        if sendto(self.fd, row, self.window[s].length, 0, <const sockaddr *>&self.to,
                  sizeof(sockaddr_in)) < 0:
            return self._refused(c)
        return 0

    cdef int _request(self, Call *c, Py_ssize_t s) noexcept nogil:
        """Ask for slot s's result with its packet's header alone (a result request:
        count 0, RETRANSMIT); -1 (the call SEND_FAILED) if sendto failed."""
        memcpy(self.request, self.rows + s * self.row_width, HEADER)
        self.request[OFF_FLAGS] = FLAG_RETRANSMIT
        put16(self.request + OFF_COUNT, 0)
        if sendto(self.fd, self.request, HEADER, 0, <const sockaddr *>&self.to,
                  sizeof(sockaddr_in)) < 0:
            return self._refused(c)
        return 0

    cdef int _refused(self, Call *c) noexcept nogil:
        """A sendto just failed: a datagram refused for want of room (ENOBUFS, EAGAIN) is
        lost, as on a link, and its timer sends it again (0); any other errno ends the
        call (SEND_FAILED, -1)."""
        if ina_send_no_room(errno):
            c.refused += 1
            return 0
        c.status, c.failure = SEND_FAILED, errno
        return -1

    cdef inline void _numbered(self, Py_ssize_t s, double rto) noexcept nogil:
        """Slot s's new packet numbered and its clocks started."""
        self.rows[s * self.row_width + OFF_SEQ] = self._next_packet
        self.window[s].seq = self._next_packet
        self._next_packet += 1
        self._clocks(s, rto)

    cdef inline void _clocks(self, Py_ssize_t s, double rto) noexcept nogil:
        """Slot s's packet's clocks started (its timeout ``rto``)."""
        cdef Slot *w = &self.window[s]
        w.overtaken = 0
        w.sent_at = monotonic()
        w.born = w.sent_at
        w.resent = 0
        w.timer = rto

    # -- a stream ---------------------------------------------------------------------

    cdef Py_ssize_t _write_chunk(self, Call *c, Py_ssize_t chunk, bint predicted
                                 ) noexcept nogil:
        """Write chunk ``chunk``'s packet into its slot's row and start its clocks; the
        slot. The caller sends it, with the others of its batch (``_queue``). In a
        quorum call, a chunk whose values need larger exponents than those agreed
        becomes a result request, its header alone: clipped values would spoil the
        sum. ``predicted``: a predicted call's first try of a first-window chunk (its
        exponents, per sub-block, the larger of the prediction and its own; flagged
        PREDICTED, the identity in contributors). A first-window chunk of a call that
        learns, if it is its slot's last, proposes its slot's first chunk's exponents."""
        cdef Py_ssize_t slots = self.slots, k = self.k, g = c.g, nb = c.nb, j
        cdef Py_ssize_t s = chunk % slots, size = c.size
        cdef Py_ssize_t blocks = (min(k, size - chunk * k) + self.block - 1) // self.block
        cdef bint fits = True
        cdef Py_ssize_t start, width = kind_itemsize(c.fmt.kind)
        cdef uint8_t *row = self.rows + s * self.row_width
        cdef Lazy *lazy = &c.lazy
        while lazy.have < nb and lazy.have <= chunk + slots:  # its own and the proposals'
            start = lazy.have * k
            if chunk_proposals(c.x + start * width, min(k, size - start), c.fmt.kind,
                               self.block, lazy.floor, g, &c.local[lazy.have * g]):
                lazy.nonfinite = True
            lazy.have += 1
        if c.absent:
            fits = False
        elif c.quorum:
            for j in range(blocks):
                if c.local[chunk * g + j] > c.agreed[chunk * g + j]:
                    fits = False
                    break
        cdef const int16_t *exponents = &c.agreed[chunk * g] if fits else &c.local[chunk * g]
        cdef const int16_t *proposals = (
            lazy.flagged if lazy.nonfinite and not c.quorum else
            &c.local[(chunk + slots) * g] if chunk + slots < nb else NULL)
        cdef int16_t *mine
        if c.learn != NULL and chunk + slots >= nb and proposals != lazy.flagged:
            # (what the next call with this identity predicts from: see ``learn``)
            proposals = &c.local[(chunk % slots) * g]
        if predicted:
            mine = self.scratch
            for j in range(blocks):
                mine[j] = max(c.agreed[chunk * g + j], c.local[chunk * g + j])
            exponents = mine
        cdef Stamp h = Stamp(slot=<uint32_t>s, slot_version=self.window[s].version,
                             job=self.job, worker=self.worker,
                             flags=FLAG_PREDICTED if predicted else 0, epoch=self._epoch,
                             call=c.number, quorum=c.quorum)
        self.window[s].length = <int32_t>write_packet(row, c.x, size, &c.fmt, chunk,
                                                      exponents, proposals, &h)
        if predicted:
            put64(row + OFF_CONTRIBUTORS, c.ident)
        self.window[s].predicted = predicted
        if not fits:
            row[OFF_FLAGS] = FLAG_RETRANSMIT
            put16(row + OFF_COUNT, 0)
            self.window[s].length = <int32_t>HEADER
            c.skipped += 1
        if chunk + 1 < nb:  # the next new packet's values, from memory meanwhile
            ina_prefetch(c.x + (chunk + 1) * k * width, min(k, size - (chunk + 1) * k) * width,
                         0)
        if c.absent:  # (never sent as new: no packet number, only its clocks: _queue)
            self.rows[s * self.row_width + OFF_SEQ] = self._next_packet - 1
            self._clocks(s, c.rto)
        else:
            self._numbered(s, c.rto)
        self.window[s].chunk = chunk
        self.window[s].tries = 0
        return s

    cdef void _stream_result(self, Call *c, const uint8_t *pkt, Py_ssize_t length,
                             double now) noexcept nogil:
        """A stream's result, for the call its slot's packet in flight is of (``adopt``:
        the running one or the adopted one)."""
        cdef uint32_t s = get32(pkt + OFF_SLOT)
        if s < <uint32_t>self.slots and self.window[s].adopted:
            self._apply_result(&self.next_call, pkt, length, now)
        else:
            self._apply_result(c, pkt, length, now)

    cdef void _apply_result(self, Call *c, const uint8_t *pkt, Py_ssize_t length,
                            double now) noexcept nogil:
        """A result of call ``c``: applied to the output once (else stale, or rejected if
        malformed), the RTT sampled, the slot's next chunk written and queued; a slot
        done with the running call takes the adopted call's first chunk for it."""
        cdef Py_ssize_t slots = self.slots, k = self.k, g = c.g, nb = c.nb, j, q
        cdef Py_ssize_t s = get32(pkt + OFF_SLOT), offset = get32(pkt + OFF_OFFSET)
        cdef Py_ssize_t chunk = offset // k, nxt
        cdef int ver = pkt[OFF_SLOT_VERSION]
        cdef uint64_t counted
        cdef int64_t announced
        cdef double sent_last
        cdef Slot *w
        cdef int flags = pkt[OFF_FLAGS]
        if (flags & FLAG_MISMATCH and not c.quorum and s < slots
                and self.window[s].chunk >= 0 and ver == self.window[s].version
                and not flags & FLAG_CONTROL):
            # The ranks called differently (a marked cell may name another worker's call,
            # offset or count: the slot and version are what say it is this packet's).
            c.stop, c.stop_status = True, MISMATCHED
            c.last_result = now
            return
        if (s >= slots or chunk >= nb or c.done[chunk] or chunk % slots != s
                or get16(pkt + OFF_CALL) != <uint16_t>c.number
                or flags & FLAG_CONTROL):
            c.stale += 1
            return
        w = &self.window[s]
        if flags & FLAG_OVERFLOW:
            if not (w.predicted and w.chunk == chunk and ver == w.version
                    and get16(pkt + OFF_BLOCKS) == (min(k, c.size - chunk * k)
                                                    + self.block - 1) // self.block):
                c.stale += 1
                return
            # Some worker's values did not fit the prediction: the chunk again, as an
            # ordinary one in the slot's other version, with the max exponents.
            for j in range(get16(pkt + OFF_BLOCKS)):
                c.agreed[chunk * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j)
            c.overflows += 1
            c.last_result = now
            w.chunk = -1
            w.asked = 0
            w.version ^= 1
            self._queue(c, self._write_chunk(c, chunk, False))
            c.sent += 1
            if self.npend == INA_BATCH_MAX:
                self._flush(c)
            return
        if not ((w.chunk == chunk and ver == w.version)
                or (c.quorum and chunk > w.chunk and chunk > w.latest
                    and ver == use_version(w.first_version, chunk, slots))):
            c.stale += 1
            return
        if parse_result(pkt, length, c.out, c.size, &c.fmt, self.job, -32767,
                        32767) != PARSE_OK:
            c.rejected += 1
            return
        c.done[chunk] = 1
        c.completed += 1
        if c.learn != NULL:
            if chunk < slots:
                for j in range(get16(pkt + OFF_BLOCKS)):
                    c.learn[chunk * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j)
            if chunk + slots >= nb:
                for j in range(get16(pkt + OFF_BLOCKS)):
                    c.learn[(slots + s) * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j + 2)
        if chunk + 1 < nb:  # where the next result goes, fetched meanwhile
            ina_prefetch(c.out + (chunk + 1) * k * kind_itemsize(c.fmt.kind),
                         min(k, c.size - (chunk + 1) * k) * kind_itemsize(c.fmt.kind), 1)
        counted = get64(pkt + OFF_CONTRIBUTORS)
        if counted:  # (an aggregator that names none counted all)
            c.counted_all &= counted
            c.left_out += not (counted & c.me)
        c.counted_any |= counted if counted else ~(<uint64_t>0)
        announced = (<int64_t>get32(pkt + OFF_MODE_GENERATION) << 8
                     | pkt[OFF_MODE_QUORUM])
        if announced > c.mode:
            c.mode = announced
        c.last_result = now
        if w.chunk == chunk and not w.resent:
            rtt_sample(c.est, now - w.born, c.rto_min, c.rto_max)
            c.rto = c.est.rto
            c.samples += 1
        if c.quorum:
            if chunk > w.latest:
                w.latest = chunk
            if w.chunk != chunk:  # a later chunk of the slot, passing by
                if w.chunk < 0 or w.chunk + 2 * slots > w.latest:
                    return  # (the one in flight may still be answered)
                c.lost += 1  # its cell holds a later chunk now: gone
            # On from the latest result, past chunks already had.
            nxt = next_undone(c.done, w.latest + slots, nb, slots)
            w.chunk = -1
            w.asked = 0
            if nxt >= nb:
                return
            w.version = use_version(w.first_version, nxt, slots)
            chunk = nxt - slots  # (sent below, as the slot's next)
        else:
            w.chunk = -1
            w.asked = 0
            w.version ^= 1
        if self.nacking:  # results of earlier packets still missing: ask for them
            sent_last = w.sent_at
            for q in range(slots):
                if self.window[q].chunk < 0 or self.window[q].sent_at >= sent_last:
                    continue
                self.window[q].overtaken += 1
                if self.window[q].overtaken == OVERTAKEN:
                    self.window[q].overtaken = ASKED
                    if self._request(self._owner(c, q), q) < 0:
                        return
                    self.window[q].resent = 1  # Karn: its round trip is no sample now
                    self._owner(c, q).requests += 1
        if <int16_t>get16(pkt + HEADER + 2) == NONFINITE_MARK:
            c.nonfinite_seen = True
        nxt = chunk + slots
        if nxt < nb:  # its exponents: the max proposals the result carries
            if not c.quorum:  # (a quorum's: agreed already)
                for j in range(get16(pkt + OFF_BLOCKS)):
                    c.agreed[nxt * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j + 2)
                    if c.agreed[nxt * g + j] == NONFINITE_MARK:
                        c.agreed[nxt * g + j] = c.exponent_ceiling
            self._queue(c, self._write_chunk(c, nxt, False))
            c.sent += 1
            if self.npend == INA_BATCH_MAX:
                self._flush(c)
            return
        c.draining = True  # (the slot's last chunk of the call)
        if self.has_next and not w.adopted and s < self.next_call.nb:
            self._start_adopted(s)  # the next call's first chunk for it, at once
            if self.npend == INA_BATCH_MAX:
                self._flush(c)

    # -- an opening -------------------------------------------------------------------

    cdef Py_ssize_t _write_opening(self, Call *c, Py_ssize_t s) noexcept nogil:
        """Slot s's opening packet into its row, its clocks started; the slot."""
        cdef uint8_t *row = self.rows + s * self.row_width
        cdef Py_ssize_t j, g = c.g
        row[OFF_VERSION] = VERSION
        row[OFF_FLAGS] = FLAG_OPEN
        put16(row + OFF_JOB, self.job)
        put16(row + OFF_WORKER, self.worker)
        row[OFF_SLOT_VERSION] = self.window[s].version
        put32(row + OFF_SLOT, <uint32_t>s)
        put32(row + OFF_OFFSET, c.ident_offset)
        put16(row + OFF_COUNT, 0)
        put16(row + OFF_BLOCKS, <uint16_t>g)
        row[OFF_VALUE_BITS] = self.value_bits
        row[OFF_BLOCK] = self.block
        put16(row + OFF_EPOCH, <uint16_t>self._epoch)
        put16(row + OFF_CALL, <uint16_t>c.number)
        row[OFF_QUORUM] = 0
        row[OFF_MODE_QUORUM] = 0
        put32(row + OFF_MODE_GENERATION, 0)
        put64(row + OFF_CONTRIBUTORS, 0)
        for j in range(g):
            put16(row + HEADER + PAIR * j, <uint16_t>c.ident_word)
            put16(row + HEADER + PAIR * j + 2, <uint16_t>c.proposals[s * g + j])
        self.window[s].length = <int32_t>c.width
        self._numbered(s, c.rto)
        self.window[s].chunk = s
        self.window[s].tries = 0
        self.window[s].asked = 0
        return s

    cdef void _opening_result(self, Call *c, const uint8_t *pkt, Py_ssize_t length,
                              double now) noexcept nogil:
        """An opening's result: the max proposals of its slot (else stale); a MISMATCH,
        or an identity not this worker's, ends the opening."""
        cdef Py_ssize_t s = get32(pkt + OFF_SLOT), j, g = c.g
        cdef int flags = pkt[OFF_FLAGS]
        cdef bint mismatch = False
        cdef Slot *w
        if (not (flags & FLAG_RESULT) or flags & FLAG_CONTROL
                or s >= c.slots or self.window[s].chunk < 0
                or pkt[OFF_SLOT_VERSION] != self.window[s].version):
            c.stale += 1
            return
        if flags & FLAG_MISMATCH:  # (whatever its shape: a predicted use may have met it)
            self.window[s].chunk = -1
            c.completed += 1
            c.last_result = now
            c.stop = True
            return
        if (not (flags & FLAG_OPEN) or get16(pkt + OFF_CALL) != <uint16_t>c.number
                or length != c.width or get16(pkt + OFF_BLOCKS) != g):
            # (a marked result may name another worker's call number: the first packet's)
            c.stale += 1
            return
        w = &self.window[s]
        if flags & FLAG_MISMATCH or get32(pkt + OFF_OFFSET) != c.ident_offset:
            mismatch = True
        for j in range(g):
            if <int16_t>get16(pkt + HEADER + PAIR * j) != c.ident_word:
                mismatch = True
            c.proposals[s * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j + 2)
        w.chunk = -1
        c.completed += 1
        c.last_result = now
        if mismatch:  # (the others' slots may never complete: no need)
            c.stop = True
            return
        if not w.resent:
            rtt_sample(c.est, now - w.born, c.rto_min, c.rto_max)
            c.samples += 1
