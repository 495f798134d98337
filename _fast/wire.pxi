# INA header access for the compiled modules (included, so each module has its own copy
# of the offsets, read from ina_collectives.protocol at import: the format is written once).
# The including module imports ina_collectives.protocol as P.
from blockfp_kernels cimport KIND_F64, Kind, dequantize_block, quantize_block
from byteorder cimport get16, get32, put16, put32
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

cdef Py_ssize_t HEADER = P.HEADER_BYTES
cdef Py_ssize_t OFF_VERSION = P.OFF_VERSION, OFF_FLAGS = P.OFF_FLAGS, OFF_JOB = P.OFF_JOB
cdef Py_ssize_t OFF_WORKER = P.OFF_WORKER, OFF_SLOT_VERSION = P.OFF_SLOT_VERSION
cdef Py_ssize_t OFF_SLOT = P.OFF_SLOT, OFF_OFFSET = P.OFF_OFFSET, OFF_COUNT = P.OFF_COUNT
cdef Py_ssize_t OFF_EXPONENT = P.OFF_EXPONENT, OFF_PROPOSAL = P.OFF_PROPOSAL
cdef Py_ssize_t OFF_EPOCH = P.OFF_EPOCH, OFF_RESERVED = P.OFF_RESERVED
cdef int VERSION = P.PROTOCOL_VERSION, FLAG_RESULT = P.FLAG_RESULT
cdef int PROPOSAL_NONE = P.PROPOSAL_NONE
cdef int PARSE_OK = P.PARSE_OK, PARSE_SHORT = P.PARSE_SHORT
cdef int PARSE_VERSION = P.PARSE_VERSION, PARSE_NOT_RESULT = P.PARSE_NOT_RESULT
cdef int PARSE_JOB = P.PARSE_JOB, PARSE_COUNT = P.PARSE_COUNT, PARSE_RANGE = P.PARSE_RANGE
cdef int PARSE_MISALIGNED = P.PARSE_MISALIGNED, PARSE_EXPONENT = P.PARSE_EXPONENT
cdef int FLAG_RETRANSMIT = P.FLAG_RETRANSMIT, FLAG_CONTROL = P.FLAG_CONTROL


cdef Py_ssize_t write_packet(uint8_t *row, const char *x, Py_ssize_t size, Kind kind,
                             Py_ssize_t chunk, Py_ssize_t k, int n, int exponent,
                             int proposal, uint32_t slot, int slot_version, int job,
                             int worker, int flags, int epoch) noexcept nogil:
    """Chunk ``chunk`` of x (size elements) as a packet in row; returns its length."""
    cdef Py_ssize_t start = chunk * k
    cdef Py_ssize_t count = min(k, size - start)
    cdef Py_ssize_t itemsize = 4 if kind != KIND_F64 else 8
    row[OFF_VERSION] = VERSION
    row[OFF_FLAGS] = flags
    put16(row + OFF_JOB, job)
    put16(row + OFF_WORKER, worker)
    row[OFF_SLOT_VERSION] = slot_version
    row[OFF_RESERVED] = 0
    put32(row + OFF_SLOT, slot)
    put32(row + OFF_OFFSET, <uint32_t>start)
    put16(row + OFF_COUNT, <uint16_t>count)
    put16(row + OFF_EXPONENT, <uint16_t><int16_t>exponent)
    put16(row + OFF_PROPOSAL, <uint16_t><int16_t>proposal)
    put16(row + OFF_EPOCH, <uint16_t>epoch)
    quantize_block(x + start * itemsize, count, kind, exponent, n,
                   <uint32_t *>(row + HEADER))
    return HEADER + 4 * count


cdef int parse_result(const uint8_t *pkt, Py_ssize_t length, char *out, Py_ssize_t size,
                      Kind kind, Py_ssize_t k, int n, bint average, int job,
                      int exponent_min, int exponent_max) noexcept nogil:
    """Check a result packet; if good, write its chunk into out (size elements)."""
    if length < HEADER:
        return PARSE_SHORT
    if pkt[OFF_VERSION] != VERSION:
        return PARSE_VERSION
    if not (pkt[OFF_FLAGS] & FLAG_RESULT):
        return PARSE_NOT_RESULT
    if get16(pkt + OFF_JOB) != job:
        return PARSE_JOB
    cdef Py_ssize_t offset = get32(pkt + OFF_OFFSET)
    cdef Py_ssize_t count = get16(pkt + OFF_COUNT)
    cdef int exponent = <int16_t>get16(pkt + OFF_EXPONENT)
    if offset % k:
        return PARSE_MISALIGNED
    if offset >= size:
        return PARSE_RANGE
    if count != min(k, size - offset) or length != HEADER + 4 * count:
        return PARSE_COUNT
    if exponent < exponent_min or exponent > exponent_max:
        return PARSE_EXPONENT
    cdef Py_ssize_t itemsize = 4 if kind != KIND_F64 else 8
    dequantize_block(<const uint32_t *>(pkt + HEADER), count, kind, exponent, n, average,
                     out + offset * itemsize)
    return PARSE_OK
