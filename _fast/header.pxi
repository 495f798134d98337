# The INA header's offsets and constants for the compiled modules (included, so each module
# has its own copy, read from ina_collectives.protocol at import: the format is written
# once, in protocol/header.py). The including module imports ina_collectives.protocol as P.
# Included before wire.pxi (packets) by the modules that write or parse packets, alone by
# those that only read fields (switch_loop.pyx, loadgen.pyx).

cdef Py_ssize_t HEADER = P.HEADER_BYTES
cdef Py_ssize_t OFF_VERSION = P.OFF_VERSION, OFF_FLAGS = P.OFF_FLAGS, OFF_JOB = P.OFF_JOB
cdef Py_ssize_t OFF_WORKER = P.OFF_WORKER, OFF_SLOT_VERSION = P.OFF_SLOT_VERSION
cdef Py_ssize_t OFF_SLOT = P.OFF_SLOT, OFF_OFFSET = P.OFF_OFFSET, OFF_COUNT = P.OFF_COUNT
cdef Py_ssize_t OFF_BLOCKS = P.OFF_BLOCKS, OFF_VALUE_BITS = P.OFF_VALUE_BITS
cdef Py_ssize_t OFF_BLOCK = P.OFF_BLOCK, PAIR = P.PAIR_BYTES
cdef Py_ssize_t OFF_EPOCH = P.OFF_EPOCH, OFF_SEQ = P.OFF_SEQ, OFF_CALL = P.OFF_CALL
cdef Py_ssize_t OFF_QUORUM = P.OFF_QUORUM, OFF_MODE_QUORUM = P.OFF_MODE_QUORUM
cdef Py_ssize_t OFF_MODE_GENERATION = P.OFF_MODE_GENERATION
cdef Py_ssize_t OFF_CONTRIBUTORS = P.OFF_CONTRIBUTORS
cdef int VERSION = P.PROTOCOL_VERSION, FLAG_RESULT = P.FLAG_RESULT
cdef int PROPOSAL_NONE = P.PROPOSAL_NONE
cdef int NONFINITE_MARK = P.NONFINITE_MARK
cdef int PARSE_OK = P.PARSE_OK, PARSE_SHORT = P.PARSE_SHORT
cdef int PARSE_VERSION = P.PARSE_VERSION, PARSE_NOT_RESULT = P.PARSE_NOT_RESULT
cdef int PARSE_JOB = P.PARSE_JOB, PARSE_COUNT = P.PARSE_COUNT, PARSE_RANGE = P.PARSE_RANGE
cdef int PARSE_MISALIGNED = P.PARSE_MISALIGNED, PARSE_EXPONENT = P.PARSE_EXPONENT
cdef int PARSE_FORMAT = P.PARSE_FORMAT
cdef int FLAG_RETRANSMIT = P.FLAG_RETRANSMIT, FLAG_CONTROL = P.FLAG_CONTROL
cdef int FLAG_NACK = P.FLAG_NACK, FLAG_OPEN = P.FLAG_OPEN, FLAG_MISMATCH = P.FLAG_MISMATCH
cdef int FLAG_PREDICTED = P.FLAG_PREDICTED, FLAG_OVERFLOW = P.FLAG_OVERFLOW
