# INA packets for the compiled modules: written (write_packet) and checked and read
# (parse_result) at the offsets of header.pxi, which the including module includes first.
# A packet: the header, ceil(count / b) pairs (exponent, proposal), count values.
from blockfp_kernels cimport (PIECE, Format, Kind, dequantize_chunk, kind_itemsize,
                              quantize_chunk)
from byteorder cimport get16, get32, get64, put16, put32, put64
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef extern from *:
    int popcount64 "__builtin_popcountll" (unsigned long long) nogil


# What a packet's header says besides its values' format (Format): which slot and version
# it uses, whose it is, its flags, the run's epoch, the call's number and the k its chunks
# complete at (0: all n).
cdef struct Stamp:
    uint32_t slot
    int slot_version, job, worker, flags, epoch, call, quorum


cdef Py_ssize_t write_packet(uint8_t *row, const char *x, Py_ssize_t size, const Format *f,
                             Py_ssize_t chunk, const int16_t *exponents,
                             const int16_t *proposals, const Stamp *h) noexcept nogil:
    """Chunk ``chunk`` of x (size elements, in chunks of f.k) as a packet in row, its
    header from h; returns its length. exponents: the chunk's agreed ones, one per
    sub-block; proposals: those of the slot's next chunk, or NULL (none:
    PROPOSAL_NONE)."""
    cdef Py_ssize_t k = f.k, b = f.b
    cdef int bits = f.bits
    cdef Py_ssize_t start = chunk * k
    cdef Py_ssize_t count = min(k, size - start)
    cdef Py_ssize_t blocks = (count + b - 1) // b, j
    cdef Py_ssize_t itemsize = kind_itemsize(f.kind)
    row[OFF_VERSION] = VERSION
    row[OFF_FLAGS] = h.flags
    put16(row + OFF_JOB, h.job)
    put16(row + OFF_WORKER, h.worker)
    row[OFF_SLOT_VERSION] = h.slot_version
    row[OFF_SEQ] = 0  # the transport numbers its packets itself
    put32(row + OFF_SLOT, h.slot)
    put32(row + OFF_OFFSET, <uint32_t>start)
    put16(row + OFF_COUNT, <uint16_t>count)
    put16(row + OFF_BLOCKS, <uint16_t>blocks)
    row[OFF_VALUE_BITS] = bits
    row[OFF_BLOCK] = b
    put16(row + OFF_EPOCH, <uint16_t>h.epoch)
    put16(row + OFF_CALL, <uint16_t>h.call)
    row[OFF_QUORUM] = <uint8_t>h.quorum
    row[OFF_MODE_QUORUM] = 0
    put32(row + OFF_MODE_GENERATION, 0)
    put64(row + OFF_CONTRIBUTORS, 0)
    cdef uint8_t *pair = row + HEADER
    for j in range(blocks):
        put16(pair + PAIR * j, <uint16_t>exponents[j])
        put16(pair + PAIR * j + 2,
              <uint16_t>(proposals[j] if proposals != NULL else PROPOSAL_NONE))
    quantize_chunk(x + start * itemsize, count, f, exponents, <char *>(pair + PAIR * blocks))
    return HEADER + PAIR * blocks + (bits // 8) * count


cdef int parse_result(const uint8_t *pkt, Py_ssize_t length, char *out, Py_ssize_t size,
                      const Format *f, int job, int exponent_min,
                      int exponent_max) noexcept nogil:
    """Check a result packet of job ``job``; if good, write its chunk into out (size
    elements, in chunks of f.k). An AVERAGE divides by the workers the result counted
    (its contributors; n if none are named)."""
    cdef Py_ssize_t k = f.k, b = f.b
    cdef int bits = f.bits
    if length < HEADER:
        return PARSE_SHORT
    if pkt[OFF_VERSION] != VERSION:
        return PARSE_VERSION
    if not (pkt[OFF_FLAGS] & FLAG_RESULT):
        return PARSE_NOT_RESULT
    if get16(pkt + OFF_JOB) != job:
        return PARSE_JOB
    if pkt[OFF_VALUE_BITS] != bits or pkt[OFF_BLOCK] != b:
        return PARSE_FORMAT
    cdef Py_ssize_t offset = get32(pkt + OFF_OFFSET)
    cdef Py_ssize_t count = get16(pkt + OFF_COUNT)
    cdef Py_ssize_t blocks = get16(pkt + OFF_BLOCKS), j, first, span
    if offset % k:
        return PARSE_MISALIGNED
    if offset >= size:
        return PARSE_RANGE
    if (count != min(k, size - offset) or blocks != (count + b - 1) // b
            or length != HEADER + PAIR * blocks + (bits // 8) * count):
        return PARSE_COUNT
    cdef const uint8_t *pair = pkt + HEADER
    cdef int exponent
    for j in range(blocks):  # all checked before anything is written
        exponent = <int16_t>get16(pair + PAIR * j)
        if exponent < exponent_min or exponent > exponent_max:
            return PARSE_EXPONENT
    cdef Py_ssize_t itemsize = kind_itemsize(f.kind)
    cdef int16_t exps[PIECE]
    cdef const char *values = <const char *>(pair + PAIR * blocks)
    cdef int counted = popcount64(get64(pkt + OFF_CONTRIBUTORS))
    first = 0
    while first < blocks:  # PIECE sub-blocks at a time: their exponents on the stack
        span = min(<Py_ssize_t>PIECE, blocks - first)
        for j in range(span):
            exps[j] = <int16_t>get16(pair + PAIR * (first + j))
        dequantize_chunk(values + first * b * (bits // 8),
                         min(span * b, count - first * b), f, exps,
                         out + (offset + first * b) * itemsize, counted)
        first += span
    return PARSE_OK
