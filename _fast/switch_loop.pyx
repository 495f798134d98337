# cython: language_level=3
"""The software aggregator's data path: SwitchML's slot rule on batched UDP, no GIL.

``Aggregator.run`` receives datagrams with recvmmsg and, for each data packet, applies
the rule of docs/protocol.md exactly as the P4 program does: per job S slots x 2
versions of K int32 accumulators, a bitmap of workers seen, a count and the max of the
exponent proposals. Control packets (join/leave/probe/faults) are rare: they are
handed back to Python (ina_collectives.switch), which configures jobs through the
methods below. Every packet that is neither aggregated nor answered is dropped and
counted by reason.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from blockfp_kernels cimport ina_accumulate_be32, ina_load_be32, ina_store_be32
from netio cimport (AF_INET, MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll, pollfd,
                    recvmmsg, sendto, sockaddr, sockaddr_in)

from ina_collectives import protocol as P

include "wire.pxi"

cdef enum:
    BATCH = 64          # datagrams per recvmmsg
    MAX_WORKERS = 64    # bits of a slot's bitmap (protocol.MAX_WORKERS)
    MAX_CONTROL = 64    # control packets held for Python per run()

# Why packets are dropped; the index is the counter's.
DROP_REASONS = ("malformed", "unknown job", "unknown worker", "bad slot", "mismatched chunk",
                "duplicate in progress", "injected loss in", "injected loss out",
                "result from a worker")
cdef enum Drop:
    DROP_MALFORMED, DROP_UNKNOWN_JOB, DROP_UNKNOWN_WORKER, DROP_BAD_SLOT, DROP_MISMATCH,
    DROP_DUPLICATE, DROP_INJECTED_IN, DROP_INJECTED_OUT, DROP_RESULT_FROM_WORKER, DROP_COUNT


ctypedef struct Job:
    int n, k, slots
    uint64_t joined, left
    sockaddr_in addr[MAX_WORKERS]
    uint32_t *acc          # [2 S][K], host order
    uint64_t *seen         # [2 S] bitmap of workers
    int32_t *count         # [2 S] packets aggregated in the current use (0: idle or done)
    int32_t *offset        # [2 S] the chunk's element offset, as the first packet said
    int32_t *elements      # [2 S] its element count
    int16_t *exponent      # [2 S]
    int16_t *proposal      # [2 S] max of the proposals
    uint8_t *result        # [2 S][HEADER + 4 K] the last result packet of each slot
    int32_t *result_len    # [2 S]
    double last_seen


cdef void job_free(Job *job) noexcept nogil:
    if job != NULL:
        free(job.acc); free(job.seen); free(job.count); free(job.offset)
        free(job.elements); free(job.exponent); free(job.proposal); free(job.result)
        free(job.result_len); free(job)


cdef class Aggregator:
    """One UDP socket's aggregation state: jobs by id, counters, fault injection."""

    cdef int fd
    cdef Job *jobs[65536]
    cdef uint8_t *bufs
    cdef sockaddr_in names[BATCH]
    cdef iovec iovs[BATCH]
    cdef mmsghdr msgs[BATCH]
    cdef public uint64_t packets_in, packets_out, results, retransmits_answered
    cdef uint64_t drops[<int>DROP_COUNT]
    cdef uint32_t drop_in, drop_out, duplicate_out, reorder_out  # ppm
    cdef uint64_t rng
    cdef uint8_t *held              # a packet held back to reorder it after the next one
    cdef Py_ssize_t held_len
    cdef sockaddr_in held_addr
    cdef uint8_t *ctrl              # control packets for Python, [MAX_CONTROL][65536]
    cdef int32_t ctrl_len[MAX_CONTROL]
    cdef sockaddr_in ctrl_addr[MAX_CONTROL]
    cdef int nctrl
    cdef Py_ssize_t bufsize

    def __cinit__(self, int fd, uint64_t seed=0x9E3779B97F4A7C15):
        self.fd = fd
        self.bufsize = 65536
        self.bufs = <uint8_t *>calloc(BATCH, self.bufsize)
        self.ctrl = <uint8_t *>calloc(MAX_CONTROL, self.bufsize)
        self.held = <uint8_t *>calloc(1, self.bufsize)
        if self.bufs == NULL or self.ctrl == NULL or self.held == NULL:
            raise MemoryError("no memory for the aggregator's packet buffers")
        self.rng = seed | 1
        cdef int i
        for i in range(BATCH):
            self.iovs[i].iov_base = self.bufs + i * self.bufsize
            self.iovs[i].iov_len = self.bufsize

    def __dealloc__(self):
        cdef int i
        for i in range(65536):
            job_free(self.jobs[i])
            self.jobs[i] = NULL
        free(self.bufs); free(self.ctrl); free(self.held)

    # -- configuration, from Python --------------------------------------------------

    def add_job(self, int job_id, int n, int k, int slots):
        """Create job ``job_id`` (n workers, K elements, S slots); False if no memory."""
        if self.jobs[job_id] != NULL:
            raise ValueError(f"job {job_id} exists")
        cdef Job *job = <Job *>calloc(1, sizeof(Job))
        if job == NULL:
            return False
        cdef Py_ssize_t cells = 2 * slots, width = HEADER + 4 * k
        job.n, job.k, job.slots = n, k, slots
        job.acc = <uint32_t *>calloc(cells * k, 4)
        job.seen = <uint64_t *>calloc(cells, 8)
        job.count = <int32_t *>calloc(cells, 4)
        job.offset = <int32_t *>calloc(cells, 4)
        job.elements = <int32_t *>calloc(cells, 4)
        job.exponent = <int16_t *>calloc(cells, 2)
        job.proposal = <int16_t *>calloc(cells, 2)
        job.result = <uint8_t *>calloc(cells, width)
        job.result_len = <int32_t *>calloc(cells, 4)
        if (job.acc == NULL or job.seen == NULL or job.count == NULL or job.offset == NULL
                or job.elements == NULL or job.exponent == NULL or job.proposal == NULL
                or job.result == NULL or job.result_len == NULL):
            job_free(job)
            return False
        job.last_seen = monotonic()
        self.jobs[job_id] = job
        return True

    def job_shape(self, int job_id):
        """(n, K, S) of a job, or None."""
        cdef Job *job = self.jobs[job_id]
        return None if job == NULL else (job.n, job.k, job.slots)

    def set_worker(self, int job_id, int worker, uint32_t addr_be, uint16_t port_be):
        """Admit ``worker`` of a job at this address (network-order IPv4 and port).
        False if that worker id is already bound to another address."""
        cdef Job *job = self.jobs[job_id]
        cdef uint64_t bit = (<uint64_t>1) << worker
        if job.joined & bit:
            if (job.addr[worker].sin_addr.s_addr != addr_be
                    or job.addr[worker].sin_port != port_be):
                return False
            return True
        job.addr[worker].sin_family = AF_INET
        job.addr[worker].sin_addr.s_addr = addr_be
        job.addr[worker].sin_port = port_be
        job.joined |= bit
        return True

    def leave(self, int job_id, int worker):
        """A worker left; frees the job once all its joined workers have. True if freed."""
        cdef Job *job = self.jobs[job_id]
        if job == NULL:
            return False
        job.left |= (<uint64_t>1) << worker
        if job.left & job.joined == job.joined:
            self.free_job(job_id)
            return True
        return False

    def free_job(self, int job_id):
        job_free(self.jobs[job_id])
        self.jobs[job_id] = NULL

    def idle_jobs(self, double idle_seconds):
        """Ids of the jobs that sent nothing for idle_seconds (their workers died)."""
        cdef double now = monotonic()
        cdef int i
        return [i for i in range(65536)
                if self.jobs[i] != NULL and now - self.jobs[i].last_seen > idle_seconds]

    def busy_slots(self):
        """Slot versions with a partial aggregation, over all jobs."""
        cdef int i, j
        cdef uint64_t busy = 0
        for i in range(65536):
            if self.jobs[i] != NULL:
                for j in range(2 * self.jobs[i].slots):
                    busy += self.jobs[i].count[j] != 0
        return busy

    def set_faults(self, double drop_in=0, double drop_out=0, double duplicate_out=0,
                   double reorder_out=0):
        """Fault injection, as probabilities (0..1), changeable while running."""
        for name, p in (("drop_in", drop_in), ("drop_out", drop_out),
                        ("duplicate_out", duplicate_out), ("reorder_out", reorder_out)):
            if not 0 <= p <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        self.drop_in = <uint32_t>(drop_in * 1e6)
        self.drop_out = <uint32_t>(drop_out * 1e6)
        self.duplicate_out = <uint32_t>(duplicate_out * 1e6)
        self.reorder_out = <uint32_t>(reorder_out * 1e6)

    def faults(self):
        return {"drop_in": self.drop_in / 1e6, "drop_out": self.drop_out / 1e6,
                "duplicate_out": self.duplicate_out / 1e6,
                "reorder_out": self.reorder_out / 1e6}

    def drop_counts(self):
        return {DROP_REASONS[i]: self.drops[i] for i in range(<int>DROP_COUNT)
                if self.drops[i]}

    def reply(self, bytes packet, uint32_t addr_be, uint16_t port_be):
        cdef sockaddr_in to
        memset(&to, 0, sizeof(to))
        to.sin_family = AF_INET
        to.sin_addr.s_addr = addr_be
        to.sin_port = port_be
        sendto(self.fd, <const char *>packet, len(packet), 0, <sockaddr *>&to, sizeof(to))

    # -- the data path ---------------------------------------------------------------

    def run(self, int timeout_ms):
        """Aggregate until a control packet arrives or timeout_ms pass without traffic;
        returns the control packets as [(bytes, addr_be, port_be)]."""
        cdef int got, i
        cdef pollfd pfd
        pfd.fd = self.fd
        pfd.events = POLLIN
        self.nctrl = 0
        with nogil:
            while self.nctrl == 0:
                for i in range(BATCH):
                    self.msgs[i].msg_hdr.msg_name = &self.names[i]
                    self.msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
                    self.msgs[i].msg_hdr.msg_iov = &self.iovs[i]
                    self.msgs[i].msg_hdr.msg_iovlen = 1
                    self.msgs[i].msg_hdr.msg_control = NULL
                    self.msgs[i].msg_hdr.msg_controllen = 0
                    self.msgs[i].msg_hdr.msg_flags = 0
                got = recvmmsg(self.fd, self.msgs, BATCH, MSG_DONTWAIT, NULL)
                if got <= 0:
                    self.flush_held()
                    if poll(&pfd, 1, timeout_ms) <= 0:
                        break
                    continue
                for i in range(got):
                    self.handle(<uint8_t *>self.iovs[i].iov_base, self.msgs[i].msg_len,
                                &self.names[i])
        out = []
        for i in range(self.nctrl):
            out.append((PyBytes_FromStringAndSize(<char *>self.ctrl + i * self.bufsize,
                                                  self.ctrl_len[i]),
                        self.ctrl_addr[i].sin_addr.s_addr, self.ctrl_addr[i].sin_port))
        return out

    cdef inline bint chance(self, uint32_t ppm) noexcept nogil:
        if ppm == 0:
            return False
        self.rng ^= self.rng << 13
        self.rng ^= self.rng >> 7
        self.rng ^= self.rng << 17
        return (self.rng % 1000000) < ppm

    cdef void send(self, const uint8_t *pkt, Py_ssize_t length,
                   const sockaddr_in *to) noexcept nogil:
        if self.chance(self.drop_out):
            self.drops[<int>DROP_INJECTED_OUT] += 1
            return
        if self.held_len == 0 and self.chance(self.reorder_out):
            memcpy(self.held, pkt, length)
            self.held_len = length
            self.held_addr = to[0]
            return
        sendto(self.fd, pkt, length, 0, <const sockaddr *>to, sizeof(sockaddr_in))
        self.packets_out += 1
        if self.chance(self.duplicate_out):
            sendto(self.fd, pkt, length, 0, <const sockaddr *>to, sizeof(sockaddr_in))
            self.packets_out += 1
        self.flush_held()

    cdef void flush_held(self) noexcept nogil:
        if self.held_len:
            sendto(self.fd, self.held, self.held_len, 0, <const sockaddr *>&self.held_addr,
                   sizeof(sockaddr_in))
            self.packets_out += 1
            self.held_len = 0

    cdef void handle(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        self.packets_in += 1
        if self.chance(self.drop_in):
            self.drops[<int>DROP_INJECTED_IN] += 1
            return
        if length < HEADER or pkt[OFF_VERSION] != VERSION:
            self.drops[<int>DROP_MALFORMED] += 1
            return
        cdef int flags = pkt[OFF_FLAGS]
        if flags & FLAG_CONTROL:
            if self.nctrl < MAX_CONTROL:
                memcpy(self.ctrl + self.nctrl * self.bufsize, pkt, length)
                self.ctrl_len[self.nctrl] = length
                self.ctrl_addr[self.nctrl] = src[0]
                self.nctrl += 1
            return
        if flags & FLAG_RESULT:
            self.drops[<int>DROP_RESULT_FROM_WORKER] += 1
            return
        cdef Job *job = self.jobs[get16(pkt + OFF_JOB)]
        if job == NULL:
            self.drops[<int>DROP_UNKNOWN_JOB] += 1
            return
        cdef int worker = get16(pkt + OFF_WORKER)
        cdef uint64_t bit = (<uint64_t>1) << (worker & 63)
        if (worker >= job.n or not (job.joined & bit)
                or job.addr[worker].sin_addr.s_addr != src.sin_addr.s_addr
                or job.addr[worker].sin_port != src.sin_port):
            self.drops[<int>DROP_UNKNOWN_WORKER] += 1
            return
        cdef uint32_t slot = get32(pkt + OFF_SLOT)
        cdef int ver = pkt[OFF_SLOT_VERSION]
        cdef int elements = get16(pkt + OFF_COUNT)
        if slot >= <uint32_t>job.slots or ver > 1:
            self.drops[<int>DROP_BAD_SLOT] += 1
            return
        if elements < 1 or elements > job.k or length != HEADER + 4 * elements:
            self.drops[<int>DROP_MALFORMED] += 1
            return
        job.last_seen = monotonic()
        cdef Py_ssize_t cell = ver * job.slots + slot
        cdef Py_ssize_t other = (1 - ver) * job.slots + slot
        cdef Py_ssize_t width = HEADER + 4 * job.k
        cdef int32_t offset = <int32_t>get32(pkt + OFF_OFFSET)
        cdef int16_t proposal = <int16_t>get16(pkt + OFF_PROPOSAL)
        cdef uint8_t *result
        cdef int w
        if job.seen[cell] & bit:
            if job.count[cell] == 0 and job.result_len[cell]:
                # Done, and this worker missed the result: answer it alone.
                self.retransmits_answered += 1
                self.send(job.result + cell * width, job.result_len[cell], &job.addr[worker])
            else:
                self.drops[<int>DROP_DUPLICATE] += 1
            return
        if job.count[cell] == 0:
            job.offset[cell] = offset
            job.elements[cell] = elements
            job.exponent[cell] = <int16_t>get16(pkt + OFF_EXPONENT)
            job.proposal[cell] = proposal
            ina_load_be32(job.acc + cell * job.k, <const uint32_t *>(pkt + HEADER), elements)
        else:
            if (offset != job.offset[cell] or elements != job.elements[cell]
                    or <int16_t>get16(pkt + OFF_EXPONENT) != job.exponent[cell]):
                self.drops[<int>DROP_MISMATCH] += 1
                return
            ina_accumulate_be32(job.acc + cell * job.k, <const uint32_t *>(pkt + HEADER),
                                elements)
            if proposal > job.proposal[cell]:
                job.proposal[cell] = proposal
        job.seen[cell] |= bit
        job.seen[other] &= ~bit
        job.count[cell] += 1
        if job.count[cell] < job.n:
            return
        job.count[cell] = 0
        result = job.result + cell * width
        memcpy(result, pkt, HEADER)
        result[OFF_FLAGS] = FLAG_RESULT
        put16(result + OFF_WORKER, 0xffff)
        put16(result + OFF_PROPOSAL, <uint16_t>job.proposal[cell])
        ina_store_be32(<uint32_t *>(result + HEADER), job.acc + cell * job.k, elements)
        job.result_len[cell] = HEADER + 4 * elements
        self.results += 1
        for w in range(job.n):
            self.send(result, job.result_len[cell], &job.addr[w])
