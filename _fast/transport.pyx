# cython: language_level=3
"""The worker's data path: a tensor streamed through the aggregator, windowed and reliable.

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
sample. The estimate lives in the caller's array, so it carries over from one call to
the next (the link keeps one for its streams and one for its openings, whose small
packets meet no queue).

Each new packet carries the worker's packet number (seq, mod 256, counted across calls);
the software aggregator NACKs numbers it never saw, and the packets in flight with those
numbers are resent at once, without backing off: only the worker whose packet was lost
resends, before the timeouts of the others fire (a P4 switch sends no NACKs; there the
timers recover). With an aggregator that answers them (its join or probe reply says so,
or it has sent a NACK), a packet in flight that OVERTAKEN results of later packets have
passed asks for its result again with a header alone (a result request), once until it
is sent again: its result was lost on the way back, or another worker's packet was (then
the request is ignored, and that worker NACKed). The first timeout of a packet asks the
same way; full resends are left to the second and later timeouts.

In a quorum call (``quorum`` k > 0, docs/quorum.md) a chunk completes when k workers
contributed: a result may not count this worker (its contributors say who was counted,
and an AVERAGE divides by their number). Every chunk's exponents are agreed before a
quorum call starts (a result's proposals are those of the workers it counted, which a
left-out worker's values need not fit). Should its values not fit all the same, a worker
sends that chunk's header alone (a result request) instead of clipped values, and is
left out of the chunk.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

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
                        ina_segments, ina_send_batch)

cdef enum:
    BATCH = 32
    SEGMENTS = BATCH * 64  # datagrams one receive may bring with UDP_GRO (64 per buffer)

# RTT estimator state, in the caller's float64 array: SRTT (0: no sample yet), RTTVAR, RTO.
cdef enum:
    SRTT, RTTVAR, RTO

cdef double GRANULARITY = 0.001     # poll() waits in whole milliseconds
# The RTO is at least (1 + AGGREGATION_MARGIN) x SRTT. The aggregator answers a packet
# only when every worker's packet of its chunk is in, as a delayed ACK answers late (QUIC
# bounds that with max_ack_delay). Against a slow target (BMv2) the round trip is mostly
# its queue of n x S packets: steady, so RTTVAR shrinks to a fraction of a millisecond,
# and a timer at SRTT + 4 RTTVAR fired on the queue's ordinary swings; each needless
# result request then lengthened that queue (13% of the packets asked again at 4,000
# packets a second, n = 4, S = 8; none with the margin: docs/reliability.md).
cdef double AGGREGATION_MARGIN = 0.5
cdef double SIGNAL_CHECK = 0.02     # the GIL is taken this often to see Ctrl-C
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


cdef inline void rtt_sample(double *state, double r, double rto_min,
                            double rto_max) noexcept nogil:
    """RFC 6298 section 2 with alpha 1/8, beta 1/4; the RTO at least 3/2 SRTT."""
    if state[SRTT] <= 0:
        state[SRTT] = r
        state[RTTVAR] = r / 2
    else:
        state[RTTVAR] = (0.75 * state[RTTVAR]
                         + 0.25 * (state[SRTT] - r if state[SRTT] > r else r - state[SRTT]))
        state[SRTT] = 0.875 * state[SRTT] + 0.125 * r
    state[RTO] = max(state[SRTT] + max(GRANULARITY, 4 * state[RTTVAR]),
                     (1 + AGGREGATION_MARGIN) * state[SRTT])
    state[RTO] = min(max(state[RTO], rto_min), rto_max)


cdef inline int use_version(const uint8_t[::1] v0, Py_ssize_t c, Py_ssize_t slots
                            ) noexcept nogil:
    """The slot version chunk c uses: its slot's first chunk used v0[c mod S], and each
    later use of the slot the other one."""
    return v0[c % slots] ^ ((c // slots) & 1)


cdef inline Py_ssize_t next_undone(const uint8_t[::1] done, Py_ssize_t c, Py_ssize_t nb,
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


cdef Py_ssize_t receive(int fd, mmsghdr *msgs, iovec *iovs, char *controls, uint8_t *rx,
                        int nrx, int wait_ms, pollfd *pfd, uint8_t **seg_ptr,
                        int32_t *seg_len, Py_ssize_t *gro_buffers, int *failure,
                        int *failed_call) noexcept nogil:
    """What has come on fd, waiting up to ``wait_ms`` if nothing has: up to ``nrx``
    buffers of 65,536 bytes at ``rx``, each split into its datagrams (UDP_GRO may bring
    several results back to back) in seg_ptr / seg_len; their number. A failed receive
    or poll leaves its errno in ``failure`` and the call (CALLS) in ``failed_call``."""
    cdef int got, i, n_in
    cdef Py_ssize_t nseg = 0
    prepare_receive(msgs, iovs, rx, 65536, nrx, NULL)
    ina_attach_controls(msgs, controls, INA_GRO_CONTROL, nrx)
    got = recvmmsg(fd, msgs, nrx, MSG_DONTWAIT, NULL)
    if got < 0 and not try_again(errno):
        failure[0], failed_call[0] = errno, CALL_RECVMMSG
    if got <= 0:
        if wait_ms > 0 and poll(pfd, 1, wait_ms) < 0 and not try_again(errno):
            failure[0], failed_call[0] = errno, CALL_POLL
        got = 0
    for i in range(got):
        n_in = ina_segments(&msgs[i].msg_hdr, rx + i * 65536, msgs[i].msg_len,
                            &seg_ptr[nseg], &seg_len[nseg], SEGMENTS - nseg)
        gro_buffers[0] += n_in > 1
        nseg += n_in
    return nseg


def rtt_update(double[::1] state, double sample, double rto_min, double rto_max):
    """One round-trip sample into state [SRTT, RTTVAR, RTO] (for tests); the new RTO."""
    rtt_sample(&state[0], sample, rto_min, rto_max)
    return state[RTO]


# What stream() returns as its first value.
cdef enum:
    DONE, SILENT, TIMEOUT, SEND_FAILED, CANCELLED, LOST
STATUS = ("done", "no result within the silence bound (the aggregator or a peer stopped)",
          "the operation's deadline passed", "a send failed",
          "cancelled (another part of the call was interrupted)",
          "done but for chunks whose results the switch no longer holds (quorum: the "
          "others had moved their cells on)")
COMPLETE = (DONE, LOST)  # what ended without a failure (LOST: ``missing`` says what)

# The system call whose errno an unfinished stream reports: counters["errno"] and
# counters["call"] (an index of CALLS). A send's ends the stream (SEND_FAILED); a receive
# failure does not, but is reported if the stream then ends without its results.
cdef enum:
    CALL_SEND, CALL_RECVMMSG, CALL_POLL
CALLS = ("send", "recvmmsg", "poll")


def stream_scratch(Py_ssize_t slots, Py_ssize_t width):
    """Buffers a stream of up to ``slots`` slots and ``width``-byte packets may reuse
    (``stream``'s ``scratch``): the packets in flight, and the receive buffers."""
    return np.empty((slots, width), np.uint8), np.empty((BATCH, 65536), np.uint8)


def stream(int fd, uint32_t switch_addr_be, uint16_t switch_port_be, x, out,
           int16_t[::1] local, int16_t[::1] agreed, uint8_t[::1] versions,
           int n, Py_ssize_t k, int job, int worker, bint average,
           double rto, double rto_min, double rto_max, double silence, double deadline,
           double[::1] rtt, int epoch=0, uint8_t[::1] seq=None,
           Py_ssize_t block=P.DEFAULT_BLOCK, int value_bits=32,
           uint8_t[::1] send_state=None, const uint8_t[::1] cancel=None, int call=0,
           int quorum=0, Py_ssize_t ready=-1, scratch=None):
    """Allreduce x (1-D float32/float64) into out through the aggregator.

    local: this worker's sub-block exponents (G = ceil(K / block) per chunk); agreed: the
    first window's agreed exponents (the rest are filled in from results); versions: each
    slot's next version, updated.
    rto: the timeout until the first sample; rtt: [SRTT, RTTVAR, RTO], updated (zeros:
    no estimate yet). epoch: this run's epoch, in every packet; results of another epoch
    are stale. seq: [the number of this worker's next new packet, 1 if the aggregator
    NACKs (CAP_NACKS)], updated (None: zeros). block, value_bits: the job's format.
    send_state: [1 while UDP_SEGMENT may be used, else 0 (sendmmsg)], updated when the
    kernel refuses the offload (None: [1]). New packets leave in batches: all those a
    batch of results frees, in one system call per run of equal-sized packets.
    cancel: [0], set to 1 by another thread to end the stream (CANCELLED) within 20 ms
    (a call striped over several aggregators streams each part in a thread of its own).
    scratch: buffers from ``stream_scratch``, reused (None: new ones).
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
    Returns (status, counters dict, chunks not completed as an array). The counters
    include "left_out" (results that did not count this worker), "skipped" (chunks whose
    values did not fit the exponents agreed without it: a header sent alone),
    "counted_all" (the workers every result counted, a bitmap; all ones if no result came),
    "counted_any" (those some result counted) and "mode" (the largest mode generation << 8
    | mode quorum the results announced). A stream that did
    not finish because a system call failed (or after receiving failed) has that call's
    errno in counters["errno"] and the call in counters["call"] (an index of CALLS).
    """
    if x.dtype not in (np.float32, np.float64) or out.dtype != x.dtype:
        raise TypeError(f"the stream reduces float32 or float64 into the same dtype, not "
                        f"{x.dtype} into {out.dtype}")
    cdef Kind kind = KIND_F64 if x.dtype == np.float64 else KIND_F32
    cdef const uint8_t[::1] xin = x.view(np.uint8)
    cdef uint8_t[::1] xout = out.view(np.uint8)
    cdef Py_ssize_t size = x.size
    P.check_format(block, value_bits)
    cdef Py_ssize_t g = P.sub_blocks(k, block)
    cdef Py_ssize_t nb = (size + k - 1) // k, slots = versions.shape[0]
    cdef Lazy lazy
    lazy.have = nb if ready < 0 else min(ready, nb)
    lazy.floor = ref_blockfp.EXPONENT_MIN[x.dtype]
    lazy.nonfinite = False
    flagged_arr = np.full(max(P.sub_blocks(k, block), 1), P.NONFINITE_MARK, np.int16)
    cdef int16_t[::1] flagged_view = flagged_arr
    lazy.flagged = &flagged_view[0]
    # A result proposing NONFINITE_MARK: some worker met a NaN or an Inf; its slot's next
    # chunk then goes with the dtype's largest exponent (every worker alike), its values
    # being discarded anyway.
    cdef int16_t exponent_ceiling = <int16_t>(2 - lazy.floor)
    cdef bint nonfinite_seen = False
    if local.shape[0] != nb * g or agreed.shape[0] != nb * g:
        raise ValueError(f"{nb} chunks of {g} sub-blocks need {nb * g} exponents, got "
                         f"{local.shape[0]} local and {agreed.shape[0]} agreed")
    cdef Py_ssize_t width = P.packet_bytes(k, block, value_bits), i, c, s, j
    # The packet in flight per slot, and the receive buffers: the caller's (``scratch``,
    # kept from call to call: allocating 2 MiB for each call cost more than a small
    # call's stream), else new ones.
    if (scratch is None or scratch[0].shape[0] < slots or scratch[0].shape[1] < width
            or scratch[1].shape[0] < BATCH or scratch[1].shape[1] != 65536):
        scratch = stream_scratch(slots, width)
    ring, inbox = scratch
    cdef uint8_t[:, ::1] rows = ring
    cdef uint8_t[:, ::1] rx = inbox
    inflight_arr = np.full(slots, -1, np.int64)
    cdef int64_t[::1] inflight = inflight_arr
    cdef double[::1] sent_at = np.zeros(slots)
    cdef double[::1] timer = np.full(slots, rto)
    cdef double[::1] born = np.zeros(slots)              # first send of the slot's chunk
    cdef uint8_t[::1] resent = np.zeros(slots, np.uint8)  # Karn: no sample if set
    cdef double *est = &rtt[0]
    if est[SRTT] > 0:
        rto = est[RTO]
    cdef int32_t[::1] lengths = np.zeros(slots, np.int32)
    if send_state is None:
        send_state = np.ones(1, np.uint8)
    cdef int gso = send_state[0]
    cdef long send_calls = 0
    cdef uint8_t *pend_bufs[INA_BATCH_MAX]   # new packets not sent yet (flush_new)
    cdef int32_t pend_lens[INA_BATCH_MAX]
    cdef int npend = 0
    if seq is None:
        seq = np.zeros(2, np.uint8)
    cdef uint8_t *next_seq = &seq[0]
    cdef uint8_t *nacking = &seq[1]
    cdef int32_t[::1] overtaken = np.zeros(slots, np.int32)  # results of later packets
    cdef uint8_t request[64]
    cdef uint8_t[::1] asked = np.zeros(slots, np.uint8)  # a timeout sent a request
    cdef Py_ssize_t requests = 0, q
    cdef double sent_last
    cdef uint8_t[::1] slot_seq = np.zeros(slots, np.uint8)  # the number of each's packet
    cdef Py_ssize_t nack_first, nack_count
    done_arr = np.zeros(nb, np.uint8)
    cdef uint8_t[::1] done = done_arr
    cdef sockaddr_in to
    set_sockaddr(&to, switch_addr_be, switch_port_be)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef char controls[BATCH * 64]            # INA_GRO_CONTROL bytes per message
    cdef uint8_t *seg_ptr[SEGMENTS]           # the datagrams received, split (UDP_GRO)
    cdef int32_t seg_len[SEGMENTS]
    cdef Py_ssize_t nseg, gro_buffers = 0
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef Py_ssize_t completed = 0, sent = 0, retransmitted = 0, stale = 0, rejected = 0
    cdef Py_ssize_t nacked = 0, nacks = 0, left_out = 0, skipped = 0
    cdef uint64_t counted_all = ~(<uint64_t>0), counted_any = 0, counted
    cdef uint64_t me = (<uint64_t>1) << (worker & 63)
    cdef int64_t mode = 0, announced
    cdef Py_ssize_t samples = 0
    cdef int status = DONE, wait_ms, parsed, ver, failure = 0
    # Quorum: each slot's latest chunk with a result, the slots' versions at the start
    # (use_version), chunks given up.
    cdef int64_t[::1] latest = np.full(slots, -1, np.int64)
    cdef uint8_t[::1] v0 = np.array(versions, np.uint8)
    cdef Py_ssize_t lost = 0
    cdef bint idle
    cdef uint8_t[::1] tries = np.zeros(slots, np.uint8)  # timeouts of the slot's packet
    cdef int receive_failure = 0, receive_call = CALL_RECVMMSG
    cdef double now, start = monotonic(), last_result, next_timer
    cdef double next_signal_check = start
    cdef Py_ssize_t offset, chunk
    cdef const uint8_t *pkt
    last_result = start
    cdef const uint8_t *cancelled = &cancel[0] if cancel is not None else NULL
    if nb == 0:
        return DONE, {}, np.zeros(0, np.int64)
    with nogil:
        for c in range(min(slots, nb)):
            s = send_chunk(rows, lengths, inflight, sent_at, timer, born, resent,
                           versions, overtaken, next_seq, slot_seq, <const char *>&xin[0],
                           size, kind, c, k, block, value_bits, n, agreed, local, slots, nb,
                           job, worker, rto, 0, epoch, call, quorum, &skipped, &lazy)
            pend_bufs[npend], pend_lens[npend] = &rows[s, 0], lengths[s]
            npend += 1
            sent += 1
            if npend == INA_BATCH_MAX or c == min(slots, nb) - 1:
                if ina_send_batch(fd, &to, pend_bufs, pend_lens, npend, &gso,
                                  &send_calls) < 0:
                    status, failure = SEND_FAILED, errno
                    break
                npend = 0
        while status == DONE and completed < nb:
            now = monotonic()
            if now >= next_signal_check:  # Ctrl-C ends the stream (KeyboardInterrupt)
                next_signal_check = now + SIGNAL_CHECK
                with gil:
                    PyErr_CheckSignals()
                if cancelled != NULL and cancelled[0]:
                    status = CANCELLED
                    break
            status = bounds_passed(now, start, deadline, last_result, silence)
            if status != DONE:
                break
            next_timer = now + SIGNAL_CHECK
            for s in range(slots):
                if inflight[s] >= 0 and sent_at[s] + timer[s] < next_timer:
                    next_timer = sent_at[s] + timer[s]
            wait_ms = <int>((next_timer - now) * 1000) if next_timer > now else 0
            nseg = receive(fd, msgs, iovs, controls, &rx[0, 0], BATCH, wait_ms, &pfd,
                           seg_ptr, seg_len, &gro_buffers, &receive_failure, &receive_call)
            now = monotonic()
            for i in range(nseg):
                pkt = seg_ptr[i]
                if seg_len[i] < HEADER:
                    rejected += 1
                    continue
                if (pkt[OFF_FLAGS] & FLAG_NACK and get16(pkt + OFF_JOB) == job
                        and get16(pkt + OFF_EPOCH) == <uint16_t>epoch):
                    # Packets the aggregator never saw: resend them now.
                    nacks += 1
                    nacking[0] = 1
                    nack_first, nack_count = pkt[OFF_SEQ], get16(pkt + OFF_COUNT)
                    for s in range(slots):
                        if (inflight[s] >= 0
                                and ((slot_seq[s] - nack_first) & 255) < nack_count):
                            if resend(fd, &to, rows, lengths, s) < 0:
                                status, failure = SEND_FAILED, errno
                                break
                            resent[s] = 1
                            sent_at[s] = now
                            nacked += 1
                    if status != DONE:
                        break
                    continue
                s = get32(pkt + OFF_SLOT)
                offset = get32(pkt + OFF_OFFSET)
                chunk = offset // k
                ver = pkt[OFF_SLOT_VERSION]
                if (s >= slots or chunk >= nb or done[chunk] or chunk % slots != s
                        or get16(pkt + OFF_JOB) != job
                        or get16(pkt + OFF_EPOCH) != <uint16_t>epoch
                        or get16(pkt + OFF_CALL) != <uint16_t>call
                        or pkt[OFF_FLAGS] & FLAG_CONTROL
                        or not ((inflight[s] == chunk and ver == versions[s])
                                or (quorum and chunk > inflight[s] and chunk > latest[s]
                                    and ver == use_version(v0, chunk, slots)))):
                    stale += 1
                    continue
                parsed = parse_result(pkt, seg_len[i], <char *>&xout[0], size, kind, k,
                                      block, value_bits, n, average, job, -32767, 32767)
                if parsed != PARSE_OK:
                    rejected += 1
                    continue
                done[chunk] = 1
                completed += 1
                if chunk + 1 < nb:  # where the next result goes, fetched meanwhile
                    ina_prefetch(&xout[0] + (chunk + 1) * k * kind_itemsize(kind),
                                 min(k, size - (chunk + 1) * k) * kind_itemsize(kind), 1)
                counted = get64(pkt + OFF_CONTRIBUTORS)
                if counted:  # (an aggregator that names none counted all)
                    counted_all &= counted
                    left_out += not (counted & me)
                counted_any |= counted if counted else ~(<uint64_t>0)
                announced = (<int64_t>get32(pkt + OFF_MODE_GENERATION) << 8
                             | pkt[OFF_MODE_QUORUM])
                if announced > mode:
                    mode = announced
                last_result = now
                if inflight[s] == chunk and not resent[s]:
                    rtt_sample(est, now - born[s], rto_min, rto_max)
                    rto = est[RTO]
                    samples += 1
                if quorum:
                    if chunk > latest[s]:
                        latest[s] = chunk
                    if inflight[s] != chunk:  # a later chunk of the slot, passing by
                        if inflight[s] < 0 or inflight[s] + 2 * slots > latest[s]:
                            continue  # (the one in flight may still be answered)
                        lost += 1  # its cell holds a later chunk now: gone
                    # On from the latest result, past chunks already had.
                    c = next_undone(done, latest[s] + slots, nb, slots)
                    inflight[s] = -1
                    asked[s] = 0
                    if c >= nb:
                        continue
                    versions[s] = use_version(v0, c, slots)
                    chunk = c - slots  # (sent below, as the slot's next)
                else:
                    inflight[s] = -1
                    asked[s] = 0
                    versions[s] ^= 1
                if nacking[0]:  # results of earlier packets still missing: ask for them
                    sent_last = sent_at[s]
                    for q in range(slots):
                        if inflight[q] < 0 or sent_at[q] >= sent_last:
                            continue
                        overtaken[q] += 1
                        if overtaken[q] == OVERTAKEN:
                            overtaken[q] = ASKED
                            if request_result(fd, &to, rows, q, request) < 0:
                                status, failure = SEND_FAILED, errno
                                break
                            resent[q] = 1  # Karn: its round trip is no sample now
                            requests += 1
                    if status != DONE:
                        break
                if <int16_t>get16(pkt + HEADER + 2) == NONFINITE_MARK:
                    nonfinite_seen = True
                c = chunk + slots
                if c < nb:  # its exponents: the max proposals the result carries
                    for j in range(get16(pkt + OFF_BLOCKS)):  # (a quorum's: agreed already)
                        if not quorum:
                            agreed[c * g + j] = <int16_t>get16(pkt + HEADER + PAIR * j + 2)
                            if agreed[c * g + j] == NONFINITE_MARK:
                                agreed[c * g + j] = exponent_ceiling
                    s = send_chunk(rows, lengths, inflight, sent_at, timer, born, resent,
                                   versions, overtaken, next_seq, slot_seq,
                                   <const char *>&xin[0], size, kind, c, k, block,
                                   value_bits, n, agreed, local, slots, nb, job, worker, rto,
                                   0, epoch, call, quorum, &skipped, &lazy)
                    tries[s] = 0
                    pend_bufs[npend], pend_lens[npend] = &rows[s, 0], lengths[s]
                    npend += 1
                    sent += 1
                    if npend == INA_BATCH_MAX:
                        if ina_send_batch(fd, &to, pend_bufs, pend_lens, npend, &gso,
                                          &send_calls) < 0:
                            status, failure = SEND_FAILED, errno
                            break
                        npend = 0
            if lost and quorum:  # nothing in flight, nothing to send: the rest is gone
                idle = True
                for s in range(slots):
                    if inflight[s] >= 0:
                        idle = False
                        break
                if idle and npend == 0:
                    status = LOST
                    break
            # The new packets this batch of results freed: out in one go.
            if status == DONE and npend:
                if ina_send_batch(fd, &to, pend_bufs, pend_lens, npend, &gso,
                                  &send_calls) < 0:
                    status, failure = SEND_FAILED, errno
                npend = 0
            # Retransmit what timed out, backing off; new chunks start from the backed-off
            # timeout until a sample says otherwise (RFC 6298 5.5-5.7). With an aggregator
            # that NACKs, the first timeout of a packet asks for its result with a header
            # alone: had the packet been lost, it would most likely have been NACKed, so
            # another worker's packet is missing (that worker is NACKed) or the result
            # was lost. Only the next timeout resends the whole packet: a lost packet
            # stalls every worker's timer, and n full resends where one is needed were
            # most of the bytes loss cost (docs/reliability.md).
            for s in range(slots):
                if status == DONE and inflight[s] >= 0 and now - sent_at[s] >= timer[s]:
                    if quorum and tries[s] >= QUORUM_TRIES and npend < INA_BATCH_MAX:
                        lost += 1  # given up: on with the slot's next chunk not had
                        c = next_undone(done, max(inflight[s], latest[s]) + slots, nb,
                                        slots)
                        inflight[s] = -1
                        if c < nb:
                            versions[s] = use_version(v0, c, slots)
                            send_chunk(rows, lengths, inflight, sent_at, timer, born,
                                       resent, versions, overtaken, next_seq, slot_seq,
                                       <const char *>&xin[0], size, kind, c, k, block,
                                       value_bits, n, agreed, local, slots, nb, job, worker,
                                       rto, 0, epoch, call, quorum, &skipped, &lazy)
                            tries[s] = 0
                            pend_bufs[npend], pend_lens[npend] = &rows[s, 0], lengths[s]
                            npend += 1
                            sent += 1
                        continue
                    tries[s] += 1
                    if nacking[0] and not asked[s]:
                        if request_result(fd, &to, rows, s, request) < 0:
                            status, failure = SEND_FAILED, errno
                            break
                        asked[s] = 1
                        requests += 1
                    else:
                        if resend(fd, &to, rows, lengths, s) < 0:
                            status, failure = SEND_FAILED, errno
                            break
                        retransmitted += 1
                    resent[s] = 1
                    sent_at[s] = now
                    overtaken[s] = 0
                    timer[s] = min(timer[s] * 2, rto_max)
                    rto = max(rto, timer[s])
            if status == DONE and npend:  # (the next chunks of slots given up)
                if ina_send_batch(fd, &to, pend_bufs, pend_lens, npend, &gso,
                                  &send_calls) < 0:
                    status, failure = SEND_FAILED, errno
                npend = 0
    missing = np.flatnonzero(done_arr == 0)
    send_state[0] = gso
    if quorum:  # every use of each slot passed at the switch, whoever sent it
        for s in range(min(slots, nb)):
            versions[s] = use_version(v0, s + slots * ((nb - s + slots - 1) // slots), slots)
    counters = {"sent": sent, "send_calls": send_calls, "gso": gso,
                "gro_buffers": gro_buffers,
                "retransmitted": retransmitted, "nacks": nacks,
                "nack_resent": nacked, "result_requests": requests,
                "rtt_samples": samples,
                "stale": stale, "rejected": rejected, "seconds": monotonic() - start,
                "left_out": left_out, "skipped": skipped, "lost": lost,
                "nonfinite": int(lazy.nonfinite),
                "nonfinite_seen": int(nonfinite_seen),
                "counted_all": counted_all,
                "counted_any": counted_any, "mode": mode}
    if failure:  # SEND_FAILED
        counters["errno"], counters["call"] = failure, CALL_SEND
    elif receive_failure and status != DONE:
        counters["errno"], counters["call"] = receive_failure, receive_call
    return status, counters, missing


cdef inline int resend(int fd, sockaddr_in *to, uint8_t[:, ::1] rows, int32_t[::1] lengths,
                       Py_ssize_t s) noexcept nogil:
    """Send slot s's packet again, marked as a retransmission; -1 if sendto failed."""
    rows[s, OFF_FLAGS] = FLAG_RETRANSMIT
    if sendto(fd, &rows[s, 0], lengths[s], 0, <const sockaddr *>to, sizeof(sockaddr_in)) < 0:
        return -1
    return 0


cdef inline int request_result(int fd, sockaddr_in *to, uint8_t[:, ::1] rows, Py_ssize_t s,
                               uint8_t *request) noexcept nogil:
    """Ask for slot s's result with its packet's header alone (a result request: count
    0, RETRANSMIT); -1 if sendto failed."""
    memcpy(request, &rows[s, 0], HEADER)
    request[OFF_FLAGS] = FLAG_RETRANSMIT
    put16(request + OFF_COUNT, 0)
    return -1 if sendto(fd, request, HEADER, 0, <const sockaddr *>to,
                        sizeof(sockaddr_in)) < 0 else 0


cdef struct Lazy:  # chunks whose exponents the stream computes as it reaches them
    Py_ssize_t have   # the chunks with exponents in local so far
    int32_t floor     # the dtype's smallest exponent
    bint nonfinite    # a NaN or an Inf was seen among them
    const int16_t *flagged  # G proposals of NONFINITE_MARK: what a packet proposes once seen


cdef Py_ssize_t send_chunk(uint8_t[:, ::1] rows, int32_t[::1] lengths,
                           int64_t[::1] inflight, double[::1] sent_at, double[::1] timer,
                           double[::1] born, uint8_t[::1] resent,
                           uint8_t[::1] versions, int32_t[::1] overtaken, uint8_t *next_seq,
                           uint8_t[::1] slot_seq, const char *x, Py_ssize_t size, Kind kind,
                           Py_ssize_t c, Py_ssize_t k, Py_ssize_t block, int bits, int n,
                           int16_t[::1] agreed, int16_t[::1] local, Py_ssize_t slots,
                           Py_ssize_t nb, int job, int worker, double rto, int flags,
                           int epoch, int call, int quorum,
                           Py_ssize_t *skipped, Lazy *lazy) noexcept nogil:
    """Write chunk c's packet into its slot's row and start its clocks; the slot. The
    caller sends it, with the others of its batch (ina_send_batch). In a quorum call,
    a chunk whose values need larger exponents than those agreed becomes a result
    request, its header alone: clipped values would spoil the sum."""
    cdef Py_ssize_t s = c % slots, g = (k + block - 1) // block, j
    cdef Py_ssize_t blocks = (min(k, size - c * k) + block - 1) // block
    cdef bint fits = True
    cdef Py_ssize_t start, width = kind_itemsize(kind)
    while lazy.have < nb and lazy.have <= c + slots:  # this chunk's and the proposals'
        start = lazy.have * k
        if chunk_proposals(x + start * width, min(k, size - start), kind, block, lazy.floor,
                           g, &local[lazy.have * g]):
            lazy.nonfinite = True
        lazy.have += 1
    if quorum:
        for j in range(blocks):
            if local[c * g + j] > agreed[c * g + j]:
                fits = False
                break
    lengths[s] = <int32_t>write_packet(&rows[s, 0], x, size, kind, c, k, block, bits, n,
                                       &agreed[c * g] if fits else &local[c * g],
                                       lazy.flagged if lazy.nonfinite and not quorum else
                                       &local[(c + slots) * g] if c + slots < nb else NULL,
                                       <uint32_t>s, versions[s], job, worker, flags, epoch,
                                       call, quorum)
    if not fits:
        rows[s, OFF_FLAGS] = FLAG_RETRANSMIT
        put16(&rows[s, 0] + OFF_COUNT, 0)
        lengths[s] = <int32_t>HEADER
        skipped[0] += 1
    if c + 1 < nb:  # the next new packet's values, from memory meanwhile
        ina_prefetch(x + (c + 1) * k * width, min(k, size - (c + 1) * k) * width, 0)
    rows[s, OFF_SEQ] = next_seq[0]
    slot_seq[s] = next_seq[0]
    next_seq[0] += 1
    overtaken[s] = 0
    inflight[s] = c
    sent_at[s] = monotonic()
    born[s] = sent_at[s]
    resent[s] = 0
    timer[s] = rto
    return s  # the caller sends it, in a batch


# What opening() returns as its first value besides STATUS's (a MISMATCH is complete).
OPEN_MISMATCH = 100


def opening(int fd, uint32_t switch_addr_be, uint16_t switch_port_be,
            int16_t[:, ::1] proposals, uint8_t[::1] versions, int job, int worker,
            Py_ssize_t block, int value_bits, uint32_t ident_offset, int16_t ident_word,
            double rto, double rto_min, double rto_max, double silence, double deadline,
            double[::1] rtt, int epoch, uint8_t[::1] seq, int call, uint8_t[::1] send_state,
            scratch):
    """A call's opening (docs/protocol.md): one packet per slot of the call's first
    window (``proposals`` has a row per slot, slots 0 .. m - 1), each with no values
    (count 0) and G pairs: the call's identity (the packets' offset and
    every pair's exponent) and the proposals of the slot's first chunk of the call
    (``proposals``, S x G; PROPOSAL_NONE where the call has none). The aggregator
    keeps the max of the proposals and marks a cell whose packets' identities differ.
    On return ``proposals`` holds the max over the workers, ``versions`` has moved on
    one use of each of those slots (if every result came) and ``rtt`` holds the
    samples taken. A result that says MISMATCH ends the opening at once: the workers may
    have opened different numbers of slots, and the caller starts a new epoch.

    Returns (status, counters): status DONE when every slot's result came and every
    identity was this worker's, OPEN_MISMATCH when a result said the workers' differ
    (the MISMATCH flag, or an identity not this worker's), else as stream's. Reliable
    as the stream is: a timer per slot resends the whole (small) packet, a NACK resends
    the packets it names, and the silence bound and the deadline end it. Ctrl-C ends it
    with KeyboardInterrupt."""
    cdef Py_ssize_t slots = proposals.shape[0], g = proposals.shape[1]
    cdef Py_ssize_t width = HEADER + PAIR * g, s, j, i
    if versions.shape[0] < slots or slots < 1 or g < 1 or width > 65536:
        raise ValueError(f"opening: {slots} x {g} proposals for {versions.shape[0]} slots")
    ring, inbox = scratch
    if ring.shape[0] < slots or ring.shape[1] < width or inbox.shape[1] != 65536:
        raise ValueError("opening: scratch buffers too small")
    cdef uint8_t[:, ::1] rows = ring
    cdef uint8_t[:, ::1] rx = inbox
    cdef Py_ssize_t nrx = min(<Py_ssize_t>BATCH, rx.shape[0])
    cdef double *est = &rtt[0]
    if est[RTO] > 0:
        rto = est[RTO]
    cdef double[::1] sent_at = np.zeros(slots)
    cdef double[::1] timer = np.full(slots, rto)
    cdef uint8_t[::1] resent = np.zeros(slots, np.uint8)
    cdef uint8_t[::1] done = np.zeros(slots, np.uint8)
    cdef uint8_t[::1] slot_seq = np.zeros(slots, np.uint8)
    cdef uint8_t *bufs[INA_BATCH_MAX]
    cdef int32_t lens[INA_BATCH_MAX]
    cdef int gso = send_state[0]
    cdef long send_calls = 0
    cdef sockaddr_in to
    set_sockaddr(&to, switch_addr_be, switch_port_be)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef char controls[BATCH * 64]
    cdef uint8_t *seg_ptr[SEGMENTS]
    cdef int32_t seg_len[SEGMENTS]
    cdef Py_ssize_t nseg, completed = 0, retransmitted = 0, stale = 0, nacks = 0, nacked = 0
    cdef Py_ssize_t samples = 0, nfirst, ncount
    cdef int status = DONE, failure = 0, wait_ms, npend = 0
    cdef int receive_failure = 0, receive_call = CALL_RECVMMSG
    cdef Py_ssize_t gro_buffers = 0
    cdef bint mismatch = False
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef double now, start = monotonic(), last_result, next_timer, next_signal_check
    cdef const uint8_t *pkt
    cdef uint8_t *row
    last_result = start
    next_signal_check = start
    with nogil:
        for s in range(slots):
            row = &rows[s, 0]
            row[OFF_VERSION] = VERSION
            row[OFF_FLAGS] = FLAG_OPEN
            put16(row + OFF_JOB, job)
            put16(row + OFF_WORKER, worker)
            row[OFF_SLOT_VERSION] = versions[s]
            row[OFF_SEQ] = seq[0]
            slot_seq[s] = seq[0]
            seq[0] += 1
            put32(row + OFF_SLOT, <uint32_t>s)
            put32(row + OFF_OFFSET, ident_offset)
            put16(row + OFF_COUNT, 0)
            put16(row + OFF_BLOCKS, <uint16_t>g)
            row[OFF_VALUE_BITS] = value_bits
            row[OFF_BLOCK] = block
            put16(row + OFF_EPOCH, <uint16_t>epoch)
            put16(row + OFF_CALL, <uint16_t>call)
            row[OFF_QUORUM] = 0
            row[OFF_MODE_QUORUM] = 0
            put32(row + OFF_MODE_GENERATION, 0)
            put64(row + OFF_CONTRIBUTORS, 0)
            for j in range(g):
                put16(row + HEADER + PAIR * j, <uint16_t>ident_word)
                put16(row + HEADER + PAIR * j + 2, <uint16_t>proposals[s, j])
            bufs[npend], lens[npend] = row, <int32_t>width
            npend += 1
            sent_at[s] = monotonic()
            if npend == INA_BATCH_MAX or s == slots - 1:
                if ina_send_batch(fd, &to, bufs, lens, npend, &gso, &send_calls) < 0:
                    status, failure = SEND_FAILED, errno
                    break
                npend = 0
        while status == DONE and completed < slots and not mismatch:
            now = monotonic()
            if now >= next_signal_check:
                next_signal_check = now + SIGNAL_CHECK
                with gil:
                    PyErr_CheckSignals()
            status = bounds_passed(now, start, deadline, last_result, silence)
            if status != DONE:
                break
            next_timer = now + SIGNAL_CHECK
            for s in range(slots):
                if not done[s] and sent_at[s] + timer[s] < next_timer:
                    next_timer = sent_at[s] + timer[s]
            wait_ms = <int>((next_timer - now) * 1000) if next_timer > now else 0
            nseg = receive(fd, msgs, iovs, controls, &rx[0, 0], <int>nrx, wait_ms, &pfd,
                           seg_ptr, seg_len, &gro_buffers, &receive_failure, &receive_call)
            now = monotonic()
            for i in range(nseg):
                pkt = seg_ptr[i]
                if (seg_len[i] < HEADER or get16(pkt + OFF_JOB) != job
                        or get16(pkt + OFF_EPOCH) != <uint16_t>epoch):
                    stale += 1
                    continue
                if pkt[OFF_FLAGS] & FLAG_NACK:  # packets never seen: resend them now
                    nacks += 1
                    seq[1] = 1
                    nfirst, ncount = pkt[OFF_SEQ], get16(pkt + OFF_COUNT)
                    for s in range(slots):
                        if not done[s] and ((slot_seq[s] - nfirst) & 255) < ncount:
                            rows[s, OFF_FLAGS] = FLAG_OPEN | FLAG_RETRANSMIT
                            if sendto(fd, &rows[s, 0], width, 0, <const sockaddr *>&to,
                                      sizeof(sockaddr_in)) < 0:
                                status, failure = SEND_FAILED, errno
                                break
                            resent[s] = 1
                            sent_at[s] = now
                            nacked += 1
                    continue
                s = get32(pkt + OFF_SLOT)
                if (not (pkt[OFF_FLAGS] & FLAG_RESULT) or not (pkt[OFF_FLAGS] & FLAG_OPEN)
                        or pkt[OFF_FLAGS] & FLAG_CONTROL or s >= slots or done[s]
                        or pkt[OFF_SLOT_VERSION] != versions[s]
                        or (get16(pkt + OFF_CALL) != <uint16_t>call
                            and not pkt[OFF_FLAGS] & FLAG_MISMATCH)
                        or seg_len[i] != width or get16(pkt + OFF_BLOCKS) != g):
                    # (a marked result may name another worker's call number: the
                    # first packet's)
                    stale += 1
                    continue
                if pkt[OFF_FLAGS] & FLAG_MISMATCH or get32(pkt + OFF_OFFSET) != ident_offset:
                    mismatch = True
                for j in range(g):
                    if <int16_t>get16(pkt + HEADER + PAIR * j) != ident_word:
                        mismatch = True
                    proposals[s, j] = <int16_t>get16(pkt + HEADER + PAIR * j + 2)
                done[s] = 1
                completed += 1
                last_result = now
                if mismatch:  # (the others' slots may never complete: no need)
                    break
                if not resent[s]:
                    rtt_sample(est, now - sent_at[s], rto_min, rto_max)
                    samples += 1
            # Resend what timed out, backing off (the packets are small: whole).
            for s in range(slots):
                if status == DONE and not done[s] and now - sent_at[s] >= timer[s]:
                    rows[s, OFF_FLAGS] = FLAG_OPEN | FLAG_RETRANSMIT
                    if sendto(fd, &rows[s, 0], width, 0, <const sockaddr *>&to,
                              sizeof(sockaddr_in)) < 0:
                        status, failure = SEND_FAILED, errno
                        break
                    retransmitted += 1
                    resent[s] = 1
                    sent_at[s] = now
                    timer[s] = min(timer[s] * 2, rto_max)
    if completed == slots:
        for s in range(slots):
            versions[s] ^= 1
    send_state[0] = gso
    counters = {"open_sent": slots, "retransmitted": retransmitted, "nacks": nacks,
                "nack_resent": nacked, "stale": stale, "rtt_samples": samples,
                "open_seconds": monotonic() - start, "send_calls": send_calls}
    if failure:
        counters["errno"], counters["call"] = failure, CALL_SEND
    elif receive_failure and status != DONE:
        counters["errno"], counters["call"] = receive_failure, receive_call
    if status == DONE and mismatch:
        status = OPEN_MISMATCH
    return status, counters
