# Fault injection of the software switch, apart from its aggregation rule (included by
# switch_loop.pyx). FaultInjection sits between the socket and the rule: packets as
# received ("in") pass through receive() on their way to handle(), and packets as sent
# ("out") through send() on their way to emit(); each direction can drop, duplicate,
# reorder (hold one packet back until the next) and delay them; and one worker's data
# packets can be held back on the way in (a straggler: straggler_worker, its id in every
# job, straggler_delay_ms), as a slow link to that worker would; and every data packet
# can be served at a bounded rate (service_pps: a slow target, such as BMv2's few
# thousand packets a second, queued in order and dropped when DELAY_CAPACITY wait).
# Aggregator subclasses it and provides handle (the rule), emit and flush_outbox (the
# batched sender).

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
    HELD_BYTES = 65536                  # the largest datagram a held packet can be


cdef bint queue_push(DelayQueue *q, const uint8_t *pkt, Py_ssize_t length,
                     const sockaddr_in *addr, double due) noexcept nogil:
    cdef int i
    if q.items == NULL:
        q.items = <Held *>calloc(DELAY_CAPACITY, sizeof(Held))
        if q.items == NULL:
            return False
        for i in range(DELAY_CAPACITY):
            q.items[i].data = <uint8_t *>calloc(1, HELD_BYTES)
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


cdef Held *queue_pop_due(DelayQueue *q, double now) noexcept nogil:
    """The oldest held packet if it is due (removed from the queue), else NULL."""
    if q.size == 0 or q.items[q.head].due > now:
        return NULL
    cdef Held *h = &q.items[q.head]
    q.head = (q.head + 1) % DELAY_CAPACITY
    q.size -= 1
    return h


cdef void queue_free(DelayQueue *q) noexcept nogil:
    cdef int i
    if q.items != NULL:
        for i in range(DELAY_CAPACITY):
            free(q.items[i].data)
        free(q.items)
        q.items = NULL


cdef Faults faults_from(dict chosen):
    cdef Faults f
    f.drop = <uint32_t>(chosen.get("drop", 0) * 1e6 + 0.5)
    f.duplicate = <uint32_t>(chosen.get("duplicate", 0) * 1e6 + 0.5)
    f.reorder = <uint32_t>(chosen.get("reorder", 0) * 1e6 + 0.5)
    f.delay = chosen.get("delay_ms", 0) / 1e3
    return f


