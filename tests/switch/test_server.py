"""Fuzzing the software switch (issue 19, item 4): random, truncated and mutated packets,
header fields at their edges, wrong versions, lengths, jobs, slots and workers, control
requests of every op, from sources that are not the workers' (the fuzzer's own sockets
on 127.0.0.1, 127.0.0.2 and 127.1.2.3), while two jobs run allreduces through the same
switch: the switch keeps serving, both jobs' results stay exact and come from the switch,
and the switch's counters account for every packet sent, by category.

The switch runs in this process (``SoftwareSwitch.serve`` in a thread: the same class
``ina-switch`` runs), so that the test reads its counters while it serves. Each packet's
expected fate comes from ``expected_fate``, the rules of docs/protocol.md written out
again for a sender that is never a registered worker.

The ranks of the two jobs run ``fuzz_job``, this module's rank function
(tests/integration/mpirun.py imports it by its name in each rank).
"""
from __future__ import annotations

import collections
import random
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.switch import parse_status
from ina_collectives.switch.server import CONTROL_OUTCOMES, CONTROL_VALUES, SoftwareSwitch
from tests.integration import mpirun

FUZZ_PACKETS = 100_000
BATCH = 250  # packets sent before waiting for the switch's counters to account for them
DATA_DROPS = ("malformed", "result from a worker", "unknown job", "unknown worker")
CATEGORIES = DATA_DROPS + CONTROL_OUTCOMES + ("control overflow",)
SOURCES = ("127.0.0.1", "127.0.0.2", "127.1.2.3")  # the fuzzer's sockets, none a worker's


# -- the switch, in this process ---------------------------------------------------------

@contextmanager
def switch_thread(**options: Any) -> Iterator[SoftwareSwitch]:
    """A SoftwareSwitch on a free loopback port, serving in a thread; on leaving, it must
    still be serving (nothing a packet did ended it), and it is stopped."""
    sw = SoftwareSwitch("127.0.0.1", 0, **options)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            sw.serve()
        except BaseException as exc:  # the test fails with it below
            failure.append(exc)

    thread = threading.Thread(target=serve, name="switch", daemon=True)
    thread.start()
    sw.thread, sw.failure = thread, failure  # type: ignore[attr-defined]
    try:
        yield sw
        assert thread.is_alive() and not failure, f"the switch stopped: {failure}"
    finally:
        sw.stop()
        thread.join(5)


def counters(sw: SoftwareSwitch) -> collections.Counter:
    """The switch's counters of every fate a packet of the fuzzer can have."""
    drops = sw.aggregator.drop_counts()
    out = collections.Counter({name: drops.get(name, 0) for name in P.DROP_REASONS})
    out.update({name: sw.control_counts[name] for name in CONTROL_OUTCOMES})
    out["control overflow"] = sw.aggregator.control_overflow
    return out


def kernel_drops(port: int) -> int:
    """Datagrams the kernel dropped at the UDP socket bound to 127.0.0.1:port (a full
    receive buffer): /proc/net/udp's last column."""
    local = f"0100007F:{port:04X}"
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local:
            return int(fields[-1])
    raise LookupError(f"no UDP socket at 127.0.0.1:{port}")


# -- what becomes of a packet from a stranger ----------------------------------------------

def _fault_values_valid(values: list[int]) -> bool:
    for name, v in zip(P.FAULT_FIELDS, values):
        limit = 10_000_000 if name.startswith("delay") else 1_000_000  # us, ppm
        if not 0 <= v <= limit:
            return False
    return True


