# cython: language_level=3
"""The software aggregator's data path: SwitchML's slot rule on batched UDP, no GIL.

``Aggregator.run`` receives datagrams with recvmmsg and, for each data packet, applies
the rule of docs/protocol.md exactly as the P4 program does: per job S slots x 2
versions of K accumulators (int32 or int16, the job's value width), a bitmap of workers
seen, a count, and per sub-block of B values the chunk's exponent and the max of the
exponent proposals. A chunk completes when all n workers contributed, or, in a quorum
call (the packets' ``quorum`` k, docs/quorum.md), when k did: a later packet for it is
not added (a retransmission gets the result back). Control packets (join/leave/probe/
faults) are rare: they are handed back to Python (ina_collectives.switch.server), which
configures jobs through the methods below. Every packet that is neither aggregated nor
answered is dropped and counted by reason.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport ENOBUFS
from libc.stdint cimport int16_t, int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from blockfp_kernels cimport (ina_accumulate_be16, ina_accumulate_be32, ina_load_be16,
                              ina_load_be32, ina_store_be16, ina_store_be32)
from byteorder cimport get16, get32, get64, put16, put32, put64
from netio cimport (EINTR, MSG_DONTWAIT, POLLIN, iovec, mmsghdr, monotonic, poll,
                    pollfd, prepare_receive, recvmmsg, sendmmsg, sendto, set_sockaddr,
                    sockaddr, sockaddr_in, try_again)

from udp_batch cimport INA_GRO_CONTROL, ina_attach_controls, ina_segments, ina_send_batch

from ina_collectives import protocol as P

include "header.pxi"

cdef enum:
    # A predicted use's marks (control/schema.py's MARK_*, the P4 program's slot_marks)
    MARK_PREDICTED = 1
    MARK_MISMATCH = 2
    MARK_OVERFLOW = 4

cdef enum:
    BATCH = 64          # datagrams per recvmmsg
    MAX_WORKERS = 64    # bits of a slot's bitmap (protocol.MAX_WORKERS)
    MAX_CONTROL = 64    # control packets held for Python per run()
    MAX_GAP = 64        # more packet numbers missing than this: lost track, no NACK
    NACK_BUFFERS = 4    # NACKs of one worker that may wait in the outbox at once

# Why packets are dropped; the index is the counter's (the P4 program's drop counter
# uses the same indices). The enum below follows protocol.DROP_REASONS.
DROP_REASONS = P.DROP_REASONS
cdef enum Drop:
    DROP_MALFORMED, DROP_UNKNOWN_JOB, DROP_UNKNOWN_WORKER, DROP_BAD_SLOT, DROP_MISMATCH,
    DROP_DUPLICATE, DROP_INJECTED_IN, DROP_INJECTED_OUT, DROP_RESULT_FROM_WORKER, DROP_STALE,
    DROP_LATE, DROP_COUNT
assert len(DROP_REASONS) == DROP_COUNT, "protocol.DROP_REASONS and enum Drop differ"

# What this aggregator serves (protocol.CAP_*), all of it unless a switch stands in for a
# smaller build (ina-switch --like tofino): what it leaves out, it drops as malformed.
cdef int CAP_NACKS = P.CAP_NACKS
cdef int CAP_NARROW = P.CAP_NARROW
cdef int CAP_OPEN = P.CAP_OPEN
cdef int CAP_PREDICT = P.CAP_PREDICT
cdef int CAP_QUORUM = P.CAP_QUORUM
FEATURES = CAP_NACKS | CAP_NARROW | CAP_OPEN | CAP_PREDICT | CAP_QUORUM


ctypedef struct Job:
    int n, k, slots
    int block, bits        # B values per sub-block, value width (16 or 32)
    int pairs              # G = ceil(K / B): sub-blocks of a full chunk
    Py_ssize_t width       # bytes of a full result packet
    uint64_t joined, left
    sockaddr_in addr[MAX_WORKERS]
    bint managed           # installed by a controller (P4Runtime): results go to replica[]
    int nreplicas
    sockaddr_in replica[MAX_WORKERS]
    uint8_t *acc           # [2 S][K] values of the job's width, host order
    uint64_t *seen         # [2 S] bitmap of workers
    int32_t *count         # [2 S] packets aggregated in the current use (0: idle or done)
    int32_t *offset        # [2 S] the chunk's element offset, as the first packet said
    int32_t *elements      # [2 S] its element count
    uint8_t *cell_bits     # [2 S] its value width (a 32-bit job also takes 16-bit calls)
    int16_t *exponent      # [2 S][G] the chunk's exponents
    int16_t *proposal      # [2 S][G] max of the proposals
    uint16_t *epoch        # [2 S] the epoch of the run that last used the cell
    uint16_t *call         # [2 S] the call number of the chunk (with offset: which chunk)
    uint8_t *need          # [2 S] its quorum k (0: all n)
    uint64_t *counted      # [2 S] the workers its result counted
    uint8_t *opened        # [2 S] bit 0: the use is a call's opening; bit 1: identities differed
    uint8_t *marks         # [2 S] a predicted use's MARK_* (docs/protocol.md, One round trip)
    uint64_t *ident        # [2 S] the identity a predicted use's first packet carried
    int mode_quorum        # the mode the control plane asks for (0 sync, else quorum k)
    uint32_t mode_generation  # counted up by each change of it
    uint8_t *result        # [2 S][width] the last result packet of each slot
    uint8_t next_seq[MAX_WORKERS]      # each worker's next packet number (check_sequence)
    uint16_t seq_epoch[MAX_WORKERS]    # the run those numbers are of
    uint8_t *nack          # [MAX_WORKERS][NACK_BUFFERS][HEADER]: NACKs sent from here
    # [S][MAX_WORKERS] each worker's latest two packets to each slot, 16 bits each (the
    # older above): 0x200 | version << 8 | seq (is_stale); 0: none
    uint32_t *last_seq
    uint8_t nack_at[MAX_WORKERS]
    int32_t *result_len    # [2 S]
    uint64_t results       # results multicast (the status line's per-job counter)
    double last_seen
    # A leaf of an aggregation tree (docs/trees.md): a cell its workers completed goes up
    # to the parent as one worker's packet (worker up_worker of the same job id there),
    # kept in result[cell] (up_len bytes) until the parent's result comes down.
    bint up
    sockaddr_in parent
    uint16_t up_worker
    uint8_t up_seq                     # the next packet number sent up
    int32_t up_cell[256]               # the cell each packet number sent up was (-1: none)
    uint8_t *lifted        # [2 S] 1: sent up, the parent's result awaited
    int32_t *up_len        # [2 S]


cdef void job_free(Job *job) noexcept nogil:
    if job != NULL:
        free(job.acc)
        free(job.seen)
        free(job.count)
        free(job.offset)
        free(job.elements)
        free(job.cell_bits)
        free(job.exponent)
        free(job.proposal)
        free(job.epoch)
        free(job.call)
        free(job.need)
        free(job.counted)
        free(job.opened)
        free(job.marks)
        free(job.ident)
        free(job.result)
        free(job.nack)
        free(job.last_seq)
        free(job.result_len)
        free(job.lifted)
        free(job.up_len)
        free(job)


cdef inline void idle_cell(Job *job, Py_ssize_t cell, uint16_t epoch) noexcept nogil:
    """A cell last used by another run (epoch) of the job: idle, now this run's."""
    job.epoch[cell] = epoch
    job.marks[cell] = 0
    job.seen[cell] = 0
    job.count[cell] = 0
    job.result_len[cell] = 0
    job.lifted[cell] = 0


