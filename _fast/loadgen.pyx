# cython: language_level=3
"""Load generation for the switch benchmark (bench/switch_ceiling.py): pre-built packets
replayed with no quantization cost, and a bare batched receiver, the machine's ceiling;
for bench/udp_ceiling.py, the same bare loops with sendmmsg or UDP_SEGMENT and with
recvmmsg or UDP_GRO.

A datagram the kernel refuses for want of buffers (EAGAIN, ENOBUFS) or for a signal (EINTR)
is lost, as on a link; any other failed system call raises SystemCallError."""
from libc.errno cimport ENOBUFS
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from byteorder cimport get32
from netio cimport (MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll, pollfd,
                    prepare_receive, recvmmsg, sendmmsg, sendto, set_sockaddr, sockaddr,
                    sockaddr_in, try_again)
from udp_batch cimport (INA_GRO_CONTROL, INA_GSO_MAX_BYTES, ina_attach_controls,
                        ina_segments, ina_send_batch, ina_send_segmented)

from ina_collectives import protocol as P

include "header.pxi"
include "syscall.pxi"

cdef enum:
    BATCH = 64


cdef int send_or_lose(int fd, const uint8_t *packet, Py_ssize_t length,
                      const sockaddr_in *to) except -1 nogil:
    """Send one datagram: 1 if sent, 0 if lost for want of buffers; else raise."""
    if sendto(fd, packet, length, 0, <const sockaddr *>to, sizeof(sockaddr_in)) >= 0:
        return 1
    if try_again(errno) or errno == ENOBUFS:
        return 0
    return raise_errno(errno, "sendto of a load packet to", fd, to)


cdef int wait_readable(pollfd *pfd, int timeout_ms) except -1 nogil:
    """poll one socket: 1 if readable, 0 if not (timeout or a signal first); else raise."""
    cdef int ready = poll(pfd, 1, timeout_ms)
    if ready < 0 and not try_again(errno):
        return raise_errno(errno, "poll of", pfd.fd, NULL)
    return ready > 0


cdef int receive_batch(int fd, mmsghdr *msgs, int count) except -1 nogil:
    """recvmmsg without waiting: the datagrams received, 0 if none; else raise."""
    cdef int got = recvmmsg(fd, msgs, count, MSG_DONTWAIT, NULL)
    if got < 0 and not try_again(errno):
        return raise_errno(errno, "recvmmsg on", fd, NULL)
    return got if got > 0 else 0


def replay_workers(int[::1] fds, tuple switch, uint8_t[:, ::1] rows, int32_t length, int n,
                   int slots, double seconds, bint gso=False):
    """n workers (one socket each) stream chunks through the switch at ``switch``
    (protocol.sockaddr_be's (address, port) in network order), S in flight, each
    slot refilled when worker 0 gets its result. rows[w * S + s] is worker w's packet for
    slot s. The refills a batch of results frees leave per worker in one go: with
    UDP_SEGMENT if ``gso``, else sendmmsg (results coalesced by UDP_GRO are split).
    Returns (chunks completed, seconds, send system calls)."""
    import numpy as np
    cdef sockaddr_in to
    set_sockaddr(&to, switch[0], switch[1])
    cdef uint8_t[:, ::1] inbox = np.empty((BATCH, 65536), np.uint8)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef char controls[BATCH * 64]
    cdef pollfd pfd
    cdef int w, i, got, npend = 0, use_gso = gso, nseg
    cdef Py_ssize_t s
    cdef uint8_t *segs[64]             # one received buffer's datagrams (UDP_GRO)
    cdef int32_t seg_lens[64]
    cdef uint64_t completed = 0
    cdef long calls = 0, refused = 0
    cdef uint8_t version[65536]
    cdef int32_t pend[BATCH * 64]      # slots to refill, this batch
    cdef uint8_t *bufs[64]
    cdef int32_t lens[64]
    cdef int j, k
    cdef double start, now
    cdef const uint8_t *pkt
    pfd.fd = fds[0]
    pfd.events = POLLIN
    for i in range(64):
        lens[i] = length
    with nogil:
        start = monotonic()
        memset(version, 0, sizeof(version))
        for s in range(slots):
            for w in range(n):
                send_or_lose(fds[w], &rows[w * slots + s, 0], length, &to)
        while True:
            now = monotonic()
            if now - start >= seconds:
                break
            prepare_receive(msgs, iovs, &inbox[0, 0], 65536, BATCH, NULL)
            ina_attach_controls(msgs, controls, INA_GRO_CONTROL, BATCH)
            got = receive_batch(fds[0], msgs, BATCH)
            if got == 0:
                if not wait_readable(&pfd, 100):
                    break  # the pipeline stalled (a loss): stop measuring
                continue
            npend = 0
            for i in range(got):
                nseg = ina_segments(&msgs[i].msg_hdr, &inbox[i, 0], msgs[i].msg_len, segs,
                                    seg_lens, 64)
                for j in range(nseg):
                    pkt = segs[j]
                    s = get32(pkt + OFF_SLOT)
                    if s >= slots or pkt[OFF_SLOT_VERSION] != version[s]:
                        continue
                    completed += 1
                    version[s] ^= 1
                    pend[npend] = <int32_t>s
                    npend += 1
            for w in range(n):  # each worker's refills, in batches of 64
                j = 0
                while j < npend:
                    k = 0
                    while k < 64 and j < npend:
                        s = pend[j]
                        rows[w * slots + s, OFF_SLOT_VERSION] = version[s]
                        bufs[k] = &rows[w * slots + s, 0]
                        k += 1
                        j += 1
                    if ina_send_batch(fds[w], &to, bufs, lens, k, &use_gso, &calls,
                                      &refused) < 0 and not try_again(errno):
                        raise_errno(errno, "sending to", fds[w], &to)
            # Other workers' results are left to their sockets' buffers to overflow.
        now = monotonic()
    return completed, now - start, calls


