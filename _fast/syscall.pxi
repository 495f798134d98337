# The one error path of a failed system call (mpi4py's CHKERR): the loops run without the
# GIL, keep errno, and this takes the GIL only to raise it as SystemCallError, whose
# message says what was being done and why it failed.
from libc.errno cimport errno

from ina_collectives.errors import SystemCallError


cdef int raise_errno(int err, str what) except -1 with gil:
    raise SystemCallError(err, what)
