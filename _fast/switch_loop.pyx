# cython: language_level=3
"""The software aggregator's data path: SwitchML's slot rule on batched UDP, no GIL.

``Aggregator.run`` receives datagrams with recvmmsg and, for each data packet, applies
the rule of docs/protocol.md exactly as the P4 program does: per job S slots x 2
versions of K int32 accumulators, a bitmap of workers seen, a count and the max of the
exponent proposals. Control packets (join/leave/probe/faults) are rare: they are
handed back to Python (ina_collectives.switch.server), which configures jobs through the
methods below. Every packet that is neither aggregated nor answered is dropped and
counted by reason.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from blockfp_kernels cimport ina_accumulate_be32, ina_load_be32, ina_store_be32
from netio cimport (AF_INET, MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll, pollfd,
                    prepare_receive, recvmmsg, sendmmsg, sendto, sockaddr,
                    sockaddr_in)

from ina_collectives import protocol as P

include "wire.pxi"

cdef enum:
    BATCH = 64          # datagrams per recvmmsg
    MAX_WORKERS = 64    # bits of a slot's bitmap (protocol.MAX_WORKERS)
    MAX_CONTROL = 64    # control packets held for Python per run()

# Why packets are dropped; the index is the counter's (the P4 program's drop counter
# uses the same indices). The enum below follows protocol.DROP_REASONS.
DROP_REASONS = P.DROP_REASONS
cdef enum Drop:
    DROP_MALFORMED, DROP_UNKNOWN_JOB, DROP_UNKNOWN_WORKER, DROP_BAD_SLOT, DROP_MISMATCH,
    DROP_DUPLICATE, DROP_INJECTED_IN, DROP_INJECTED_OUT, DROP_RESULT_FROM_WORKER, DROP_COUNT
assert len(DROP_REASONS) == DROP_COUNT, "protocol.DROP_REASONS and enum Drop differ"


ctypedef struct Faults:
    uint32_t drop, duplicate, reorder   # probabilities, in parts per million
    double delay                        # seconds


ctypedef struct Held:                   # a packet waiting: reordered or delayed
    uint8_t *data
    Py_ssize_t length
    sockaddr_in addr
    double due


ctypedef struct DelayQueue:             # FIFO: one delay per direction keeps it in order
    Held *items
    int head, size


cdef enum:
    DELAY_CAPACITY = 1024               # packets a direction can hold back


cdef bint queue_push(DelayQueue *q, const uint8_t *pkt, Py_ssize_t length,
                     const sockaddr_in *addr, double due) noexcept nogil:
    cdef int i
    if q.items == NULL:
        q.items = <Held *>calloc(DELAY_CAPACITY, sizeof(Held))
        if q.items == NULL:
            return False
        for i in range(DELAY_CAPACITY):
            q.items[i].data = <uint8_t *>calloc(1, 65536)
            if q.items[i].data == NULL:
                return False
    if q.size == DELAY_CAPACITY:
        return False
    cdef Held *h = &q.items[(q.head + q.size) % DELAY_CAPACITY]
    memcpy(h.data, pkt, length)
    h.length = length
    h.addr = addr[0]
    h.due = due
    q.size += 1
    return True


cdef void queue_free(DelayQueue *q) noexcept nogil:
    cdef int i
    if q.items != NULL:
        for i in range(DELAY_CAPACITY):
            free(q.items[i].data)
        free(q.items)
        q.items = NULL


ctypedef struct Job:
    int n, k, slots
    uint64_t joined, left
    sockaddr_in addr[MAX_WORKERS]
    bint managed           # installed by a controller (P4Runtime): results go to replica[]
    int nreplicas
    sockaddr_in replica[MAX_WORKERS]
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
    cdef sockaddr_in out_names[BATCH]   # the outbox: packets to send with one sendmmsg
    cdef iovec out_iovs[BATCH]
    cdef mmsghdr out_msgs[BATCH]
    cdef int nout
    cdef public uint64_t packets_in, packets_out, results, retransmits_answered
    cdef uint64_t drops[<int>DROP_COUNT]
    cdef Faults faults_in, faults_out
    cdef uint64_t rng
    cdef Held held_in, held_out     # a packet held back to reorder it after the next one
    cdef DelayQueue delayed_in, delayed_out
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
        self.held_in.data = <uint8_t *>calloc(1, self.bufsize)
        self.held_out.data = <uint8_t *>calloc(1, self.bufsize)
        if (self.bufs == NULL or self.ctrl == NULL or self.held_in.data == NULL
                or self.held_out.data == NULL):
            raise MemoryError("no memory for the aggregator's packet buffers")
        self.rng = seed | 1

    def __dealloc__(self):
        cdef int i
        for i in range(65536):
            job_free(self.jobs[i])
            self.jobs[i] = NULL
        free(self.bufs); free(self.ctrl); free(self.held_in.data); free(self.held_out.data)
        queue_free(&self.delayed_in)
        queue_free(&self.delayed_out)

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

    cdef Job *_job(self, int job_id) except NULL:
        if not 0 <= job_id < 65536 or self.jobs[job_id] == NULL:
            raise KeyError(f"no job {job_id}")
        return self.jobs[job_id]

    def set_managed(self, int job_id):
        """The job is a controller's: results go to its replicas (set_replicas), joins and
        leaves do not touch it, and it is never freed as idle."""
        self._job(job_id).managed = True

    def is_managed(self, int job_id):
        return self.jobs[job_id] != NULL and self.jobs[job_id].managed

    def set_replicas(self, int job_id, list replicas):
        """Where a managed job's results go: [(addr_be, port_be)], at most MAX_WORKERS."""
        cdef Job *job = self._job(job_id)
        if len(replicas) > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} replicas, got {len(replicas)}")
        cdef int i = 0
        memset(job.replica, 0, sizeof(job.replica))
        for addr_be, port_be in replicas:
            job.replica[i].sin_family = AF_INET
            job.replica[i].sin_addr.s_addr = addr_be
            job.replica[i].sin_port = port_be
            i += 1
        job.nreplicas = i

    def clear_worker(self, int job_id, int worker):
        """Forget a worker's address: its packets are dropped as from an unknown worker."""
        cdef Job *job = self._job(job_id)
        if not 0 <= worker < MAX_WORKERS:
            raise IndexError(f"worker {worker}")
        job.joined &= ~((<uint64_t>1) << worker)
        memset(&job.addr[worker], 0, sizeof(sockaddr_in))

    def worker_at(self, int job_id, int worker, uint32_t addr_be, uint16_t port_be):
        """Whether ``worker`` of the job is admitted at this address."""
        cdef Job *job = self.jobs[job_id]
        return (job != NULL and 0 <= worker < job.n
                and (job.joined >> worker) & 1
                and job.addr[worker].sin_addr.s_addr == addr_be
                and job.addr[worker].sin_port == port_be)

    # Register access for P4Runtime, per cell of a job (version * S + slot).
    REGISTERS = ("bitmap", "count", "proposal", "chunk")

    def get_cell(self, int job_id, Py_ssize_t cell, what):
        """A cell's bitmap, count, proposal, chunk (offset << 32 | count << 16 | exponent,
        as the P4 program's slot_chunk) or value ``what`` (an int: element index)."""
        cdef Job *job = self._job(job_id)
        if not 0 <= cell < 2 * job.slots:
            raise IndexError(f"cell {cell} of job {job_id} (2 x {job.slots} cells)")
        if what == "bitmap":
            return job.seen[cell]
        if what == "count":
            return <uint32_t>job.count[cell]
        if what == "proposal":
            return <uint16_t>job.proposal[cell]
        if what == "chunk":
            return ((<uint64_t><uint32_t>job.offset[cell]) << 32
                    | (<uint64_t><uint16_t>job.elements[cell]) << 16
                    | <uint16_t>job.exponent[cell])
        cdef int i = what
        if not 0 <= i < job.k:
            raise IndexError(f"element {i} of K {job.k}")
        return job.acc[cell * job.k + i]

    def set_cell(self, int job_id, Py_ssize_t cell, what, uint64_t value):
        cdef Job *job = self._job(job_id)
        if not 0 <= cell < 2 * job.slots:
            raise IndexError(f"cell {cell} of job {job_id} (2 x {job.slots} cells)")
        cdef int i
        if what == "bitmap":
            job.seen[cell] = value
        elif what == "count":
            job.count[cell] = <int32_t>value
        elif what == "proposal":
            job.proposal[cell] = <int16_t><uint16_t>value
        elif what == "chunk":
            job.offset[cell] = <int32_t><uint32_t>(value >> 32)
            job.elements[cell] = <int32_t><uint16_t>(value >> 16)
            job.exponent[cell] = <int16_t><uint16_t>value
        else:
            i = what
            if not 0 <= i < job.k:
                raise IndexError(f"element {i} of K {job.k}")
            job.acc[cell * job.k + i] = <uint32_t>value

    def drop_count(self, int reason):
        if not 0 <= reason < <int>DROP_COUNT:
            raise IndexError(f"drop reason {reason}")
        return self.drops[reason]

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
        if job == NULL or job.managed:
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
                if self.jobs[i] != NULL and not self.jobs[i].managed
                and now - self.jobs[i].last_seen > idle_seconds]

    def busy_slots(self):
        """Slot versions with a partial aggregation, over all jobs."""
        cdef int i, j
        cdef uint64_t busy = 0
        for i in range(65536):
            if self.jobs[i] != NULL:
                for j in range(2 * self.jobs[i].slots):
                    busy += self.jobs[i].count[j] != 0
        return busy

    FAULTS = ("drop", "duplicate", "reorder", "delay_ms")

    def set_faults(self, **faults):
        """Fault injection, changeable while running: ``<fault>_<in|out>`` for fault in
        drop, duplicate, reorder (probabilities) and delay_ms (milliseconds). Faults not
        named are cleared."""
        chosen = {"in": {}, "out": {}}
        for name, value in faults.items():
            fault, _, direction = name.rpartition("_")
            if fault not in self.FAULTS or direction not in ("in", "out"):
                raise ValueError(f"unknown fault {name!r}: expected <fault>_in or "
                                 f"<fault>_out, fault one of {', '.join(self.FAULTS)}")
            if fault == "delay_ms" and not 0 <= value <= 10000:
                raise ValueError(f"{name} must be 0..10000 ms, got {value}")
            if fault != "delay_ms" and not 0 <= value <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
            chosen[direction][fault] = value
        self.faults_in = self._faults(chosen["in"])
        self.faults_out = self._faults(chosen["out"])

    cdef Faults _faults(self, dict chosen):
        cdef Faults f
        f.drop = <uint32_t>(chosen.get("drop", 0) * 1e6 + 0.5)
        f.duplicate = <uint32_t>(chosen.get("duplicate", 0) * 1e6 + 0.5)
        f.reorder = <uint32_t>(chosen.get("reorder", 0) * 1e6 + 0.5)
        f.delay = chosen.get("delay_ms", 0) / 1e3
        return f

    def faults(self):
        out = {}
        cdef Faults f
        for direction in ("in", "out"):
            f = self.faults_in if direction == "in" else self.faults_out
            for name, value in (("drop", f.drop / 1e6), ("duplicate", f.duplicate / 1e6),
                                ("reorder", f.reorder / 1e6), ("delay_ms", f.delay * 1e3)):
                if value:
                    out[f"{name}_{direction}"] = value
        return out

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
        cdef int got, i, wait_ms
        cdef pollfd pfd
        cdef double idle_since
        pfd.fd = self.fd
        pfd.events = POLLIN
        self.nctrl = 0
        with nogil:
            idle_since = monotonic()
            while self.nctrl == 0:
                self.release_due(monotonic())
                prepare_receive(self.msgs, self.iovs, self.bufs, self.bufsize, BATCH,
                                self.names)
                got = recvmmsg(self.fd, self.msgs, BATCH, MSG_DONTWAIT, NULL)
                if got <= 0:
                    self.flush_held_in()
                    self.flush_held_out()
                    wait_ms = self.next_due_ms(timeout_ms)
                    if poll(&pfd, 1, wait_ms) <= 0:
                        if (self.delayed_in.size == 0 and self.delayed_out.size == 0
                                and monotonic() - idle_since >= timeout_ms / 1e3):
                            break
                    continue
                idle_since = monotonic()
                for i in range(got):
                    self.receive(<uint8_t *>self.iovs[i].iov_base, self.msgs[i].msg_len,
                                 &self.names[i])
                self.flush_outbox()
            self.flush_outbox()
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

    # -- fault injection around the rule: in = as received, out = as sent ------------

    cdef int next_due_ms(self, int limit) noexcept nogil:
        cdef double due = 1e300, now = monotonic()
        if self.delayed_in.size:
            due = self.delayed_in.items[self.delayed_in.head].due
        if self.delayed_out.size:
            due = min(due, self.delayed_out.items[self.delayed_out.head].due)
        if due == 1e300:
            return limit
        return <int>min(<double>limit, max(0.0, (due - now) * 1e3) + 1)

    cdef void release_due(self, double now) noexcept nogil:
        cdef Held *h
        while self.delayed_in.size:
            h = &self.delayed_in.items[self.delayed_in.head]
            if h.due > now:
                break
            self.delayed_in.head = (self.delayed_in.head + 1) % DELAY_CAPACITY
            self.delayed_in.size -= 1
            self.deliver(h.data, h.length, &h.addr)
        while self.delayed_out.size:
            h = &self.delayed_out.items[self.delayed_out.head]
            if h.due > now:
                break
            self.delayed_out.head = (self.delayed_out.head + 1) % DELAY_CAPACITY
            self.delayed_out.size -= 1
            self.transmit(h.data, h.length, &h.addr)
            self.flush_outbox()  # before the queue can reuse h.data

    cdef void receive(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        self.packets_in += 1
        if self.chance(self.faults_in.drop):
            self.drops[<int>DROP_INJECTED_IN] += 1
            return
        if self.faults_in.delay > 0 and queue_push(&self.delayed_in, pkt, length, src,
                                                   monotonic() + self.faults_in.delay):
            return
        self.deliver(pkt, length, src)

    cdef void deliver(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        if self.held_in.length == 0 and self.chance(self.faults_in.reorder):
            memcpy(self.held_in.data, pkt, length)
            self.held_in.length = length
            self.held_in.addr = src[0]
            return
        self.handle(pkt, length, src)
        if self.chance(self.faults_in.duplicate):
            self.handle(pkt, length, src)
        self.flush_held_in()

    cdef void flush_held_in(self) noexcept nogil:
        cdef Py_ssize_t length = self.held_in.length
        if length:
            self.held_in.length = 0
            self.handle(self.held_in.data, length, &self.held_in.addr)

    cdef void send(self, const uint8_t *pkt, Py_ssize_t length,
                   const sockaddr_in *to) noexcept nogil:
        if self.chance(self.faults_out.drop):
            self.drops[<int>DROP_INJECTED_OUT] += 1
            return
        if self.faults_out.delay > 0 and queue_push(&self.delayed_out, pkt, length, to,
                                                    monotonic() + self.faults_out.delay):
            return
        self.transmit(pkt, length, to)

    cdef void transmit(self, const uint8_t *pkt, Py_ssize_t length,
                       const sockaddr_in *to) noexcept nogil:
        if self.held_out.length == 0 and self.chance(self.faults_out.reorder):
            memcpy(self.held_out.data, pkt, length)
            self.held_out.length = length
            self.held_out.addr = to[0]
            return
        self.emit(pkt, length, to)
        if self.chance(self.faults_out.duplicate):
            self.emit(pkt, length, to)
        self.flush_held_out()

    cdef void flush_held_out(self) noexcept nogil:
        if self.held_out.length:
            self.emit(self.held_out.data, self.held_out.length, &self.held_out.addr)
            self.flush_outbox()  # before held_out.data can hold another packet
            self.held_out.length = 0

    cdef void emit(self, const uint8_t *pkt, Py_ssize_t length,
                   const sockaddr_in *to) noexcept nogil:
        """Queue a packet in the outbox; pkt must stay unchanged until flush_outbox."""
        if self.nout == BATCH:
            self.flush_outbox()
        cdef int i = self.nout
        self.out_iovs[i].iov_base = <void *>pkt
        self.out_iovs[i].iov_len = length
        self.out_names[i] = to[0]
        memset(&self.out_msgs[i].msg_hdr, 0, sizeof(self.out_msgs[i].msg_hdr))
        self.out_msgs[i].msg_hdr.msg_name = &self.out_names[i]
        self.out_msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
        self.out_msgs[i].msg_hdr.msg_iov = &self.out_iovs[i]
        self.out_msgs[i].msg_hdr.msg_iovlen = 1
        self.nout += 1
        self.packets_out += 1

    cdef void flush_outbox(self) noexcept nogil:
        """Send the outbox with sendmmsg; what the kernel refuses is lost, as on a link."""
        cdef int sent = 0, r
        while sent < self.nout:
            r = sendmmsg(self.fd, &self.out_msgs[sent], self.nout - sent, 0)
            if r <= 0:
                break
            sent += r
        self.nout = 0

    cdef void handle(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        """The aggregation rule (docs/protocol.md) for one packet as the switch sees it."""
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
        if job.managed:  # the replicas a controller installed (multicast group + rewrites)
            for w in range(job.nreplicas):
                self.send(result, job.result_len[cell], &job.replica[w])
        else:
            for w in range(job.n):
                self.send(result, job.result_len[cell], &job.addr[w])
