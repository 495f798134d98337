"""The software aggregator: ``ina-switch`` / ``python -m ina_collectives.switch``.

A UDP server with the semantics a P4 switch has (docs/protocol.md): the data path is
the compiled ``Aggregator`` (_fast/switch_loop.pyx); this module is its control side:
jobs joining and leaving, idle jobs freed, fault injection, a periodic status line, and
a clean stop on SIGINT/SIGTERM.

Jobs come two ways (docs/control.md): ranks join with control packets (plain
``mpiexec``, no controller), or a controller installs them over P4Runtime
(``--p4runtime-port``, served by ina_collectives.p4runtime_server in a thread of this
process, carried out by this loop between batches).
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import struct
import sys
import time

import numpy as np

from . import protocol as P
from .transport import AggregatorUnavailable, control_exchange

log = logging.getLogger("ina_collectives.switch")

RCVBUF = SNDBUF = 4 << 20  # net.core.rmem_max here; the defaults overflow at line rate


class SoftwareSwitch:
    """An aggregator on one UDP socket."""

    def __init__(self, host: str = "127.0.0.1", port: int = P.UDP_PORT,
                 idle_seconds: float = 60.0, pool_slots: int = 1024,
                 max_elements: int = P.MAX_ELEMENTS, p4runtime_port: int | None = None,
                 device_id: int = 1):
        from ._fast.switch_loop import DROP_REASONS, Aggregator

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self.sock.bind((host, port))
        self.address = self.sock.getsockname()
        self.aggregator = Aggregator(self.sock.fileno())
        self.drop_reasons = DROP_REASONS
        self.idle_seconds = idle_seconds
        # Like a P4 switch's register arrays: a fixed pool of slots shared by the jobs,
        # and a largest K. A job that does not fit is refused (its ranks take the ring).
        self.pool_slots, self.max_elements = pool_slots, max_elements
        self.job_slots: dict[int, int] = {}
        self.control_counts = {"joins": 0, "refusals": 0, "leaves": 0, "jobs freed idle": 0,
                               "malformed control": 0}
        self._stop = False
        self.p4runtime = self._runner = None
        if p4runtime_port is not None:
            self._serve_p4runtime(host, p4runtime_port, device_id, max_elements)

    def _serve_p4runtime(self, host: str, port: int, device_id: int, max_elements: int
                         ) -> None:
        from .p4runtime_server import LoopRunner, Server, Target

        wake_to = ("127.0.0.1" if self.address[0] == "0.0.0.0" else self.address[0],
                   self.address[1])
        waker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        wake = P.pack_header(flags=P.FLAG_CONTROL, job=0, worker=0, slot_version=0, slot=0,
                             offset=0, count=1, exponent=0, proposal=P.PROPOSAL_NONE) + \
            struct.pack("!i", P.CTRL_WAKE)
        self._runner = LoopRunner(lambda: waker.sendto(wake, wake_to))
        self.target = Target(self.aggregator, max_elements, device_id)
        try:
            self.p4runtime = Server(self.target, self._runner, host, port)
        except (OSError, RuntimeError) as exc:
            self.sock.close()
            raise OSError(f"cannot serve P4Runtime on {host}:{port}: {exc}") from None

    def stop(self, *_: object) -> None:
        self._stop = True

    def serve(self, stats_interval: float = 0.0, duration: float | None = None) -> None:
        """Run until stop() (or SIGINT/SIGTERM, set up by main) or ``duration`` seconds."""
        started = last_stats = last_idle = time.monotonic()
        while not self._stop:
            for packet, addr, port in self.aggregator.run(100):
                try:
                    self._control(packet, addr, port)
                except (ValueError, IndexError) as exc:  # a malformed request, not a crash
                    self.control_counts["malformed control"] += 1
                    log.warning("malformed control packet dropped: %s", exc)
            if self._runner is not None:
                self._runner.run_pending()
            now = time.monotonic()
            if stats_interval and now - last_stats >= stats_interval:
                print(self.status_line(), flush=True)
                last_stats = now
            if now - last_idle >= 1.0:
                for job in self.aggregator.idle_jobs(self.idle_seconds):
                    log.warning("job %d sent nothing for %g s: freed", job, self.idle_seconds)
                    self.aggregator.free_job(job)
                    self.job_slots.pop(job, None)
                    self.control_counts["jobs freed idle"] += 1
                last_idle = now
            if duration is not None and now - started >= duration:
                break
        if self.p4runtime is not None:
            self._runner.close()
            self.p4runtime.stop()
        self.sock.close()

    def stats(self) -> dict:
        a = self.aggregator
        return {"packets_in": a.packets_in, "packets_out": a.packets_out,
                "results": a.results, "retransmits_answered": a.retransmits_answered,
                "slots_busy": a.busy_slots(), "drops": a.drop_counts(),
                "faults": a.faults(), **self.control_counts,
                **({"p4runtime jobs": len(self.target.jobs)} if self.p4runtime else {})}

    def status_line(self) -> str:
        s = self.stats()
        drops = ", ".join(f"{k} {v}" for k, v in s["drops"].items()) or "none"
        return (f"ina-switch {self.address[0]}:{self.address[1]}: in {s['packets_in']} "
                f"out {s['packets_out']} results {s['results']} busy slots "
                f"{s['slots_busy']} retransmissions answered {s['retransmits_answered']} "
                + (f"p4runtime jobs {s['p4runtime jobs']} " if "p4runtime jobs" in s else "")
                + f"drops: {drops}")

    # -- control packets -------------------------------------------------------------

    def _control(self, packet: bytes, addr_be: int, port_be: int) -> None:
        head = P.unpack_header(packet)
        payload = packet[P.HEADER_BYTES:]
        body = np.frombuffer(payload[:len(payload) - len(payload) % 4], ">i4")
        if body.size < 1:
            return
        op, job, worker = int(body[0]), head["job"], head["worker"]
        if op == P.CTRL_JOIN and body.size >= 4:
            status = self._join(job, worker, int(body[1]), int(body[2]), int(body[3]),
                                addr_be, port_be)
        elif op == P.CTRL_LEAVE:
            self.control_counts["leaves"] += 1
            if self.aggregator.leave(job, worker):  # never a controller's job
                self.job_slots.pop(job, None)
                log.info("job %d: every worker left, slots freed", job)
            status = 0
        elif op == P.CTRL_PROBE:
            # Job 0: is anyone there? Else: is the sender worker `worker` of the job?
            status = 0 if job == 0 or self.aggregator.worker_at(job, worker, addr_be,
                                                                 port_be) else 1
        elif op == P.CTRL_WAKE:
            return  # the P4Runtime thread woke the loop: run_pending follows
        elif op == P.CTRL_FAULTS and body.size >= 1 + len(P.FAULT_FIELDS):
            if addr_be != struct.unpack("=I", socket.inet_aton("127.0.0.1"))[0]:
                return  # faults only from this machine
            faults = {name: int(v) / (1e3 if name.startswith("delay") else 1e6)
                      for name, v in zip(P.FAULT_FIELDS, body[1:])}
            try:
                self.aggregator.set_faults(**faults)
                status = 0
            except ValueError as exc:
                log.warning("fault settings refused: %s", exc)
                status = 1
            log.warning("fault injection now %s", self.aggregator.faults() or "off")
        else:
            return
        reply = P.pack_header(flags=P.FLAG_CONTROL | P.FLAG_RESULT, job=job, worker=worker,
                              slot_version=0, slot=0, offset=0, count=2, exponent=0,
                              proposal=P.PROPOSAL_NONE)
        self.aggregator.reply(reply + np.array([op, status], ">i4").tobytes(), addr_be,
                              port_be)

    def _join(self, job: int, worker: int, n: int, k: int, slots: int, addr_be: int,
              port_be: int) -> int:
        if not (1 <= n <= P.MAX_WORKERS and 0 <= worker < n and 1 <= k <= self.max_elements
                and 1 <= slots <= 65536):
            self.control_counts["refusals"] += 1
            return 1
        if self.aggregator.is_managed(job):
            self.control_counts["refusals"] += 1
            return 5
        shape = self.aggregator.job_shape(job)
        if shape is None:
            if sum(self.job_slots.values()) + slots > self.pool_slots:
                self.control_counts["refusals"] += 1
                return 4
            if not self.aggregator.add_job(job, n, k, slots):
                return 4
            self.job_slots[job] = slots
            log.info("job %d: %d workers, K %d, S %d", job, n, k, slots)
        elif shape != (n, k, slots):
            self.control_counts["refusals"] += 1
            return 2
        if not self.aggregator.set_worker(job, worker, addr_be, port_be):
            self.control_counts["refusals"] += 1
            return 3
        self.control_counts["joins"] += 1
        return 0


def send_faults(address: tuple[str, int], timeout: float = 2.0, **faults: float) -> None:
    """Set a running switch's fault injection (from this machine); faults not named are
    cleared. Names: drop_in, drop_out, duplicate_in/out, reorder_in/out (probabilities),
    delay_ms_in, delay_ms_out (milliseconds)."""
    unknown = set(faults) - set(P.FAULT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(P.FAULT_FIELDS)}")
    values = [round(faults.get(name, 0) * (1e3 if name.startswith("delay") else 1e6))
              for name in P.FAULT_FIELDS]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            status = control_exchange(s, address, 0, 0, [P.CTRL_FAULTS] + values, timeout,
                                      "fault settings")
        except AggregatorUnavailable as exc:
            raise TimeoutError(str(exc)) from None
    if status:
        raise ValueError(f"the switch refused the fault settings {faults}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ina-switch", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=P.UDP_PORT,
                        help=f"UDP port (default {P.UDP_PORT}; 0 picks a free one)")
    parser.add_argument("--idle", type=float, default=60.0,
                        help="free a job that sent nothing for this many seconds")
    parser.add_argument("--pool-slots", type=int, default=1024,
                        help="slots shared by all jobs (each has two versions); a job that "
                             "does not fit is refused")
    parser.add_argument("--max-elements", type=int, default=P.MAX_ELEMENTS,
                        help="largest K (int32 values per packet) a job may use")
    parser.add_argument("--p4runtime-port", type=int, default=None, metavar="PORT",
                        help="serve P4Runtime (gRPC) on --host:PORT so that a controller "
                             "(ina_collectives.control) installs jobs; 0 picks a free port. "
                             "Needs the p4 extra")
    parser.add_argument("--device-id", type=int, default=1,
                        help="the P4Runtime device id (default 1)")
    parser.add_argument("--stats-interval", type=float, default=0.0,
                        help="print a status line every so many seconds (0: never)")
    parser.add_argument("--log-level", default="INFO")
    for name in P.FAULT_FIELDS:
        flag = "--" + name.replace("_ms", "").replace("_", "-") + ("-ms" if "delay" in name else "")
        parser.add_argument(flag, dest=name, type=float, default=0.0,
                            help="fault injection: " + ("milliseconds added" if "delay" in name
                                                        else "probability per packet"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ina-switch %(levelname)s %(message)s")
    try:
        switch = SoftwareSwitch(args.host, args.port, args.idle, args.pool_slots,
                                args.max_elements, args.p4runtime_port, args.device_id)
    except OSError as exc:
        print(f"ina-switch: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"ina-switch: --p4runtime-port needs the p4 extra (pip install "
              f"'ina-collectives[p4]'): {exc}", file=sys.stderr)
        return 2
    try:
        switch.aggregator.set_faults(**{name: getattr(args, name) for name in P.FAULT_FIELDS})
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, switch.stop)
    signal.signal(signal.SIGINT, switch.stop)
    # The first line says where it listens (tests and launchers read it); with P4Runtime,
    # where that listens comes first.
    if switch.p4runtime is not None:
        print(f"ina-switch p4runtime on {switch.p4runtime.host}:{switch.p4runtime.port}",
              flush=True)
    print(f"ina-switch listening on {switch.address[0]}:{switch.address[1]}", flush=True)
    switch.serve(args.stats_interval)
    print(switch.status_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
