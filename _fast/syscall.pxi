# The one error path of a failed system call (mpi4py's CHKERR): the loops run without the
# GIL and pass errno as the call left it; this takes the GIL only to raise it as
# SystemCallError, whose message says what was being done and with which address.
from libc.errno cimport errno
from libc.string cimport memset
from netio cimport getsockname, sockaddr, sockaddr_in, socklen_t

from ina_collectives.errors import SystemCallError
from ina_collectives.protocol import address_text


cdef int raise_errno(int err, const char *doing, int fd,
                     const sockaddr_in *peer) except -1 with gil:
    """Raise SystemCallError(err, "<doing> <address>"), the address peer's or, if peer is
    NULL, socket fd's own: e.g. "[Errno 9] Bad file descriptor: recvmmsg on 0.0.0.0:47474"."""
    cdef sockaddr_in own
    cdef socklen_t size = sizeof(own)
    if peer == NULL:
        memset(&own, 0, sizeof(own))
        getsockname(fd, <sockaddr *>&own, &size)  # if it fails too: 0.0.0.0:0
        peer = &own
    where = address_text(peer.sin_addr.s_addr, peer.sin_port)
    raise SystemCallError(err, f"{doing.decode()} {where}")