def blast_batched(int fd, uint32_t addr_be, uint16_t port_be, uint8_t[::1] packet,
                  double seconds, bint gso):
    """Send copies of one packet for ``seconds``, 64 per sendmmsg, or (gso) as many per
    UDP_SEGMENT send as 64 KiB holds; (datagrams sent, system calls)."""
    cdef sockaddr_in to
    set_sockaddr(&to, addr_be, port_be)
    cdef uint8_t *bufs[BATCH]
    cdef int32_t lens[BATCH]
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef int i, r, per_call = BATCH
    cdef int32_t length = packet.shape[0]
    if gso:
        per_call = min(<int>BATCH, <int>(INA_GSO_MAX_BYTES // length))
    for i in range(BATCH):
        bufs[i], lens[i] = &packet[0], length
        iovs[i].iov_base, iovs[i].iov_len = &packet[0], length
        memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr))
        msgs[i].msg_hdr.msg_name = &to
        msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
        msgs[i].msg_hdr.msg_iov = &iovs[i]
        msgs[i].msg_hdr.msg_iovlen = 1
    cdef uint64_t sent = 0, calls = 0
    cdef double start
    with nogil:
        start = monotonic()
        while monotonic() - start < seconds:
            calls += 1
            if gso:
                r = per_call if ina_send_segmented(fd, &to, bufs, lens, per_call,
                                                   <uint16_t>length) == 0 else -1
            else:
                r = sendmmsg(fd, msgs, BATCH, 0)
            if r > 0:
                sent += r
            elif not (try_again(errno) or errno == ENOBUFS):
                raise_errno(errno, "sending to", fd, &to)
    return sent, calls


def echo(int fd, double seconds):
    """A switch that only echoes: every datagram goes back to its sender marked RESULT
    (for one worker, n = 1, that is its sum), a sender's datagrams of one receive in one
    segmented send. Runs ``seconds`` after the first datagram; the datagrams echoed."""
    import numpy as np
    cdef uint8_t[:, ::1] bufs_in = np.empty((BATCH, 65536), np.uint8)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef sockaddr_in names[BATCH]
    cdef char controls[BATCH * 64]
    cdef uint8_t *bufs[64]
    cdef int32_t lens[64]
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef uint64_t count = 0
    cdef long calls = 0, refused = 0
    cdef int got, i, j, n, gso = 1
    cdef double start = 0
    with nogil:
        if wait_readable(&pfd, 10000):
            start = monotonic()
            while monotonic() - start < seconds:
                prepare_receive(msgs, iovs, &bufs_in[0, 0], 65536, BATCH, names)
                ina_attach_controls(msgs, controls, INA_GRO_CONTROL, BATCH)
                got = receive_batch(fd, msgs, BATCH)
                if got == 0:
                    wait_readable(&pfd, 100)
                    continue
                for i in range(got):
                    n = ina_segments(&msgs[i].msg_hdr, &bufs_in[i, 0], msgs[i].msg_len, bufs,
                                     lens, 64)
                    for j in range(n):
                        bufs[j][OFF_FLAGS] = FLAG_RESULT
                    count += n
                    if ina_send_batch(fd, &names[i], bufs, lens, n, &gso, &calls,
                                      &refused) < 0 and not try_again(errno):
                        raise_errno(errno, "echoing to", fd, &names[i])
    return count


def sink(int fd, double seconds):
    """A bare batched receiver: counts datagrams for ``seconds`` after the first one
    (those a UDP_GRO buffer holds each count: enable it on fd to receive coalesced)."""
    cdef uint8_t[:, ::1] bufs
    import numpy as np
    bufs = np.empty((BATCH, 65536), np.uint8)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef uint64_t count = 0
    cdef int got, i
    cdef double start = 0
    cdef char controls[BATCH * 64]
    cdef uint8_t *segs[64]
    cdef int32_t seg_lens[64]
    with nogil:
        if wait_readable(&pfd, 10000):
            start = monotonic()
            while monotonic() - start < seconds:
                prepare_receive(msgs, iovs, &bufs[0, 0], 65536, BATCH, NULL)
                ina_attach_controls(msgs, controls, INA_GRO_CONTROL, BATCH)
                got = receive_batch(fd, msgs, BATCH)
                if got > 0:
                    for i in range(got):
                        count += ina_segments(&msgs[i].msg_hdr, &bufs[i, 0], msgs[i].msg_len,
                                              segs, seg_lens, 64)
                else:
                    wait_readable(&pfd, 100)
    return count
