# cython: language_level=3
"""Load generation for the switch benchmark (bench/switch_ceiling.py): pre-built packets
replayed with no quantization cost, and a bare batched receiver, the machine's ceiling.

A datagram the kernel refuses for want of buffers (EAGAIN, ENOBUFS) or for a signal (EINTR)
is lost, as on a link; any other failed system call raises SystemCallError."""
from libc.errno cimport ENOBUFS
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from byteorder cimport get32
from netio cimport (MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll, pollfd,
                    prepare_receive, recvmmsg, sendto, set_sockaddr, sockaddr, sockaddr_in,
                    try_again)

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


def replay_workers(int[::1] fds, uint32_t addr_be, uint16_t port_be, uint8_t[:, ::1] rows,
                   int32_t length, int n, int slots, double seconds):
    """n workers (one socket each) stream chunks through the switch, S in flight, each
    slot refilled when worker 0 gets its result. rows[w * S + s] is worker w's packet for
    slot s. Returns (chunks completed, seconds)."""
    cdef sockaddr_in to
    set_sockaddr(&to, addr_be, port_be)
    cdef uint8_t inbox[BATCH][2048]  # results are read only for their headers
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef pollfd pfd
    cdef int w, s, i, got
    cdef uint64_t completed = 0
    cdef uint8_t version[65536]
    cdef double start, now
    pfd.fd = fds[0]
    pfd.events = POLLIN
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
            prepare_receive(msgs, iovs, &inbox[0][0], 2048, BATCH, NULL)
            got = receive_batch(fds[0], msgs, BATCH)
            if got == 0:
                if not wait_readable(&pfd, 100):
                    break  # the pipeline stalled (a loss): stop measuring
                continue
            for i in range(got):
                s = get32(inbox[i] + OFF_SLOT)
                if s >= slots or inbox[i][OFF_SLOT_VERSION] != version[s]:
                    continue
                completed += 1
                version[s] ^= 1
                for w in range(n):
                    rows[w * slots + s, OFF_SLOT_VERSION] = version[s]
                    send_or_lose(fds[w], &rows[w * slots + s, 0], length, &to)
            # Other workers' results are left to their sockets' buffers to overflow.
        now = monotonic()
    return completed, now - start


def blast(int fd, uint32_t addr_be, uint16_t port_be, const uint8_t[::1] packet,
          double seconds):
    """Send one packet as fast as possible for ``seconds``; packets sent."""
    cdef sockaddr_in to
    set_sockaddr(&to, addr_be, port_be)
    cdef uint64_t sent = 0
    cdef double start
    with nogil:
        start = monotonic()
        while monotonic() - start < seconds:
            for _ in range(64):
                sent += send_or_lose(fd, &packet[0], packet.shape[0], &to)
    return sent


def sink(int fd, double seconds):
    """A bare batched receiver: counts datagrams for ``seconds`` after the first one."""
    cdef uint8_t[:, ::1] bufs
    import numpy as np
    bufs = np.empty((BATCH, 65536), np.uint8)
    cdef mmsghdr msgs[BATCH]
    cdef iovec iovs[BATCH]
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef uint64_t count = 0
    cdef int got
    cdef double start = 0
    with nogil:
        if wait_readable(&pfd, 10000):
            start = monotonic()
            while monotonic() - start < seconds:
                prepare_receive(msgs, iovs, &bufs[0, 0], 65536, BATCH, NULL)
                got = receive_batch(fd, msgs, BATCH)
                if got > 0:
                    count += got
                else:
                    wait_readable(&pfd, 100)
    return count