def expected_fate(pkt: bytes, source: str, jobs: dict[int, tuple[int, ...]],
                  pool_left: int, max_elements: int) -> str:
    """The counter a packet from ``source`` (a fuzzer's socket: never a worker's address)
    must increase, by docs/protocol.md; "join" and "fault settings!" name the packets the
    fuzzer must not send (a job created, fault injection turned on)."""
    if len(pkt) < P.HEADER_BYTES:
        return "malformed"
    head = P.unpack_header(pkt)
    if not head["flags"] & P.FLAG_CONTROL:
        if head["version"] != P.PROTOCOL_VERSION:
            return "malformed"
        if head["flags"] & P.FLAG_RESULT:
            return "result from a worker"
        return "unknown job" if head["job"] not in jobs else "unknown worker"
    if head["flags"] != P.FLAG_CONTROL:
        return "malformed control"
    size = len(pkt) - P.HEADER_BYTES
    if head["version"] != P.PROTOCOL_VERSION:  # a join or probe is refused, naming both
        whole = np.frombuffer(pkt[P.HEADER_BYTES:P.HEADER_BYTES + size // 4 * 4], ">i4")
        return ("refusals" if whole.size and whole[0] in (P.CTRL_JOIN, P.CTRL_PROBE)
                else "malformed control")
    if size % 4 or head["count"] != size // 4 or size == 0:
        return "malformed control"
    body = np.frombuffer(pkt[P.HEADER_BYTES:], ">i4").tolist()
    op, job, worker = body[0], head["job"], head["worker"]
    if CONTROL_VALUES.get(op) != len(body):
        return "malformed control"
    if op == P.CTRL_JOIN:
        n, k, s, block, bits = body[1:]
        room = P.MAX_DATAGRAM if max_elements >= P.MAX_ELEMENTS else 4 * max_elements
        if not (1 <= n <= P.MAX_WORKERS and 0 <= worker < n and 1 <= s <= 65536
                and block in P.BLOCK_SIZES and bits in P.VALUE_BITS and 1 <= k
                and k * bits // 8 <= room and P.packet_bytes(k, block, bits) <= P.MAX_DATAGRAM):
            return "refusals"
        if job not in jobs:
            return "refusals" if s > pool_left else "join"
        return "refusals"  # another shape, or the worker id is a worker's (all joined)
    if op == P.CTRL_LEAVE:
        return "foreign control" if job in jobs else "leaves"
    if op == P.CTRL_PROBE:
        return "probes"
    if op == P.CTRL_WAKE:
        return "wakes"
    if source != "127.0.0.1":  # CTRL_FAULTS
        return "foreign control"
    if job != 0 or worker != 0 or not _fault_values_valid(body[1:]):
        return "malformed control"
    return "fault settings" if not any(body[1:]) else "fault settings!"


# -- the packets ---------------------------------------------------------------------------

FIELD_MAX = {f.name: (1 << f.bits) - 1 for f in P.FIELDS}


class Fuzzer:
    """Random, mutated and truncated packets for a switch serving ``jobs``."""

    def __init__(self, seed: int, jobs: dict[int, tuple[int, ...]], pool_left: int,
                 max_elements: int):
        self.rng = random.Random(seed)  # scalar draws: far cheaper than NumPy's one by one
        self.jobs, self.pool_left, self.max_elements = jobs, pool_left, max_elements
        self.ids = sorted(jobs)

    def _pick(self, values: list[Any]) -> Any:
        return self.rng.choice(values)

    def _int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def header(self, **fields: int) -> dict[str, int]:
        job = fields.get("job", self._pick(self.ids))
        n, k, s, block, bits = self.jobs.get(job, (2, 64, 8, 32, 32))
        values = dict(version=P.PROTOCOL_VERSION,
                      flags=self._pick([0, 0, P.FLAG_RETRANSMIT]), job=job,
                      worker=self._int(0, n - 1), slot_version=self._int(0, 1),
                      seq=self._int(0, 255), slot=self._int(0, s - 1),
                      offset=k * self._int(0, 1000), count=1, blocks=1, value_bits=bits,
                      block=block, epoch=self._int(1, 65535), call=self._int(0, 65535),
                      quorum=self._pick([0, 0, self._int(1, n)]), mode_quorum=0,
                      mode_generation=0, contributors=0)
        values.update(fields)
        return values

    def pack(self, values: dict[str, int], payload: bytes = b"") -> bytes:
        return P.HEADER.pack(*(values[f.name] for f in P.FIELDS)) + payload

    def data(self) -> tuple[dict[str, int], bytes]:
        """A valid data packet of a real job (as its worker would send it)."""
        values = self.header()
        _, k, _, block, bits = self.jobs[values["job"]]
        count = k if self.rng.random() < 0.005 else self._int(1, min(k, 512))
        values["count"], values["blocks"] = count, P.sub_blocks(count, block)
        # any exponents, proposals and values
        return values, self.rng.randbytes(P.packet_bytes(count, block, bits) - P.HEADER_BYTES)

    def edges(self, name: str, values: dict[str, int]) -> list[int]:
        top = FIELD_MAX[name]
        job = values["job"]
        n, k, s, _, _ = self.jobs.get(job, (2, 64, 8, 32, 32))
        edge = {
            "version": [0, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1, 0x7F, 0x80, top],
            "flags": list(range(256)),
            "job": [0, 1, top, *self.ids, *(i + 1 for i in self.ids), *(i - 1 for i in self.ids)],
            "worker": [0, 1, n - 1, n, n + 1, 63, 64, top],
            "slot_version": [0, 1, 2, top],
            "seq": [0, 1, 127, 128, top],
            "slot": [0, s - 1, s, s + 1, 1 << 31, top],
            "offset": [0, k, (1 << 31) - 1, 1 << 31, top],
            "count": [0, 1, values["count"] - 1, values["count"] + 1, k, k + 1, top],
            "blocks": [0, 1, values["blocks"] - 1, values["blocks"] + 1, top],
            "value_bits": [0, 8, 16, 32, 64, top],
            "block": [0, 1, 16, 32, 48, 64, 128, top],
            "epoch": [0, 1, top],
            "call": [0, 1, top],
            "quorum": [0, 1, n - 1, n, n + 1, top],
            "mode_quorum": [0, 1, top],
            "mode_generation": [0, top],
            "contributors": [0, 1, top],
        }[name]
        return [v for v in edge if 0 <= v <= top]

    def mutated(self, values: dict[str, int], payload: bytes) -> bytes:
        """One field of the header set to one of its edge values."""
        name = self._pick([f.name for f in P.FIELDS])
        values = dict(values, **{name: self._pick(self.edges(name, values))})
        return self.pack(values, payload)

    def control(self, source: str) -> tuple[dict[str, int], list[int]]:
        """A control request (header fields, body) of every op, mostly ones a stranger
        must not get done, some that anyone may send."""
        real = self._pick(self.ids)
        n, k, s, block, bits = self.jobs[real]
        other = self._int(1, 65535)
        kind = self._int(0, 11)
        if kind == 0:    # join a real job as one of its workers: taken
            job, worker, body = real, self._int(0, n - 1), [P.CTRL_JOIN, n, k, s, block,
                                                            bits]
        elif kind == 1:  # join a real job with another shape
            job, worker, body = real, 0, [P.CTRL_JOIN, n + 1, k, s, block, bits]
        elif kind == 2:  # join with bad parameters
            job, worker = self._pick([0, real, other]), self._pick([0, 1, 64, 65535])
            body = [P.CTRL_JOIN, *self._pick([(0, 64, 8, 32, 32), (65, 64, 8, 32, 32),
                                              (-1, 64, 8, 32, 32), (2, 0, 8, 32, 32),
                                              (2, 2 * P.MAX_ANY_ELEMENTS, 8, 32, 16),
                                              (2, 64, 0, 32, 32), (2, 64, 65537, 32, 32),
                                              (2, 64, -5, 32, 32), (2, 64, 8, 48, 32),
                                              (2, 64, 8, 32, 24), (2, 64, 8, 0, 32),
                                              (2**31 - 1,) * 5])]
        elif kind == 3:  # leave a real job as one of its workers (or none of them)
            job, worker, body = real, self._pick([0, 1, n, 65535]), [P.CTRL_LEAVE]
        elif kind == 4:  # leave a job that is not there
            job, worker, body = other, 0, [P.CTRL_LEAVE]
        elif kind == 5:  # probes: anyone there? am I worker w of job j?
            job, worker, body = self._pick([0, real, other]), self._int(0, 3), [P.CTRL_PROBE]
        elif kind == 6:
            job, worker, body = self._pick([0, real]), 0, [P.CTRL_WAKE]
        elif kind == 7:  # fault settings that change nothing (all zero)
            job, worker, body = 0, 0, [P.CTRL_FAULTS] + [0] * len(P.FAULT_FIELDS)
        elif kind == 8:  # fault settings out of range, or for a job
            job, worker = self._pick([(0, 0), (real, 0), (0, 1)])
            rest = len(P.FAULT_FIELDS) - 1
            body = [P.CTRL_FAULTS] + self._pick([[-1] + [0] * rest, [2_000_000] + [0] * rest,
                                                  [0] * 6 + [10_000_001] + [0] * (rest - 6)])
        elif kind == 9:  # unknown ops
            job, worker = self._pick([0, real]), 0
            body = [self._pick([0, 6, 7, -1, 2**31 - 1, -2**31])] + [0] * self._int(0, 8)
        elif kind == 10:  # a known op with the wrong number of values
            job, worker = self._pick([0, real]), 0
            op = self._int(1, 5)
            body = [op] + [1] * self._pick([v for v in range(10)
                                            if v != CONTROL_VALUES[op] - 1])
        else:  # a real worker's join, as is: refused (taken), or from a fuzzer: anything
            job, worker, body = real, 0, [P.CTRL_JOIN, n, k, s, block, bits]
        values = dict(version=P.PROTOCOL_VERSION, flags=P.FLAG_CONTROL, job=job, worker=worker,
                      slot_version=0, seq=0, slot=0, offset=0, count=len(body), blocks=0,
                      value_bits=32, block=0, epoch=0, call=0, quorum=0, mode_quorum=0,
                      mode_generation=0, contributors=0)
        if self.rng.random() < 0.05:  # a reply (CONTROL | RESULT) sent to the switch
            values["flags"] |= P.FLAG_RESULT
        return values, body

    def one(self) -> tuple[bytes, str]:
        """One packet and the source it leaves from."""
        source = self._pick(list(SOURCES))
        mix = self.rng.random()
        if mix < 0.10:    # random bytes, any length up to a jumbo frame
            pkt = self.rng.randbytes(self._int(0, 9000))
        elif mix < 0.20:  # random bytes, short ones around the header
            pkt = self.rng.randbytes(self._int(0, 64))
        elif mix < 0.30:  # random bytes behind a valid version byte
            pkt = bytes([P.PROTOCOL_VERSION]) + self.rng.randbytes(self._int(23, 2000))
        elif mix < 0.65:  # a valid data packet with one header field at an edge
            pkt = self.mutated(*self.data())
        elif mix < 0.70:  # a valid data packet, as is, from a stranger
            pkt = self.pack(*self.data())
        elif mix < 0.80:  # a truncated copy of a valid data or control packet
            if self.rng.random() < 0.7:
                full = self.pack(*self.data())
            else:
                values, body = self.control(source)
                full = self.pack(values, np.asarray(body, ">i4").tobytes())
            pkt = full[:self._int(0, len(full) - 1)]
        elif mix < 0.85:  # a valid data packet with a few random bytes changed
            buf = bytearray(self.pack(*self.data()))
            for _ in range(self._int(1, 4)):
                buf[self._int(0, len(buf) - 1)] = self._int(0, 255)
            pkt = bytes(buf)
        else:             # a control request, half of them with a header field at an edge
            values, body = self.control(source)
            payload = np.asarray(body, ">i4").tobytes()
            pkt = (self.mutated(values, payload) if self.rng.random() < 0.5
                   else self.pack(values, payload))
        return pkt, source

    def packets(self, total: int) -> tuple[list[tuple[bytes, str]], collections.Counter]:
        """``total`` packets and how many must land in each counter."""
        out: list[tuple[bytes, str]] = []
        expected: collections.Counter = collections.Counter()
        while len(out) < total:
            pkt, source = self.one()
            fate = expected_fate(pkt, source, self.jobs, self.pool_left, self.max_elements)
            if fate in ("join", "fault settings!"):
                continue  # would create a job or turn fault injection on: not a fuzz input
            out.append((pkt, source))
            expected[fate] += 1
        return out, expected


def fuzzer_sockets() -> dict[str, socket.socket]:
    socks = {}
    for host in SOURCES:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # replies: let them drop
        s.bind((host, 0))
        s.setblocking(False)
        socks[host] = s
    return socks


def send_accounted(sw: SoftwareSwitch, packets: list[tuple[bytes, str]],
                   socks: dict[str, socket.socket], categories: tuple[str, ...],
                   timeout: float = 10.0) -> collections.Counter:
    """Send the packets in batches, each once the switch has accounted for the last one
    (its counters of ``categories`` grew by as many packets): nothing is lost unseen in a
    full receive buffer. The counters' growth, by category."""
    before = counters(sw)
    target = (sw.address[0], sw.address[1])
    sent = 0

    def seen() -> int:
        now = counters(sw)
        return sum(now[c] - before[c] for c in categories)

    for start in range(0, len(packets), BATCH):
        for pkt, source in packets[start:start + BATCH]:
            while True:
                try:
                    socks[source].sendto(pkt, target)
                    break
                except BlockingIOError:  # the send buffer: wait for it
                    time.sleep(0.0005)
            sent += 1
        deadline = time.monotonic() + timeout
        while (got := seen()) < sent:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the switch accounted for {got} of {sent} packets within {timeout:g} s "
                    f"(kernel drops at its socket: {kernel_drops(sw.address[1])}; "
                    f"counters {counters(sw) - before})")
            time.sleep(0.0005)
        for s in socks.values():  # replies to the fuzzer: read and forget
            try:
                while True:
                    s.recv(65536)
            except BlockingIOError:
                pass
    after = counters(sw)
    return collections.Counter({c: after[c] - before[c] for c in categories
                                if after[c] - before[c]})


# -- the jobs ------------------------------------------------------------------------------

def job_input(seed: int, call: int, rank: int, count: int) -> np.ndarray:
    """Integer-valued float32: exact in the switch's fixed point and in any sum order."""
    rng = np.random.default_rng([seed, call, rank])
    return rng.integers(-1000, 1000, count, endpoint=True).astype(np.float32)


def fuzz_job(comm: Any, p: dict) -> dict[str, Any]:
    """Allreduces until the test says stop: each checked for the exact sum and for the
    engine that served it; rank 0 writes ``started-<seed>`` after the first call."""
    import ina_collectives as ina

    ina.init(comm, switch_min_bytes=0, ring_min_bytes=0)
    flags, seed, count = Path(p["dir"]), p["seed"], p["count"]
    calls = []
    for call in range(1_000_000):
        x = job_input(seed, call, comm.rank, count)
        expected = sum(job_input(seed, call, r, count) for r in range(comm.size))
        y = ina.allreduce(x)
        calls.append((time.time(), bool(np.array_equal(y, expected)),
                      ina.stats()["last_call"]["engine"]))
        if call == 0 and comm.rank == 0:
            (flags / f"started-{seed}").touch()
        if comm.bcast(comm.rank == 0 and (flags / "stop").exists(), root=0):
            break
    stats = ina.stats()
    ina.finalize()
    return {"calls": calls, "stats": stats}


# -- the tests -----------------------------------------------------------------------------

@pytest.mark.mpi
def test_fuzz_while_two_jobs_allreduce(tmp_path):
    """100,000 bad packets at the switch while two 2-rank jobs allreduce through it."""
    with switch_thread() as sw:
        results: dict[int, Any] = {}

        def run_job(seed: int) -> None:
            try:
                results[seed] = mpirun.run(
                    2, fuzz_job, {"dir": str(tmp_path), "seed": seed, "count": 50_003},
                    env={"INA_SWITCH": f"{sw.address[0]}:{sw.address[1]}"}, timeout=150)
            except BaseException as exc:  # checked below
                results[seed] = exc

        jobs = [threading.Thread(target=run_job, args=(seed,)) for seed in (1, 2)]
        for t in jobs:
            t.start()
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started-{seed}").exists() for seed in (1, 2)):
            assert time.monotonic() < deadline and all(t.is_alive() for t in jobs), results
            time.sleep(0.05)
        shapes = {job: sw.aggregator.job_shape(job) for job in list(sw.job_slots)}
        assert len(shapes) == 2, shapes
        kernel_before = kernel_drops(sw.address[1])

        made = time.monotonic()
        packets, expected = Fuzzer(19, shapes, sw.pool_slots - sum(sw.job_slots.values()),
                                   sw.max_elements).packets(FUZZ_PACKETS)
        made = time.monotonic() - made
        socks = fuzzer_sockets()
        started, t0 = time.time(), time.monotonic()
        try:
            seen = send_accounted(sw, packets, socks, CATEGORIES)
        finally:
            for s in socks.values():
                s.close()
        fuzz_seconds, ended = time.monotonic() - t0, time.time()
        still = {job: sw.aggregator.job_shape(job) for job in shapes}
        time.sleep(0.5)  # a few more calls after the fuzz
        (tmp_path / "stop").touch()
        for t in jobs:
            t.join(150)
        print(f"\nfuzz: {len(packets)} packets made in {made:.1f} s, sent and accounted "
              f"for in {fuzz_seconds:.1f} s; by counter: {dict(sorted(seen.items()))}")
        assert kernel_drops(sw.address[1]) == kernel_before
        stats = sw.stats()

    # Every bad packet counted, each where the rules say.
    assert seen == expected, (seen, expected)
    assert sum(seen.values()) == FUZZ_PACKETS
    assert stats["joins"] == 4 and stats["jobs freed idle"] == 0, stats
    # Both jobs still there after the fuzz, and every call served by the switch, exact.
    assert still == shapes, (still, shapes)
    for seed in (1, 2):
        assert not isinstance(results.get(seed), BaseException), results.get(seed)
        ranks = results[seed]
        for r in ranks:
            calls = r["calls"]
            assert all(exact for _, exact, _ in calls), seed
            assert {engine for _, _, engine in calls} == {"ina"}, (seed, r["stats"])
            during = sum(started <= at <= ended for at, _, _ in calls)
            assert during >= 3, (seed, during, len(calls))
        assert len(ranks[0]["calls"]) == len(ranks[1]["calls"])
        print(f"job {seed}: {len(ranks[0]['calls'])} exact calls through the switch, "
              f"{sum(started <= at <= ended for at, _, _ in ranks[0]['calls'])} during "
              f"the fuzz")


def _join(sock: socket.socket, sw: SoftwareSwitch, job: int, worker: int, n: int, k: int,
          s: int) -> int:
    return P.control_exchange(sock, sw.address, job, worker,
                              [P.CTRL_JOIN, n, k, s, P.DEFAULT_BLOCK, 32], 2.0, "join")


def _exchange(sock: socket.socket, sw: SoftwareSwitch, packet: bytes,
              wait: float = 0.3) -> bytes | None:
    """Send one packet; the reply, or None if none comes within ``wait``."""
    sock.settimeout(wait)
    sock.sendto(packet, sw.address)
    try:
        return sock.recv(65536)
    except socket.timeout:
        return None


# the software switch's
CAPS = P.CAP_NACKS | P.CAP_NARROW | P.CAP_OPEN | P.CAP_PREDICT | P.CAP_QUORUM


def test_a_stranger_cannot_end_or_steer_a_job():
    """Control requests from other addresses: a LEAVE of a running job's workers (it
    would have freed the job), fault settings from another address or not whole, control
    replies sent to the switch (two switches would answer each other forever), unknown
    ops and wrong lengths. Each is refused, counted, and changes nothing; the workers'
    own requests still work."""
    with switch_thread() as sw:
        workers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
        for w in workers:
            w.bind(("127.0.0.1", 0))
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.bind(("127.0.0.2", workers[0].getsockname()[1]))  # same port, other host
        local = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        local.bind(("127.0.0.1", 0))
        try:
            for i, w in enumerate(workers):
                assert _join(w, sw, 77, i, 2, 8, 4) == 0
            before = counters(sw)
            for who in (stranger, local):
                for worker in (0, 1):
                    reply = _exchange(who, sw, P.control_packet(77, worker, [P.CTRL_LEAVE]))
                    assert reply is not None
                    assert P.read_control(reply)[1].tolist() == [
                        2, 1, CAPS, 0]
            assert sw.aggregator.job_shape(77) == (2, 8, 4, P.DEFAULT_BLOCK, 32)
            # Fault settings: from another address, ignored; not whole, refused.
            on = P.encode_faults({"drop_in": 1.0})
            assert _exchange(stranger, sw, P.control_packet(0, 0, [P.CTRL_FAULTS] + on)) is None
            assert _exchange(local, sw, P.control_packet(77, 0, [P.CTRL_FAULTS] + on)) is None
            assert _exchange(local, sw, P.control_packet(0, 0, [P.CTRL_FAULTS] + on[:7])) is None
            assert _exchange(local, sw, P.control_packet(0, 0, [P.CTRL_FAULTS] + on)[:-1]) is None
            assert sw.aggregator.faults() == {}
            # Replies sent to the switch are not requests: never answered.
            for body in ([P.CTRL_PROBE, 0], [P.CTRL_LEAVE, 0], [P.CTRL_JOIN, 0]):
                assert _exchange(local, sw, P.control_packet(77, 0, body, reply=True)) is None
            # Unknown ops, no values, values the count does not say.
            probe = P.control_packet(0, 0, [P.CTRL_PROBE])
            for bad in (P.control_packet(0, 0, [6]), P.control_packet(0, 0, [-1, 0]),
                        P.control_packet(0, 0, [P.CTRL_PROBE, 0]),
                        P.control_packet(0, 0, [P.CTRL_JOIN, 2, 8]),
                        probe[:P.HEADER_BYTES], probe + b"\x00", probe + b"\x00" * 4,
                        bytes(probe[:16]) + b"\x00\x02" + bytes(probe[18:])):
                assert _exchange(local, sw, bad, wait=0.1) is None, bad
            time.sleep(0.1)
            grown = counters(sw) - before
            assert grown == collections.Counter({"foreign control": 5, "malformed control": 14}
                                                ), grown
            # The job's own workers: a probe answered, data aggregated, LEAVE frees the job.
            for i, w in enumerate(workers):
                assert P.read_control(_exchange(w, sw, P.control_packet(77, i, [P.CTRL_PROBE]))
                                      )[1].tolist() == [3, 0, CAPS, 0]
            values = [np.arange(8) * (i + 1) for i in range(2)]
            for i, w in enumerate(workers):
                w.sendto(P.pack_data(values[i], flags=0, job=77, worker=i, slot_version=0,
                                     slot=1, offset=0, epoch=5), sw.address)
            for w in workers:
                w.settimeout(2)
                got = w.recv(65536)
                assert np.frombuffer(got[P.HEADER_BYTES + P.PAIR_BYTES:], ">i4").tolist() == \
                    (values[0] + values[1]).tolist()
            for i, w in enumerate(workers):
                assert P.read_control(_exchange(w, sw, P.control_packet(77, i, [P.CTRL_LEAVE]))
                                      )[1].tolist() == [2, 0, CAPS, 0]
            assert sw.aggregator.job_shape(77) is None
            # A LEAVE again (its reply was lost): nothing left to leave, answered 0.
            assert P.read_control(_exchange(workers[0], sw, P.control_packet(
                77, 0, [P.CTRL_LEAVE])))[1].tolist() == [2, 0, CAPS, 0]
            assert parse_status(sw.status_line())["control"]["foreign_control"] == 5
        finally:
            for s in workers + [stranger, local]:
                s.close()


def test_fuzzed_packets_from_a_workers_own_address():
    """Packets with a registered worker's address reach every check of the data path
    (slots, versions, counts and lengths, offsets, epochs, stale numbers, result
    requests): whatever they hold, the switch counts each at most once, keeps serving,
    and a later chunk of another epoch gets the exact sum."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    n, k, slots, job = 2, 16, 4, 91
    with switch_thread() as sw:
        workers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
        for w in workers:
            w.bind(("127.0.0.1", 0))
            w.setblocking(False)
        try:
            for i, w in enumerate(workers):
                w.setblocking(True)
                assert _join(w, sw, job, i, n, k, slots) == 0
                w.setblocking(False)

            def edges(lo: int, hi: int, *more: int) -> Any:
                return st.one_of(st.sampled_from([lo, hi, *more]), st.integers(lo, hi))

            fields = st.fixed_dictionaries({
                "version": st.sampled_from([P.PROTOCOL_VERSION] * 3
                                           + [0, P.PROTOCOL_VERSION - 1, 255]),
                "flags": edges(0, 255, P.FLAG_RETRANSMIT, P.FLAG_NACK, P.FLAG_CONTROL),
                "job": st.sampled_from([job, job, job, 0, job + 1, 65535]),
                "worker": edges(0, 65535, 1, 2, 63, 64),
                "slot_version": edges(0, 255, 1, 2),
                "seq": edges(0, 255),
                "slot": edges(0, 2**32 - 1, slots - 1, slots, 2**31),
                "offset": edges(0, 2**32 - 1, k, 2**31),
                "count": edges(0, 65535, 1, k - 1, k, k + 1),
                "blocks": edges(0, 65535, 1, 2),
                "value_bits": st.sampled_from([32, 32, 16, 0, 255]),
                "block": st.sampled_from([32, 32, 16, 0, 64, 255]),
                "epoch": edges(0, 65535, 1).filter(lambda e: e != 4242),
                "call": edges(0, 65535, 1),
                "quorum": edges(0, 255, 1, n, n + 1),
                "mode_quorum": edges(0, 255),
                "mode_generation": edges(0, 2**32 - 1),
                "contributors": edges(0, 2**64 - 1),
            })

            @hypothesis.settings(max_examples=400, deadline=None, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(fields, st.integers(0, k + 2), st.integers(-4, 4),
                              st.integers(0, n - 1))
            def one(values: dict[str, int], count: int, extra: int, who: int) -> None:
                payload = np.arange(max(0, 4 * count + extra)).astype(np.uint8).tobytes()
                pkt = P.HEADER.pack(*(values[f.name] for f in P.FIELDS)) + payload
                before, got_in = counters(sw), sw.aggregator.packets_in
                workers[who].sendto(pkt, sw.address)
                deadline = time.monotonic() + 2
                while sw.aggregator.packets_in == got_in or (
                        values["flags"] & P.FLAG_CONTROL
                        and sum((counters(sw) - before).values()) == 0):
                    assert time.monotonic() < deadline, "the switch did not take the packet"
                    time.sleep(0.0002)
                grown = counters(sw) - before
                while True:  # the data path counts right after packets_in: let it settle
                    time.sleep(0.0005)
                    if (now := counters(sw) - before) == grown:
                        break
                    grown = now
                assert sum(grown.values()) <= 1, grown
                assert sw.thread.is_alive()  # type: ignore[attr-defined]
                for w in workers:  # results, NACKs and replies: read and forget
                    try:
                        while True:
                            w.recv(65536)
                    except BlockingIOError:
                        pass

            one()
            # The job still aggregates: one chunk of a fresh epoch gets the exact sum.
            values = [np.arange(k) - 7 * i for i in range(n)]
            for i, w in enumerate(workers):
                w.sendto(P.pack_data(values[i], flags=0, job=job, worker=i, slot_version=0,
                                     slot=2, offset=0, epoch=4242, seq=0),
                         sw.address)
            for w in workers:
                w.setblocking(True)
                w.settimeout(2)
                while True:
                    got = w.recv(65536)
                    head = P.unpack_header(got)
                    if head["flags"] == P.FLAG_RESULT and head["epoch"] == 4242:
                        break
                assert np.frombuffer(got[P.HEADER_BYTES + P.PAIR_BYTES:], ">i4").tolist() == \
                    sum(values).tolist()
        finally:
            for w in workers:
                w.close()