cdef inline void keep_max(int16_t *proposals, const uint8_t *pairs, int blocks
                          ) noexcept nogil:
    """A cell's max proposals, with a packet's (its pairs') taken in."""
    cdef int j
    cdef int16_t proposal
    for j in range(blocks):
        proposal = <int16_t>get16(pairs + PAIR * j + 2)
        if proposal > proposals[j]:
            proposals[j] = proposal


cdef inline int32_t count_in(Job *job, Py_ssize_t cell, Py_ssize_t other,
                             uint64_t bit) noexcept nogil:
    """The worker (``bit``) counted in the cell, and cleared in the slot's other one
    (it has left that use behind); the cell's count now."""
    job.seen[cell] |= bit
    job.seen[other] &= ~bit
    job.count[cell] += 1
    return job.count[cell]


cdef inline Job *find_job(Job **jobs, int job_id) noexcept nogil:
    """The job of an id, NULL if there is none or the id is not 0..65535: the one bounds
    check of every access by job id (the data path's and Python's)."""
    return jobs[job_id] if 0 <= job_id < 65536 else NULL


include "switch_faults.pxi"
include "syscall.pxi"


cdef class Aggregator(FaultInjection):
    """One UDP socket's aggregation state: jobs by id, counters; fault injection comes
    from FaultInjection (switch_faults.pxi)."""

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
    cdef public uint64_t nacks  # workers told that their packet for a chunk never came
    cdef public uint64_t held_replies  # workers told that their resent packet is held
    cdef public uint64_t result_requests  # header-only retransmissions (answer_request)
    cdef public uint64_t late_answered  # quorum: resends of a finished chunk, answered
    cdef public uint64_t openings  # calls' openings completed (not chunks: not in results)
    cdef public uint64_t send_failures  # datagrams the kernel refused (lost, as on a link)
    # A tree's leaf: partial sums sent up to the parent, sent again (a worker asked, the
    # parent NACKed), and results that came down (or came stale, for no cell waiting)
    cdef public uint64_t sent_up, resent_up, came_down, stale_down, parent_held, parent_nacks
    cdef public bint leaves  # some job is a tree's leaf here (results may come from a parent)
    # 1: results leave with UDP_SEGMENT, one send per run of a worker's equal-sized results
    # (cleared if the kernel refuses it); 0: sendmmsg of the whole outbox
    cdef public int gso
    cdef public long send_calls         # system calls that sent the outbox
    cdef public uint64_t gro_buffers    # received buffers that held several datagrams
    cdef char controls[BATCH * 64]      # INA_GRO_CONTROL bytes per received message
    cdef public int last_errno          # why the last one was refused
    cdef public uint64_t control_overflow  # control packets lost: MAX_CONTROL held already
    # protocol.CAP_* this aggregator serves and announces (FEATURES: all); a packet that
    # needs one it lacks is malformed, and it sends no NACK or held answer without
    # CAP_NACKS
    cdef public int features
    cdef uint64_t drops[<int>DROP_COUNT]
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
        if self.bufs == NULL or self.ctrl == NULL:
            raise MemoryError("no memory for the aggregator's packet buffers")
        self.rng = seed | 1
        self.features = FEATURES

    def __dealloc__(self):
        cdef int i
        for i in range(65536):
            job_free(self.jobs[i])
            self.jobs[i] = NULL
        free(self.bufs)
        free(self.ctrl)

    # -- configuration, from Python --------------------------------------------------

    # Every accessor finds its job through find_job (NULL for a missing or impossible id):
    # _job raises KeyError for the ones that need the job; the queries answer False/None.

    cdef Job *_job(self, int job_id) except NULL:
        cdef Job *job = find_job(self.jobs, job_id)
        if job == NULL:
            raise KeyError(f"no job {job_id}")
        return job

    cdef int _check_worker(self, Job *job, int job_id, int worker) except -1:
        if not 0 <= worker < job.n:
            raise IndexError(f"worker {worker} of job {job_id}, which has {job.n} workers")
        return 0

    def add_job(self, int job_id, int n, int k, int slots, int block=P.DEFAULT_BLOCK,
                int value_bits=32):
        """Create job ``job_id`` (n workers, K values of ``value_bits`` per packet in
        sub-blocks of ``block``, S slots); False if no memory."""
        if not 0 <= job_id < 65536:
            raise KeyError(f"job id {job_id} is not 0..65535")
        if find_job(self.jobs, job_id) != NULL:
            raise ValueError(f"job {job_id} exists")
        if not (1 <= n <= MAX_WORKERS and k >= 1 and slots >= 1):
            raise ValueError(f"job {job_id}: n {n} (1..{MAX_WORKERS}), K {k}, S {slots}")
        P.check_format(block, value_bits)
        if P.packet_bytes(k, block, value_bits) > P.MAX_DATAGRAM:
            raise ValueError(f"job {job_id}: K {k} of {value_bits} bits in sub-blocks of "
                             f"{block} exceeds a datagram")
        cdef Job *job = <Job *>calloc(1, sizeof(Job))
        if job == NULL:
            return False
        cdef Py_ssize_t cells = 2 * slots, g = P.sub_blocks(k, block)
        cdef Py_ssize_t width = P.packet_bytes(k, block, value_bits)
        job.n, job.k, job.slots = n, k, slots
        job.block, job.bits, job.pairs, job.width = block, value_bits, g, width
        job.acc = <uint8_t *>calloc(cells * k, value_bits // 8)
        job.seen = <uint64_t *>calloc(cells, 8)
        job.count = <int32_t *>calloc(cells, 4)
        job.offset = <int32_t *>calloc(cells, 4)
        job.elements = <int32_t *>calloc(cells, 4)
        job.cell_bits = <uint8_t *>calloc(cells, 1)
        job.exponent = <int16_t *>calloc(cells * g, 2)
        job.proposal = <int16_t *>calloc(cells * g, 2)
        job.epoch = <uint16_t *>calloc(cells, 2)
        job.call = <uint16_t *>calloc(cells, 2)
        job.need = <uint8_t *>calloc(cells, 1)
        job.counted = <uint64_t *>calloc(cells, 8)
        job.opened = <uint8_t *>calloc(cells, 1)
        job.marks = <uint8_t *>calloc(cells, 1)
        job.ident = <uint64_t *>calloc(cells, 8)
        job.result = <uint8_t *>calloc(cells, width)
        job.result_len = <int32_t *>calloc(cells, 4)
        job.nack = <uint8_t *>calloc(MAX_WORKERS * NACK_BUFFERS, HEADER)
        job.last_seq = <uint32_t *>calloc(slots * MAX_WORKERS, 4)
        job.lifted = <uint8_t *>calloc(cells, 1)
        job.up_len = <int32_t *>calloc(cells, 4)
        if (job.acc == NULL or job.seen == NULL or job.count == NULL or job.offset == NULL
                or job.elements == NULL or job.cell_bits == NULL or job.exponent == NULL
                or job.proposal == NULL or job.call == NULL or job.need == NULL
                or job.counted == NULL or job.opened == NULL or job.marks == NULL
                or job.ident == NULL
                or job.epoch == NULL or job.result == NULL or job.result_len == NULL
                or job.nack == NULL or job.last_seq == NULL or job.lifted == NULL
                or job.up_len == NULL):
            job_free(job)
            return False
        job.last_seen = monotonic()
        self.jobs[job_id] = job
        return True

    def set_managed(self, int job_id):
        """The job is a controller's: results go to its replicas (set_replicas), joins and
        leaves do not touch it, and it is never freed as idle."""
        self._job(job_id).managed = True

    def set_parent(self, int job_id, uint32_t addr_be, uint16_t port_be, int worker):
        """The job is a tree's leaf here (docs/trees.md): a cell its workers completed goes
        to the parent at this address as worker ``worker`` of the same job id, and the
        result the parent sends down goes to the workers."""
        cdef Job *job = self._job(job_id)
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker {worker} at the parent: 0..{MAX_WORKERS - 1}")
        set_sockaddr(&job.parent, addr_be, port_be)
        job.up_worker = <uint16_t>worker
        job.up = True
        self.leaves = True
        cdef int i
        for i in range(256):
            job.up_cell[i] = -1

    def clear_parent(self, int job_id):
        """The job is no tree's leaf here any more: completed cells go to its workers."""
        self._job(job_id).up = False

    def is_managed(self, int job_id):
        cdef Job *job = find_job(self.jobs, job_id)
        return job != NULL and job.managed

    def set_replicas(self, int job_id, list replicas):
        """Where a managed job's results go: [(addr_be, port_be)], at most MAX_WORKERS."""
        cdef Job *job = self._job(job_id)
        if len(replicas) > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} replicas, got {len(replicas)}")
        cdef int i = 0
        memset(job.replica, 0, sizeof(job.replica))
        for addr_be, port_be in replicas:
            set_sockaddr(&job.replica[i], addr_be, port_be)
            i += 1
        job.nreplicas = i

    def clear_worker(self, int job_id, int worker):
        """Forget a worker's address: its packets are dropped as from an unknown worker."""
        cdef Job *job = self._job(job_id)
        self._check_worker(job, job_id, worker)
        job.joined &= ~((<uint64_t>1) << worker)
        memset(&job.addr[worker], 0, sizeof(sockaddr_in))

    def worker_at(self, int job_id, int worker, uint32_t addr_be, uint16_t port_be):
        """Whether ``worker`` of the job is admitted at this address."""
        cdef Job *job = find_job(self.jobs, job_id)
        return (job != NULL and 0 <= worker < job.n
                and (job.joined >> worker) & 1
                and job.addr[worker].sin_addr.s_addr == addr_be
                and job.addr[worker].sin_port == port_be)

    def set_mode(self, int job_id, int quorum, uint32_t generation):
        """The mode the control plane asks of a job: 0 sync, else quorum k (1..n); its
        results announce it with ``generation``, and the workers adopt it at a call
        boundary (docs/quorum.md)."""
        cdef Job *job = self._job(job_id)
        if not 0 <= quorum <= job.n:
            raise ValueError(f"job {job_id} has {job.n} workers: quorum {quorum} is not "
                             f"0 (sync) .. {job.n}")
        job.mode_quorum, job.mode_generation = quorum, generation

    def mode(self, int job_id):
        """(quorum, generation) the job's results announce, or None if there is no job."""
        cdef Job *job = find_job(self.jobs, job_id)
        return None if job == NULL else (job.mode_quorum, job.mode_generation)

    # Register access for P4Runtime, per cell of a job (version * S + slot).
    REGISTERS = ("bitmap", "count", "chunk", "epoch", "call", "contributors", "ident",
                 "marks", "exponent", "proposal")

    cdef Py_ssize_t _pair(self, Job *job, Py_ssize_t cell, what) except -1:
        """The index of ("exponent" | "proposal", g) in the job's [2 S][G] arrays."""
        g = what[1]
        if not 0 <= g < job.pairs:
            raise IndexError(f"sub-block {g} of {job.pairs}")
        return cell * job.pairs + g

    def get_cell(self, int job_id, Py_ssize_t cell, what):
        """A cell's bitmap, count, epoch, chunk (offset << 32 | count << 16 | sub-blocks,
        as the P4 program's slot_chunk), ("exponent", g) or ("proposal", g) (16-bit
        patterns) or value ``what`` (an int: element index; a value-bits pattern)."""
        cdef Job *job = self._job(job_id)
        if not 0 <= cell < 2 * job.slots:
            raise IndexError(f"cell {cell} of job {job_id} (2 x {job.slots} cells)")
        if what == "bitmap":
            return job.seen[cell]
        if what == "count":
            return <uint32_t>job.count[cell]
        if what == "epoch":
            return job.epoch[cell]
        if what == "call":  # call ++ quorum, as the P4 program's slot_call
            return <uint32_t>job.call[cell] << 8 | job.need[cell]
        if what == "contributors":
            return job.counted[cell]
        if what == "ident":
            return job.ident[cell]
        if what == "marks":
            return job.marks[cell]
        if what == "chunk":
            return ((<uint64_t><uint32_t>job.offset[cell]) << 32
                    | (<uint64_t><uint16_t>job.elements[cell]) << 16
                    | <uint16_t>((job.elements[cell] + job.block - 1) // job.block))
        if isinstance(what, tuple) and what[0] == "exponent":
            return <uint16_t>job.exponent[self._pair(job, cell, what)]
        if isinstance(what, tuple) and what[0] == "proposal":
            return <uint16_t>job.proposal[self._pair(job, cell, what)]
        cdef int i = what
        if not 0 <= i < job.k:
            raise IndexError(f"element {i} of K {job.k}")
        if (job.cell_bits[cell] or job.bits) == 16:  # the width of its latest chunk
            return (<uint16_t *>(job.acc + cell * job.k * (job.bits // 8)))[i]
        return (<uint32_t *>job.acc)[cell * job.k + i]

    def set_cell(self, int job_id, Py_ssize_t cell, what, uint64_t value):
        cdef Job *job = self._job(job_id)
        if not 0 <= cell < 2 * job.slots:
            raise IndexError(f"cell {cell} of job {job_id} (2 x {job.slots} cells)")
        cdef int i
        if what == "bitmap":
            job.seen[cell] = value
        elif what == "count":
            job.count[cell] = <int32_t>value
        elif what == "epoch":
            job.epoch[cell] = <uint16_t>value
        elif what == "call":
            job.call[cell] = <uint16_t>(value >> 8)
            job.need[cell] = <uint8_t>value
        elif what == "contributors":
            job.counted[cell] = value
        elif what == "ident":
            job.ident[cell] = value
        elif what == "marks":
            job.marks[cell] = <uint8_t>value
        elif what == "chunk":
            job.offset[cell] = <int32_t><uint32_t>(value >> 32)
            job.elements[cell] = <int32_t><uint16_t>(value >> 16)
        elif isinstance(what, tuple) and what[0] == "exponent":
            job.exponent[self._pair(job, cell, what)] = <int16_t><uint16_t>value
        elif isinstance(what, tuple) and what[0] == "proposal":
            job.proposal[self._pair(job, cell, what)] = <int16_t><uint16_t>value
        else:
            i = what
            if not 0 <= i < job.k:
                raise IndexError(f"element {i} of K {job.k}")
            if (job.cell_bits[cell] or job.bits) == 16:
                (<uint16_t *>(job.acc + cell * job.k * (job.bits // 8)))[i] = <uint16_t>value
            else:
                (<uint32_t *>job.acc)[cell * job.k + i] = <uint32_t>value

    def drop_count(self, int reason):
        if not 0 <= reason < <int>DROP_COUNT:
            raise IndexError(f"drop reason {reason}")
        return self.drops[reason]

    def job_shape(self, int job_id):
        """(n, K, S, B, value bits) of a job, or None."""
        cdef Job *job = find_job(self.jobs, job_id)
        return None if job == NULL else (job.n, job.k, job.slots, job.block, job.bits)

    def job_ids(self):
        """The ids of the jobs present, in order."""
        cdef int i
        return [i for i in range(65536) if self.jobs[i] != NULL]

    def job_results(self, int job_id):
        """Results a job's slots have multicast, or None if there is no such job."""
        cdef Job *job = find_job(self.jobs, job_id)
        return None if job == NULL else job.results

    def set_worker(self, int job_id, int worker, uint32_t addr_be, uint16_t port_be):
        """Admit ``worker`` of a job at this address (network-order IPv4 and port).
        False if that worker id is already bound to another address, or if there is no
        such job or worker."""
        cdef Job *job = find_job(self.jobs, job_id)
        if job == NULL or not 0 <= worker < job.n:
            return False
        cdef uint64_t bit = (<uint64_t>1) << worker
        if job.joined & bit:
            if (job.addr[worker].sin_addr.s_addr != addr_be
                    or job.addr[worker].sin_port != port_be):
                return False
            return True
        set_sockaddr(&job.addr[worker], addr_be, port_be)
        job.joined |= bit
        return True

    def leave(self, int job_id, int worker):
        """A worker left; frees the job once all its joined workers have. True if freed."""
        cdef Job *job = find_job(self.jobs, job_id)
        if job == NULL or job.managed or not 0 <= worker < job.n:
            return False
        job.left |= (<uint64_t>1) << worker
        if job.left & job.joined == job.joined:
            self.free_job(job_id)
            return True
        return False

    def free_job(self, int job_id):
        """Forget a job and its state; KeyError if there is none."""
        job_free(self._job(job_id))
        self.jobs[job_id] = NULL  # _job checked the id

    def idle_jobs(self, double idle_seconds):
        """Ids of the jobs that sent nothing for idle_seconds (their workers died)."""
        cdef double now = monotonic()
        cdef int i
        cdef Job *job
        idle = []
        for i in range(65536):
            job = find_job(self.jobs, i)
            if job != NULL and not job.managed and now - job.last_seen > idle_seconds:
                idle.append(i)
        return idle

    def busy_slots(self):
        """Slot versions with a partial aggregation, over all jobs."""
        cdef int i, j
        cdef uint64_t busy = 0
        cdef Job *job
        for i in range(65536):
            job = find_job(self.jobs, i)
            if job != NULL:
                for j in range(2 * job.slots):
                    busy += job.count[j] != 0
        return busy

    def drop_counts(self):
        return {DROP_REASONS[i]: self.drops[i] for i in range(<int>DROP_COUNT)
                if self.drops[i]}

    def reply(self, bytes packet, uint32_t addr_be, uint16_t port_be):
        """Send one control reply; SystemCallError (with errno) if the kernel refuses."""
        cdef sockaddr_in to
        set_sockaddr(&to, addr_be, port_be)
        if sendto(self.fd, <const char *>packet, len(packet), 0, <sockaddr *>&to,
                  sizeof(to)) < 0:
            raise_errno(errno, "sendto of a control reply to", self.fd, &to)

    # -- the data path ---------------------------------------------------------------

    def run(self, int timeout_ms):
        """Aggregate until a control packet arrives or timeout_ms pass without traffic;
        returns the control packets as [(bytes, addr_be, port_be)]. SystemCallError if
        receiving fails (not for EAGAIN or EINTR)."""
        cdef int got, i, wait_ms, ready
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
                ina_attach_controls(self.msgs, self.controls, INA_GRO_CONTROL, BATCH)
                got = recvmmsg(self.fd, self.msgs, BATCH, MSG_DONTWAIT, NULL)
                if got < 0 and not try_again(errno):
                    raise_errno(errno, "recvmmsg on the aggregator's socket", self.fd, NULL)
                if got <= 0:
                    self.flush_held_in()
                    self.flush_held_out()
                    wait_ms = self.next_due_ms(timeout_ms)
                    ready = poll(&pfd, 1, wait_ms)
                    if ready < 0 and not try_again(errno):
                        raise_errno(errno, "poll of the aggregator's socket", self.fd, NULL)
                    if ready <= 0:
                        if (not self.holding_delayed()
                                and monotonic() - idle_since >= timeout_ms / 1e3):
                            break
                    continue
                idle_since = monotonic()
                for i in range(got):
                    self.receive_buffer(i)
                self.flush_outbox()
            self.flush_outbox()
        out = []
        for i in range(self.nctrl):
            out.append((PyBytes_FromStringAndSize(<char *>self.ctrl + i * self.bufsize,
                                                  self.ctrl_len[i]),
                        self.ctrl_addr[i].sin_addr.s_addr, self.ctrl_addr[i].sin_port))
        return out

    cdef void injected_drop(self, bint inbound) noexcept nogil:
        self.drops[<int>(DROP_INJECTED_IN if inbound else DROP_INJECTED_OUT)] += 1

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

    cdef void receive_buffer(self, int i) noexcept nogil:
        """Received message i: one datagram, or several of one sender back to back
        (UDP_GRO), each taken as it came."""
        cdef uint8_t *ptrs[64]
        cdef int32_t lens[64]
        cdef int j, n = ina_segments(&self.msgs[i].msg_hdr, <uint8_t *>self.iovs[i].iov_base,
                                     self.msgs[i].msg_len, ptrs, lens, 64)
        self.gro_buffers += n > 1
        self.packets_in += n
        for j in range(n):
            self.receive(ptrs[j], lens[j], &self.names[i])

    cdef void flush_outbox(self) noexcept nogil:
        """Send the outbox: each worker's results with UDP_SEGMENT (one send per run of
        equal-sized ones, in their order) while self.gso, else all with sendmmsg. What
        the kernel refuses is lost, as on a link."""
        cdef int sent = 0, r, i, j, n
        cdef long refused = 0
        cdef uint8_t *bufs[BATCH]
        cdef int32_t lens[BATCH]
        cdef uint8_t taken[BATCH]
        if self.gso:
            memset(taken, 0, BATCH)
            for i in range(self.nout):
                if taken[i]:
                    continue
                n = 0
                for j in range(i, self.nout):
                    if (not taken[j]
                            and self.out_names[j].sin_addr.s_addr
                            == self.out_names[i].sin_addr.s_addr
                            and self.out_names[j].sin_port == self.out_names[i].sin_port):
                        bufs[n] = <uint8_t *>self.out_iovs[j].iov_base
                        lens[n] = <int32_t>self.out_iovs[j].iov_len
                        taken[j] = 1
                        n += 1
                refused = 0
                if ina_send_batch(self.fd, &self.out_names[i], bufs, lens, n, &self.gso,
                                  &self.send_calls, &refused) < 0:
                    self.send_failures += 1  # (and that worker's others of this batch)
                    self.last_errno = errno
                elif refused:
                    self.send_failures += refused
                    self.last_errno = ENOBUFS
            self.nout = 0
            return
        while sent < self.nout:
            self.send_calls += 1
            r = sendmmsg(self.fd, &self.out_msgs[sent], self.nout - sent, 0)
            if r < 0 and errno == EINTR:  # a signal came first: nothing was sent, again
                continue
            if r < 0:  # the first one was refused: count it with its errno, go on
                self.send_failures += 1
                self.last_errno = errno
                r = 1
            sent += r
        self.nout = 0

    cdef void answer_request(self, Job *job, const uint8_t *pkt, int worker, uint64_t bit,
                             Py_ssize_t cell) noexcept nogil:
        """A result request (a retransmission with no values: the worker's packet came,
        it thinks, but not the result): the result again if the cell is done with that
        chunk; nothing while it is not (the missing worker is NACKed). A quorum's result
        goes to a worker it did not count as well (the worker asks for it so when its
        values do not fit the chunk's exponents)."""
        self.result_requests += 1
        if (job.lifted[cell] and job.seen[cell] & bit
                and job.epoch[cell] == get16(pkt + OFF_EPOCH)
                and job.call[cell] == get16(pkt + OFF_CALL)
                and job.offset[cell] == <int32_t>get32(pkt + OFF_OFFSET)):
            self.lift_again(job, cell)  # (the parent has not answered it yet)
        elif (job.epoch[cell] == get16(pkt + OFF_EPOCH)
                and (job.seen[cell] & bit or job.need[cell])
                and job.count[cell] == 0 and job.result_len[cell]
                and job.call[cell] == get16(pkt + OFF_CALL)
                and job.offset[cell] == <int32_t>get32(pkt + OFF_OFFSET)):
            self.retransmits_answered += 1
            self.send(job.result + cell * job.width, job.result_len[cell],
                      &job.addr[worker])
        elif (job.epoch[cell] == get16(pkt + OFF_EPOCH) and job.seen[cell] & bit
                and job.count[cell] != 0 and job.call[cell] == get16(pkt + OFF_CALL)
                and job.offset[cell] == <int32_t>get32(pkt + OFF_OFFSET)
                and not job.managed and self.features & CAP_NACKS):
            # Its packet is here and the cell waits for a peer's: say so (held), so that
            # the worker's silence bound waits on for a late peer (answer_again).
            self.held_replies += 1
            self.nack(job, pkt, worker, 0, 0)

    cdef void check_sequence(self, Job *job, const uint8_t *pkt, int worker,
                             uint16_t epoch) noexcept nogil:
        """A worker numbers its new packets (seq, mod 256) and a link keeps their order:
        numbers a new packet skips were lost on the way. Tell the worker at once (one
        NACK: the first missing number and how many), so that it resends those packets
        without waiting for its timeout, and the workers whose packets came resend
        nothing (docs/protocol-recovery.md, Loss). For new packets only (a retransmission repeats
        an old number)."""
        cdef int seq = pkt[OFF_SEQ]
        cdef int gap = (seq - job.next_seq[worker]) & 255
        if gap >= 256 - MAX_GAP:
            return  # late (reordered on the way): the expectation stands
        if 0 < gap <= MAX_GAP:
            self.nack(job, pkt, worker, job.next_seq[worker], gap)
        # (more missing than MAX_GAP: lost track, no NACK; go on from here)
        job.next_seq[worker] = <uint8_t>(seq + 1)

    cdef bint is_stale(self, Job *job, const uint8_t *pkt, int worker, uint32_t slot,
                       int ver, int flags, uint16_t epoch) noexcept nogil:
        """Whether a retransmission is of the worker's packet of an earlier use of the
        slot, held up on the way and arriving after the worker moved on. It would find
        its bit cleared in the cell it names (cleared when the worker used the slot's
        other version) and open a chunk no other worker completes, or, with the same
        offset, add old values to a later call's sum (found by bench/soak.py). Per slot
        and worker the switch keeps the (version, seq) of the latest two packets: a
        retransmission is stale if it has the latest's version but not its number, or
        the other version and the number of the one before. (Equality, not order: seq
        wraps at 256, and a slot may wait for hundreds of the worker's packets.)"""
        cdef Py_ssize_t s
        cdef uint32_t *uses
        cdef uint32_t mine = 0x200 | ver << 8 | pkt[OFF_SEQ], latest, before
        if job.seq_epoch[worker] != epoch:  # the worker's first packet of this run
            job.seq_epoch[worker] = epoch
            job.next_seq[worker] = <uint8_t>pkt[OFF_SEQ]
            for s in range(job.slots):
                job.last_seq[s * MAX_WORKERS + worker] = 0
        uses = &job.last_seq[slot * MAX_WORKERS + worker]
        latest, before = uses[0] & 0xffff, uses[0] >> 16
        if flags & FLAG_RETRANSMIT and latest:
            if (latest & 0x100) == (mine & 0x100):
                if latest != mine:
                    return True
            elif before == mine:
                return True
        if not flags & FLAG_RETRANSMIT:
            self.check_sequence(job, pkt, worker, epoch)
        if latest != mine:
            uses[0] = latest << 16 | mine
        return False

    cdef void nack(self, Job *job, const uint8_t *pkt, int worker, int first,
                   int count) noexcept nogil:
        """Send the worker a NACK for its packets numbered first .. first + count - 1."""
        if not self.features & CAP_NACKS:
            return
        cdef int at = job.nack_at[worker]
        job.nack_at[worker] = (at + 1) % NACK_BUFFERS
        cdef uint8_t *nack = job.nack + (worker * NACK_BUFFERS + at) * HEADER
        memset(nack, 0, HEADER)
        memcpy(nack, pkt, OFF_JOB + 4)  # version, flags, job, worker
        nack[OFF_FLAGS] = FLAG_NACK
        nack[OFF_SEQ] = <uint8_t>first
        put16(nack + OFF_COUNT, <uint16_t>count)
        put16(nack + OFF_EPOCH, get16(pkt + OFF_EPOCH))
        self.nacks += count > 0
        self.send(nack, HEADER, &job.addr[worker])

    cdef void opening(self, Job *job, const uint8_t *pkt, Py_ssize_t length, int worker,
                      uint64_t bit, Py_ssize_t cell, Py_ssize_t other,
                      uint16_t epoch) noexcept nogil:
        """A call's opening (FLAG_OPEN, docs/protocol.md): no values (count 0), G pairs.
        The cell keeps the first packet's identity (its offset and the pairs' exponents) and
        the max of the proposals; a packet whose identity differs marks the cell instead
        of being dropped, so that the opening completes all the same and its result
        (MISMATCH) tells every worker that the ranks called differently. Sync only: it
        completes when all n workers sent theirs."""
        cdef int blocks = get16(pkt + OFF_BLOCKS), j
        cdef int16_t *exponents = job.exponent + cell * job.pairs
        cdef int16_t *proposals = job.proposal + cell * job.pairs
        cdef const uint8_t *pairs = pkt + HEADER
        if (blocks != job.pairs or length != HEADER + PAIR * blocks
                or get16(pkt + OFF_COUNT) != 0
                or pkt[OFF_VALUE_BITS] != job.bits or pkt[OFF_BLOCK] != job.block
                or pkt[OFF_QUORUM] != 0):
            self.drops[<int>DROP_MALFORMED] += 1
            return
        job.last_seen = monotonic()
        if job.epoch[cell] != epoch:  # (as a data packet: another run's cell is idle)
            idle_cell(job, cell, epoch)
        if job.count[cell] == 0 and not (
                job.opened[cell] and job.call[cell] == get16(pkt + OFF_CALL)
                and job.offset[cell] == <int32_t>get32(pkt + OFF_OFFSET)):
            # A new use: bits a quorum's left-out worker may still have set here (see
            # handle) are not this opening's.
            job.seen[cell] = 0
        if job.seen[cell] & bit:
            self.answer_again(job, cell, worker, pkt)
            return
        if job.count[cell] == 0:
            job.opened[cell] = 1
            job.marks[cell] = 0
            job.call[cell] = get16(pkt + OFF_CALL)
            job.need[cell] = 0
            job.offset[cell] = <int32_t>get32(pkt + OFF_OFFSET)
            job.elements[cell] = 0
            job.cell_bits[cell] = job.bits
            for j in range(blocks):
                exponents[j] = <int16_t>get16(pairs + PAIR * j)
                proposals[j] = <int16_t>get16(pairs + PAIR * j + 2)
        else:
            if job.marks[cell] & MARK_PREDICTED:
                # A predicted chunk's use (docs/protocol.md, One round trip): the ranks
                # called differently; counted, so that every worker learns it.
                job.marks[cell] |= MARK_MISMATCH
                if count_in(job, cell, other, bit) >= job.n:
                    self.finish(job, cell, pkt)
                return
            if not job.opened[cell]:  # a chunk's data in this cell: not an opening's
                self.drops[<int>DROP_MISMATCH] += 1
                return
            if (job.offset[cell] != <int32_t>get32(pkt + OFF_OFFSET)
                    or job.call[cell] != get16(pkt + OFF_CALL)):
                job.opened[cell] |= 2
            for j in range(blocks):
                if <int16_t>get16(pairs + PAIR * j) != exponents[j]:
                    job.opened[cell] |= 2
            keep_max(proposals, pairs, blocks)
        if count_in(job, cell, other, bit) < job.n:
            return
        self.finish(job, cell, pkt)

    cdef void finish(self, Job *job, Py_ssize_t cell, const uint8_t *pkt) noexcept nogil:
        """A cell whose count reached its need: its result, from the cell's state, to
        every worker. An opening's: its identity and max proposals (RESULT | OPEN, and
        MISMATCH if marked). A chunk's: the sum and the exponents, with a predicted use's
        marks as flags (a marked one's values are no sum). ``pkt``: the packet that
        completed it (its header is the result's, the cell's fields put in)."""
        cdef uint8_t *result
        cdef uint8_t *acc = job.acc + cell * job.k * (job.bits // 8)
        cdef int blocks, vb, flags, marks = job.marks[cell]
        if job.opened[cell] & 1:
            result = self.result_header(job, cell, pkt, job.pairs,
                                        FLAG_RESULT | FLAG_OPEN
                                        | (FLAG_MISMATCH if job.opened[cell] & 2 else 0))
            put32(result + OFF_OFFSET, <uint32_t>job.offset[cell])
            put16(result + OFF_CALL, job.call[cell])
            put16(result + OFF_COUNT, 0)
            put16(result + OFF_BLOCKS, <uint16_t>job.pairs)
            result[OFF_VALUE_BITS] = job.bits
            self.openings += 1
            self.give(job, cell, HEADER + PAIR * job.pairs)
            return
        blocks = (job.elements[cell] + job.block - 1) // job.block
        vb = job.cell_bits[cell] // 8
        flags = FLAG_RESULT
        if marks & MARK_PREDICTED:
            flags |= FLAG_PREDICTED
        if marks & MARK_MISMATCH:  # (a predicted packet may have met an ordinary use)
            flags |= FLAG_MISMATCH
        elif marks & MARK_OVERFLOW:
            flags |= FLAG_OVERFLOW
        result = self.result_header(job, cell, pkt, blocks, flags)
        put32(result + OFF_OFFSET, <uint32_t>job.offset[cell])
        put16(result + OFF_CALL, job.call[cell])
        put16(result + OFF_COUNT, <uint16_t>job.elements[cell])
        put16(result + OFF_BLOCKS, <uint16_t>blocks)
        result[OFF_VALUE_BITS] = job.cell_bits[cell]
        result[OFF_QUORUM] = job.need[cell]
        if vb == 4:
            ina_store_be32(<uint32_t *>(result + HEADER + PAIR * blocks),
                           <const uint32_t *>acc, job.elements[cell])
        else:
            ina_store_be16(<uint16_t *>(result + HEADER + PAIR * blocks),
                           <const uint16_t *>acc, job.elements[cell])
        self.results += 1
        job.results += 1
        self.give(job, cell, HEADER + PAIR * blocks + vb * job.elements[cell])

    cdef uint8_t *result_header(self, Job *job, Py_ssize_t cell, const uint8_t *pkt,
                                int blocks, int flags) noexcept nogil:
        """A cell just completed: its result's header (the last packet's, stamped as the
        switch's answer) and pairs, in the cell's result buffer; returns the buffer."""
        cdef uint8_t *result = job.result + cell * job.width
        cdef int16_t *exponents = job.exponent + cell * job.pairs
        cdef int16_t *proposals = job.proposal + cell * job.pairs
        cdef int j
        job.count[cell] = 0
        job.counted[cell] = job.seen[cell]
        memcpy(result, pkt, HEADER)
        result[OFF_FLAGS] = flags
        put16(result + OFF_WORKER, 0xffff)
        result[OFF_MODE_QUORUM] = <uint8_t>job.mode_quorum
        put32(result + OFF_MODE_GENERATION, job.mode_generation)
        put64(result + OFF_CONTRIBUTORS, job.seen[cell])
        for j in range(blocks):
            put16(result + HEADER + PAIR * j, <uint16_t>exponents[j])
            put16(result + HEADER + PAIR * j + 2, <uint16_t>proposals[j])
        return result

    cdef void give(self, Job *job, Py_ssize_t cell, Py_ssize_t length) noexcept nogil:
        """A completed cell's result (in its buffer): to the workers, or, at a tree's
        leaf, up to the parent as this leaf's contribution (``lift``)."""
        if job.up:
            self.lift(job, cell, length)
        else:
            self.multicast(job, cell, length)

    cdef void lift(self, Job *job, Py_ssize_t cell, Py_ssize_t length) noexcept nogil:
        """The cell's sum (its result buffer) sent up as a data packet of worker up_worker:
        the chunk's header, exponents and max proposals, the values summed here. An
        opening goes up as an opening; one whose identities differed here goes with an
        offset no other leaf sends, so that the parent marks it too. The cell stays busy
        (its count kept) until the parent's result comes down (``descend``)."""
        cdef uint8_t *buf = job.result + cell * job.width
        cdef bint opening = buf[OFF_FLAGS] & FLAG_OPEN
        buf[OFF_FLAGS] = FLAG_OPEN if opening else 0
        put16(buf + OFF_WORKER, job.up_worker)
        put64(buf + OFF_CONTRIBUTORS, 0)
        buf[OFF_MODE_QUORUM] = 0
        put32(buf + OFF_MODE_GENERATION, 0)
        if opening and job.opened[cell] & 2:
            put32(buf + OFF_OFFSET,
                  <uint32_t>job.offset[cell] ^ (0x80000000u | (job.up_worker + 1u)))
        buf[OFF_SEQ] = job.up_seq
        job.up_cell[job.up_seq] = <int32_t>cell
        job.up_seq += 1
        job.count[cell] = job.n
        job.result_len[cell] = 0
        job.lifted[cell] = 1
        job.up_len[cell] = <int32_t>length
        self.sent_up += 1
        self.send(buf, length, &job.parent)

    cdef void lift_again(self, Job *job, Py_ssize_t cell) noexcept nogil:
        """A worker asked for a cell that waits for the parent's result (or the parent
        NACKed it): the partial sum again, marked as a retransmission; the parent answers
        it from its state, or holds it. (The outbox is sent first: it may hold this
        buffer's first send, which must leave unmarked.)"""
        cdef uint8_t *buf = job.result + cell * job.width
        if not buf[OFF_FLAGS] & FLAG_RETRANSMIT:
            self.flush_outbox()
            buf[OFF_FLAGS] |= FLAG_RETRANSMIT
        self.resent_up += 1
        self.send(buf, job.up_len[cell], &job.parent)

    cdef void descend(self, Job *job, uint8_t *pkt, Py_ssize_t length) noexcept nogil:
        """A packet from a tree leaf's parent: the result of a cell sent up (kept as the
        cell's result and multicast to the workers), or a NACK (the packets it names sent
        up again). A held answer (the parent waits for another leaf) is not passed on:
        that leaf may be dead, which no rank's failure would tell the workers, so their
        silence bound must end the call (docs/trees.md)."""
        cdef int flags = pkt[OFF_FLAGS], i
        cdef Py_ssize_t cell, c
        cdef uint32_t slot
        cdef uint8_t *result
        if flags & FLAG_NACK and length == HEADER:
            self.parent_held += get16(pkt + OFF_COUNT) == 0
            self.parent_nacks += get16(pkt + OFF_COUNT) != 0
            for i in range(get16(pkt + OFF_COUNT)):
                c = job.up_cell[(pkt[OFF_SEQ] + i) & 255]
                if c >= 0 and job.lifted[c]:
                    self.lift_again(job, c)
            return
        slot = get32(pkt + OFF_SLOT)
        if (not flags & FLAG_RESULT or length < HEADER or length > job.width
                or slot >= <uint32_t>job.slots or pkt[OFF_SLOT_VERSION] > 1):
            self.drops[<int>DROP_MALFORMED] += 1
            return
        cell = pkt[OFF_SLOT_VERSION] * job.slots + slot
        # (A marked opening's result may name another leaf's call: the ranks called
        # differently, which every rank must learn.)
        if (not job.lifted[cell] or job.epoch[cell] != get16(pkt + OFF_EPOCH)
                or (flags & FLAG_OPEN != 0) != (job.opened[cell] & 1 != 0)
                or (job.call[cell] != get16(pkt + OFF_CALL)
                    and not (flags & FLAG_OPEN and flags & FLAG_MISMATCH))
                or (not flags & FLAG_OPEN
                    and job.offset[cell] != <int32_t>get32(pkt + OFF_OFFSET))):
            self.stale_down += 1  # (a copy of one that came, or of an earlier use)
            return
        result = job.result + cell * job.width
        self.flush_outbox()  # (a resend of the partial sum may still point at it)
        memcpy(result, pkt, length)
        put16(result + OFF_JOB, get16(pkt + OFF_JOB))
        # The mode this leaf's job is in (its workers adopt it), not the parent's.
        result[OFF_MODE_QUORUM] = <uint8_t>job.mode_quorum
        put32(result + OFF_MODE_GENERATION, job.mode_generation)
        if job.opened[cell] & 2:
            result[OFF_FLAGS] |= FLAG_MISMATCH
        # Counted: every worker of the tree (a sync use: the parent's bits are leaves,
        # this cell's are this leaf's workers; none named means all, AVERAGE's n).
        put64(result + OFF_CONTRIBUTORS, 0)
        job.count[cell] = 0
        job.counted[cell] = job.seen[cell]
        job.lifted[cell] = 0
        self.came_down += 1
        self.multicast(job, cell, length)

    cdef void multicast(self, Job *job, Py_ssize_t cell, Py_ssize_t length) noexcept nogil:
        """Send a cell's result (``length`` bytes, kept for resends) to every worker: the
        replicas a controller installed (multicast group + rewrites), or the joined ones."""
        cdef uint8_t *result = job.result + cell * job.width
        cdef int w
        job.result_len[cell] = <int32_t>length
        if job.managed:
            for w in range(job.nreplicas):
                self.send(result, length, &job.replica[w])
        else:
            for w in range(job.n):
                self.send(result, length, &job.addr[w])

    cdef void answer_again(self, Job *job, Py_ssize_t cell, int worker,
                           const uint8_t *pkt) noexcept nogil:
        """A worker counted in the cell sent again: the stored result if the cell is done
        (its result was lost), else a duplicate while the cell waits for the others; the
        worker is then told that its packet is held (a NACK naming no packet: a peer is
        late, not the switch gone; its silence bound waits on: docs/protocol-recovery.md, Loss)."""
        if job.count[cell] == 0 and job.result_len[cell]:
            self.retransmits_answered += 1
            self.send(job.result + cell * job.width, job.result_len[cell], &job.addr[worker])
        elif job.lifted[cell]:
            self.lift_again(job, cell)
        else:
            self.drops[<int>DROP_DUPLICATE] += 1
            if not job.managed and self.features & CAP_NACKS:
                self.held_replies += 1
                self.nack(job, pkt, worker, 0, 0)

    cdef void handle(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        """The aggregation rule (docs/protocol.md) for one packet as the switch sees it."""
        if length < HEADER:
            self.drops[<int>DROP_MALFORMED] += 1
            return
        cdef int flags = pkt[OFF_FLAGS]
        if pkt[OFF_VERSION] != VERSION and not flags & FLAG_CONTROL:
            # (a control packet of another version goes to Python, which refuses a join
            # naming both versions; the version and flags bytes are where they always were)
            self.drops[<int>DROP_MALFORMED] += 1
            return
        if flags & FLAG_CONTROL:
            # For Python (server.py), which counts each by what became of it. More than
            # MAX_CONTROL in one run() (only with injected duplication or delay: run()
            # returns after the batch that brought one) are lost, and counted here.
            if self.nctrl < MAX_CONTROL:
                memcpy(self.ctrl + self.nctrl * self.bufsize, pkt, length)
                self.ctrl_len[self.nctrl] = length
                self.ctrl_addr[self.nctrl] = src[0]
                self.nctrl += 1
            else:
                self.control_overflow += 1
            return
        if flags & FLAG_RESULT and not self.leaves:
            self.drops[<int>DROP_RESULT_FROM_WORKER] += 1
            return
        cdef Job *job = find_job(self.jobs, get16(pkt + OFF_JOB))
        if job == NULL:
            self.drops[<int>DROP_UNKNOWN_JOB] += 1
            return
        if (job.up and src.sin_addr.s_addr == job.parent.sin_addr.s_addr
                and src.sin_port == job.parent.sin_port):
            self.descend(job, pkt, length)
            return
        if flags & FLAG_RESULT:
            self.drops[<int>DROP_RESULT_FROM_WORKER] += 1
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
        cdef uint16_t epoch = get16(pkt + OFF_EPOCH)
        if self.is_stale(job, pkt, worker, slot, ver, flags, epoch):
            self.drops[<int>DROP_STALE] += 1
            return
        if ((flags & FLAG_OPEN and not self.features & CAP_OPEN)
                or (flags & FLAG_PREDICTED and not self.features & CAP_PREDICT)
                or (pkt[OFF_QUORUM] and not self.features & CAP_QUORUM)
                or (elements == 0 and length == HEADER and flags & FLAG_RETRANSMIT
                    and not self.features & CAP_NACKS)):
            self.drops[<int>DROP_MALFORMED] += 1  # (a feature this build leaves out)
            return
        if elements == 0 and length == HEADER and flags & FLAG_RETRANSMIT:
            self.answer_request(job, pkt, worker, bit, ver * job.slots + slot)
            return
        if flags & FLAG_OPEN:
            self.opening(job, pkt, length, worker, bit, ver * job.slots + slot,
                         (1 - ver) * job.slots + slot, epoch)
            return
        cdef int blocks = get16(pkt + OFF_BLOCKS)
        cdef int bits = pkt[OFF_VALUE_BITS]
        cdef int vb = bits // 8
        cdef int quorum = pkt[OFF_QUORUM]
        cdef uint16_t call = get16(pkt + OFF_CALL)
        cdef bint predicted = flags & FLAG_PREDICTED
        # The job's width, or 16 in a job of 32 (a call asking for 16-bit values: its
        # packets are smaller; the cell remembers which width it sums).
        if (elements < 1 or elements > job.k
                or not (bits == job.bits or (bits == 16 and job.bits == 32
                                             and self.features & CAP_NARROW))
                or pkt[OFF_BLOCK] != job.block
                or blocks != (elements + job.block - 1) // job.block
                or length != HEADER + PAIR * blocks + vb * elements or quorum > job.n
                or (predicted and quorum)):
            self.drops[<int>DROP_MALFORMED] += 1
            return
        job.last_seen = monotonic()
        cdef Py_ssize_t cell = ver * job.slots + slot
        cdef Py_ssize_t other = (1 - ver) * job.slots + slot
        cdef Py_ssize_t width = job.width
        cdef int32_t offset = <int32_t>get32(pkt + OFF_OFFSET)
        cdef const uint8_t *pairs = pkt + HEADER
        cdef const uint8_t *values = pairs + PAIR * blocks
        cdef int16_t *exponents = job.exponent + cell * job.pairs
        cdef int16_t *proposals = job.proposal + cell * job.pairs
        cdef uint8_t *acc = job.acc + cell * job.k * (job.bits // 8)
        cdef int j, behind
        cdef bint older, marked
        cdef int16_t exponent
        if job.epoch[cell] != epoch:
            # Last used by another run of the job (its ranks started their slots at version
            # 0 again): that state is not this run's, the cell is idle.
            idle_cell(job, cell, epoch)
        elif job.count[cell] or job.result_len[cell]:
            behind = <int16_t>(job.call[cell] - call)
            # (An opening's offset is the call's identity, not a chunk's: only an earlier
            # call is older than an opened cell. An opening used as a gate alone carries
            # the next switch call's number without taking it: that call meets it.)
            older = 0 < behind < 256 or (behind == 0 and offset < job.offset[cell]
                                         and not job.opened[cell] & 1)
            if older and (quorum or job.need[cell]):
                # A quorum lets the others run ahead of a late worker: its packet may be
                # of a chunk its cell has finished and moved past (an earlier call, or an
                # earlier offset of this one). Its result went out; nothing to add it to.
                self.drops[<int>DROP_LATE] += 1
                return
            if older:
                # In sync no worker needs a chunk its cell has moved past (a worker uses
                # the cell again only after every worker had the result of the slot's
                # other cell, sent after this one's reached them all): a delayed copy, a
                # first send or a resend alike. Opening the cell with it would stall its
                # next use, or add old values to a sum. (The P4 program's rule too.)
                self.drops[<int>DROP_STALE] += 1
                return
            if (not older and job.count[cell] == 0
                    and (behind != 0 or offset != job.offset[cell])):
                # A new use of a finished cell. A worker a quorum left out may still have
                # its bit set from an earlier use, here or in the slot's other cell (its
                # late packet cleared nothing): not this chunk's. (In sync every bit is
                # clear by now.)
                job.seen[cell] = 0
        if (predicted and job.count[cell] == 0 and job.marks[cell] & MARK_OVERFLOW
                and not job.seen[cell] & bit and job.call[cell] == call
                and job.offset[cell] == offset):
            # A predicted chunk that overflowed: the worker has moved on to its second try
            # (the slot's other cell), and this is a late copy of its first.
            self.drops[<int>DROP_STALE] += 1
            return
        if job.seen[cell] & bit:  # done, and this worker missed the result; or waiting
            self.answer_again(job, cell, worker, pkt)
            return
        if (job.count[cell] == 0 and job.result_len[cell] and job.need[cell]
                and job.call[cell] == call and job.offset[cell] == offset):
            # A quorum finished this chunk without this worker: nothing is added. The
            # result went to it in the multicast; a retransmission says it never came,
            # and gets it again. (Answering first copies too doubled a late worker's
            # downlink bytes and overflowed shaped links: docs/quorum.md.)
            if flags & FLAG_RETRANSMIT:
                self.late_answered += 1
                self.send(job.result + cell * width, job.result_len[cell],
                          &job.addr[worker])
            else:
                self.drops[<int>DROP_LATE] += 1
            return
        if job.count[cell] == 0:
            job.opened[cell] = 0
            job.marks[cell] = MARK_PREDICTED if predicted else 0
            job.ident[cell] = get64(pkt + OFF_CONTRIBUTORS) if predicted else 0
            job.call[cell] = call
            job.need[cell] = quorum
            job.offset[cell] = offset
            job.elements[cell] = elements
            job.cell_bits[cell] = bits
            for j in range(blocks):
                exponents[j] = <int16_t>get16(pairs + PAIR * j)
                proposals[j] = <int16_t>get16(pairs + PAIR * j + 2)
            if vb == 4:
                ina_load_be32(<uint32_t *>acc, <const uint32_t *>values, elements)
            else:
                ina_load_be16(<uint16_t *>acc, <const uint16_t *>values, elements)
        elif predicted or job.marks[cell] & MARK_PREDICTED:
            # A predicted chunk's use, or a predicted packet meeting another kind of use
            # (docs/protocol.md, One round trip): a packet that differs marks the cell
            # and is counted, adding nothing, so that the result tells every worker.
            if (not predicted or not job.marks[cell] & MARK_PREDICTED
                    or offset != job.offset[cell] or elements != job.elements[cell]
                    or bits != job.cell_bits[cell] or call != job.call[cell]
                    or get64(pkt + OFF_CONTRIBUTORS) != job.ident[cell]):
                if job.opened[cell] & 1:
                    job.opened[cell] |= 2
                else:
                    job.marks[cell] |= MARK_MISMATCH
            else:
                marked = False
                for j in range(blocks):
                    exponent = <int16_t>get16(pairs + PAIR * j)
                    if exponent != exponents[j]:
                        marked = True
                        if exponent > exponents[j]:
                            exponents[j] = exponent
                if marked:
                    job.marks[cell] |= MARK_OVERFLOW
                elif not job.marks[cell] & (MARK_MISMATCH | MARK_OVERFLOW):
                    if vb == 4:
                        ina_accumulate_be32(<uint32_t *>acc, <const uint32_t *>values, elements)
                    else:
                        ina_accumulate_be16(<uint16_t *>acc, <const uint16_t *>values,
                                            elements)
                keep_max(proposals, pairs, blocks)
        else:
            if (offset != job.offset[cell] or elements != job.elements[cell]
                    or bits != job.cell_bits[cell] or call != job.call[cell]
                    or quorum != job.need[cell] or job.opened[cell]):
                self.drops[<int>DROP_MISMATCH] += 1
                return
            for j in range(blocks):  # another chunk's scaling: nothing is added
                if <int16_t>get16(pairs + PAIR * j) != exponents[j]:
                    self.drops[<int>DROP_MISMATCH] += 1
                    return
            if vb == 4:
                ina_accumulate_be32(<uint32_t *>acc, <const uint32_t *>values, elements)
            else:
                ina_accumulate_be16(<uint16_t *>acc, <const uint16_t *>values, elements)
            keep_max(proposals, pairs, blocks)
        if count_in(job, cell, other, bit) < (job.need[cell] if job.need[cell] else job.n):
            return
        self.finish(job, cell, pkt)
