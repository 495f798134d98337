# INA packets for the compiled modules: written (write_packet) and checked and read
# (parse_result) at the offsets of header.pxi, which the including module includes first.
from blockfp_kernels cimport KIND_F64, Kind, dequantize_block, quantize_block
from byteorder cimport get16, get32, put16, put32
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy


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
    row[OFF_SEQ] = 0  # the transport numbers its packets itself
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
