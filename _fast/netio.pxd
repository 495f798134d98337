# The POSIX socket calls of the fast path's UDP loops (Python creates and binds the
# sockets; the loops only move datagrams, without the GIL).
from libc.stdint cimport uint16_t, uint32_t

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<netinet/in.h>" nogil:
    struct in_addr:
        uint32_t s_addr
    struct sockaddr_in:
        unsigned short sin_family
        uint16_t sin_port
        in_addr sin_addr
    int AF_INET

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    struct sockaddr:
        pass
    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len
    int recvmmsg(int fd, mmsghdr *msgs, unsigned int vlen, int flags, void *timeout)
    int sendmmsg(int fd, mmsghdr *msgs, unsigned int vlen, int flags)
    ssize_t sendto(int fd, const void *buf, size_t n, int flags, const sockaddr *addr,
                   socklen_t addrlen)
    int MSG_DONTWAIT

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *ts)
    int CLOCK_MONOTONIC


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
