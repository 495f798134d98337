# The POSIX socket calls of the fast path's UDP loops (Python creates and binds the
# sockets; the loops only move datagrams, without the GIL).
from libc.stdint cimport uint8_t, uint16_t, uint32_t
from libc.string cimport memset

cdef extern from "<errno.h>" nogil:
    enum:
        EAGAIN
        EWOULDBLOCK
        EINTR

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
    int getsockname(int fd, sockaddr *addr, socklen_t *addrlen)
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


cdef inline void set_sockaddr(sockaddr_in *to, uint32_t addr_be, uint16_t port_be
                              ) noexcept nogil:
    """An IPv4 address and port, both in network order, as a sockaddr_in."""
    memset(to, 0, sizeof(sockaddr_in))
    to.sin_family = AF_INET
    to.sin_addr.s_addr = addr_be
    to.sin_port = port_be


cdef inline bint try_again(int err) noexcept nogil:
    """Whether a failed non-blocking call did not fail: nothing to do now (EAGAIN,
    EWOULDBLOCK) or a signal came first (EINTR). Any other errno is a failure."""
    if err == EAGAIN or err == EINTR:
        return True
    return err == EWOULDBLOCK  # apart: it may be EAGAIN (a C switch may not say it twice)


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void prepare_receive(mmsghdr *msgs, iovec *iovs, uint8_t *buffers,
                                 Py_ssize_t stride, int count,
                                 sockaddr_in *names) noexcept nogil:
    """Point msgs[i] at buffers + i * stride (and names[i], if names is not NULL) for
    recvmmsg, which overwrites the lengths it was given."""
    cdef int i
    for i in range(count):
        iovs[i].iov_base = buffers + i * stride
        iovs[i].iov_len = stride
        memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr))
        msgs[i].msg_hdr.msg_iov = &iovs[i]
        msgs[i].msg_hdr.msg_iovlen = 1
        if names != NULL:
            msgs[i].msg_hdr.msg_name = &names[i]
            msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