cdef class FaultInjection:
    """Drop, duplicate, reorder and delay packets in either direction, changeable while
    running; the base of Aggregator (handle, emit and flush_outbox are its)."""

    cdef Faults faults_in, faults_out
    cdef uint64_t rng
    cdef Held held_in, held_out     # a packet held back to reorder it after the next one
    cdef DelayQueue delayed_in, delayed_out
    cdef DelayQueue delayed_straggler   # the straggler's packets: one delay, in order
    cdef int straggler                  # its worker id
    cdef double straggler_delay         # seconds; 0: none
    cdef double service_gap             # seconds between inbound packets served; 0: none
    cdef double service_next            # when the next inbound packet can be served

    STRAGGLER = ("straggler_worker", "straggler_delay_ms")

    FAULTS = ("drop", "duplicate", "reorder", "delay_ms")

    def __cinit__(self, *args, **kwargs):
        self.rng = 0x9E3779B97F4A7C15
        self.held_in.data = <uint8_t *>calloc(1, HELD_BYTES)
        self.held_out.data = <uint8_t *>calloc(1, HELD_BYTES)
        if self.held_in.data == NULL or self.held_out.data == NULL:
            raise MemoryError("no memory for the fault injection's held packets")

    def __dealloc__(self):
        free(self.held_in.data)
        free(self.held_out.data)
        queue_free(&self.delayed_in)
        queue_free(&self.delayed_out)
        queue_free(&self.delayed_straggler)

    def set_faults(self, **faults):
        """``<fault>_<in|out>`` for fault in drop, duplicate, reorder (probabilities) and
        delay_ms (milliseconds); straggler_worker and straggler_delay_ms (0..10000) hold
        that worker's data packets back on the way in; service_pps (0..10^7) serves the
        data packets received at most that many a second. Faults not named are
        cleared."""
        chosen = {"in": {}, "out": {}}
        straggler = faults.pop("straggler_worker", 0)
        delay = faults.pop("straggler_delay_ms", 0)
        pps = faults.pop("service_pps", 0)
        if not 0 <= pps <= 10_000_000:
            raise ValueError(f"service_pps must be 0..10000000 packets a second, got {pps}")
        if not 0 <= straggler < 65536 or straggler != int(straggler):
            raise ValueError(f"straggler_worker must be a worker id, got {straggler}")
        if not 0 <= delay <= 10000:
            raise ValueError(f"straggler_delay_ms must be 0..10000 ms, got {delay}")
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
        self.faults_in = faults_from(chosen["in"])
        self.faults_out = faults_from(chosen["out"])
        self.straggler, self.straggler_delay = <int>straggler, delay / 1e3
        self.service_gap = 1.0 / pps if pps else 0.0

    def faults(self):
        """The faults in force, as set_faults takes them (zero ones left out)."""
        out = {}
        cdef Faults f
        for direction in ("in", "out"):
            f = self.faults_in if direction == "in" else self.faults_out
            for name, value in (("drop", f.drop / 1e6), ("duplicate", f.duplicate / 1e6),
                                ("reorder", f.reorder / 1e6), ("delay_ms", f.delay * 1e3)):
                if value:
                    out[f"{name}_{direction}"] = value
        if self.straggler_delay > 0:
            out["straggler_worker"] = self.straggler
            out["straggler_delay_ms"] = self.straggler_delay * 1e3
        if self.service_gap > 0:
            out["service_pps"] = round(1.0 / self.service_gap)
        return out

    # -- what the subclass provides ------------------------------------------------------

    cdef void handle(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        pass

    cdef void emit(self, const uint8_t *pkt, Py_ssize_t length,
                   const sockaddr_in *to) noexcept nogil:
        pass

    cdef void flush_outbox(self) noexcept nogil:
        pass

    cdef void injected_drop(self, bint inbound) noexcept nogil:
        pass

    # -- the two directions ----------------------------------------------------------

    cdef inline bint chance(self, uint32_t ppm) noexcept nogil:
        if ppm == 0:
            return False
        self.rng ^= self.rng << 13
        self.rng ^= self.rng >> 7
        self.rng ^= self.rng << 17
        return (self.rng % 1000000) < ppm

    cdef int next_due_ms(self, int limit) noexcept nogil:
        """Milliseconds until the next delayed packet is due (at most limit)."""
        cdef double due = 1e300, now = monotonic()
        if self.delayed_in.size:
            due = self.delayed_in.items[self.delayed_in.head].due
        if self.delayed_out.size:
            due = min(due, self.delayed_out.items[self.delayed_out.head].due)
        if self.delayed_straggler.size:
            due = min(due, self.delayed_straggler.items[self.delayed_straggler.head].due)
        if due == 1e300:
            return limit
        return <int>min(<double>limit, max(0.0, (due - now) * 1e3) + 1)

    cdef bint holding_delayed(self) noexcept nogil:
        return (self.delayed_in.size != 0 or self.delayed_out.size != 0
                or self.delayed_straggler.size != 0)

    cdef void release_due(self, double now) noexcept nogil:
        cdef Held *h = queue_pop_due(&self.delayed_straggler, now)
        while h != NULL:
            self.receive_now(h.data, h.length, &h.addr)
            h = queue_pop_due(&self.delayed_straggler, now)
        h = queue_pop_due(&self.delayed_in, now)
        while h != NULL:
            self.deliver(h.data, h.length, &h.addr)
            h = queue_pop_due(&self.delayed_in, now)
        # What those packets completed leaves now, not with the next packet received (up
        # to the loop's idle timeout later: 100 ms a round trip, found by the straggler).
        self.flush_outbox()
        h = queue_pop_due(&self.delayed_out, now)
        while h != NULL:
            self.transmit(h.data, h.length, &h.addr)
            self.flush_outbox()  # before the queue can reuse h.data
            h = queue_pop_due(&self.delayed_out, now)

    cdef void receive(self, uint8_t *pkt, Py_ssize_t length, sockaddr_in *src) noexcept nogil:
        """A packet as received: on to handle(), unless a fault says otherwise."""
        if (self.straggler_delay > 0 and length >= HEADER
                and not pkt[OFF_FLAGS] & FLAG_CONTROL
                and get16(pkt + OFF_WORKER) == self.straggler
                and queue_push(&self.delayed_straggler, pkt, length, src,
                               monotonic() + self.straggler_delay)):
            return
        self.receive_now(pkt, length, src)

    cdef void receive_now(self, uint8_t *pkt, Py_ssize_t length,
                          sockaddr_in *src) noexcept nogil:
        cdef double due
        if self.chance(self.faults_in.drop):
            self.injected_drop(True)
            return
        if self.service_gap > 0 and length >= HEADER and not pkt[OFF_FLAGS] & FLAG_CONTROL:
            # A slow target: served in order, one every service_gap; a full queue drops.
            due = max(monotonic() + self.faults_in.delay, self.service_next)
            if not queue_push(&self.delayed_in, pkt, length, src, due):
                self.injected_drop(True)
                return
            self.service_next = due + self.service_gap
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
        """A packet to send: on to emit(), unless a fault says otherwise."""
        if self.chance(self.faults_out.drop):
            self.injected_drop(False)
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
