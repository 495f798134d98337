# Network byte order reads and writes of header fields, for every module that touches a
# packet (wire.pxi, loadgen.pyx): written once. Inline: nothing to import at run time.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef extern from *:
    uint32_t __builtin_bswap32(uint32_t) nogil
    uint64_t __builtin_bswap64(uint64_t) nogil


cdef inline void put16(uint8_t *p, uint16_t v) noexcept nogil:
    p[0] = v >> 8
    p[1] = v & 0xff


cdef inline void put32(uint8_t *p, uint32_t v) noexcept nogil:
    v = __builtin_bswap32(v)
    memcpy(p, &v, 4)


cdef inline uint16_t get16(const uint8_t *p) noexcept nogil:
    return (p[0] << 8) | p[1]


cdef inline uint32_t get32(const uint8_t *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return __builtin_bswap32(v)


cdef inline void put64(uint8_t *p, uint64_t v) noexcept nogil:
    v = __builtin_bswap64(v)
    memcpy(p, &v, 8)


cdef inline uint64_t get64(const uint8_t *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return __builtin_bswap64(v)
