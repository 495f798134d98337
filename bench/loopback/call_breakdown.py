"""Where one allreduce call's time goes: the opening, the stream, the kernels and Python.

    python -m bench.loopback.call_breakdown              # loopback, n = 2, 4 KiB 64 KiB 1 MiB
    python -m bench.loopback.call_breakdown -n 4 --runs 3   # three jobs: medians, spread
    python -m bench.loopback.call_breakdown --netsim     # n = 4 on emulated 1 Gbit/s (root)
    python -m bench.loopback.call_breakdown --open       # every call opened first, as before

Each rank calls the array API (``ina_collectives.allreduce``, switch_min_bytes 0) back to
back, as a training loop does, and times every call and the parts inside it. Each call
repeats the last of its size, so that it goes predicted, in one switch round trip
(docs/protocol.md, One round trip); ``--open`` opens every call first. The parts
are measured in the ranks without changing the library: the benchmark replaces a few
methods with timing wrappers (time.perf_counter_ns) in its own processes:

* opening: inside ``WorkerLink.opening``, the call's opening through the switch (one
  round trip: the call's identity and its first window's exponents agreed), and of it
  the wait for the last rank to open (a call's ranks meet there) and the rest, from the
  last rank's entry on;
* stream: inside ``WorkerLink.stream``, the data through the switch (its round trips,
  the wire, the waits; the quantization and dequantization run in it, in C), and of it
  the wait for the last rank to begin its stream;
* kernels: the compiled kernels the call runs outside the stream (``ina.kernels``, each
  counted by name: the first window's ``block_exponents`` in the prepare step);
* Python: the rest (the whole call less those three), and where it goes: in the prepare
  step (``InaEngine.prepare`` less its kernels), around the opening (``InaEngine.gate``
  less ``WorkerLink.opening``), around the stream (``InaEngine.run`` less
  ``WorkerLink.stream``) and the rest (the array API and the chooser).

Each time is exclusive of the wrapped parts inside it, so that per call the parts add
up to the whole. The waits compare the ranks' entries on one clock (CLOCK_MONOTONIC, a
host's: loopback and netsim run every rank on one host); a call's wait is the mean over
its ranks (the last one waits for none). A wrapper costs a fraction of a microsecond
(measured and reported); a call passes six, so the whole call is also timed without
them ("call, unwrapped"). Beside the parts stand the arithmetic's: the call's packets
and bytes on the wire each way (protocol.packet_bytes, K from stats()["switch"]), their
time at the link's rate (netsim), and bare UDP round trips on the same path, timed by
rank 0 while the others sleep: to a tiny Python echo where the switch runs, pinned to
one core, from that core and from another (a process woken on another core costs more,
in a virtual machine much more), and to the switch's PROBE (its control path, in
Python). "Round trips" is (call - wire time) over the echo's round trip across cores:
what a call pays beyond its bytes, in round trips of this host.

Loopback starts the embedded switch and runs the ranks under mpiexec, as bench.micro
does; ``--netsim`` builds the namespace fabric (ina_collectives/testing/fabric.py: one namespace per
worker, tbf-shaped links, the switch in a namespace of its own; needs root) and runs the
ranks in the workers' namespaces. Prints one table per setting (size x part, us: the
median over every rank's calls; with --runs, the median of the runs' medians and their
range) and writes JSON (default bench/results/call_breakdown[-netsim].json) with every
call's parts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from bench import RESULTS
from ina_collectives import protocol as P
from ina_collectives.settings import parse_size
from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line, run_group

# The parts each call records (ns), in this order: the whole call, then the wrapped
# parts, each exclusive of the wrapped parts inside it.
WRAPPED = ("opening", "stream", "kernels", "prepare", "open", "run")
PARTS = ("call", *WRAPPED)
# And when this rank entered the opening and the stream (CLOCK_MONOTONIC, ns: one clock
# for every process of a host, so the ranks' entries compare: how long each one waited
# for the last rank to begin).
ENTRIES = ("opening", "stream")
# Bytes a packet adds on a link beside its UDP payload: Ethernet's header (what tbf
# counts: no preamble, no FCS), IPv4's and UDP's.
FRAME_BYTES = 14 + P.IP_UDP_HEADER_BYTES
RTT_SAMPLES = 2000  # round trips timed to each of the echo and the probe


# -- in the ranks ----------------------------------------------------------------------

class Timing:
    """Timing wrappers for methods and functions, each adding its time, exclusive of the
    wrapped calls inside it, to ``spent[part]`` (ns) and counting its calls. One thread:
    a call through one aggregator streams in the calling thread."""

    def __init__(self) -> None:
        self.spent = [0] * len(WRAPPED)
        self.count = [0] * len(WRAPPED)
        self.entered = [0] * len(WRAPPED)  # each part's first entry in this call (ns)
        self.kernel_calls: dict[str, int] = {}
        self._nested = [0]  # the wrapped time inside the innermost running wrapper
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, part: str, fn: Callable[..., Any], name: str = "") -> Callable[..., Any]:
        i = WRAPPED.index(part)
        spent, count, nested, clock = self.spent, self.count, self._nested, time.perf_counter_ns
        kernel_calls, entered = self.kernel_calls, self.entered

        def timed(*args: Any, **kwargs: Any) -> Any:
            outer = nested[0]
            nested[0] = 0
            start = clock()
            if not entered[i]:
                entered[i] = start
            try:
                return fn(*args, **kwargs)
            finally:
                total = clock() - start
                spent[i] += total - nested[0]
                count[i] += 1
                nested[0] = outer + total
                if name:
                    kernel_calls[name] = kernel_calls.get(name, 0) + 1
        return timed

    def install(self, owner: Any, attribute: str, part: str, name: str = "") -> None:
        """Replace ``owner.attribute`` (a class's method, a namespace's function) with its
        timed self until ``remove``."""
        original = getattr(owner, attribute)
        self._undo.append((owner, attribute, original))
        setattr(owner, attribute, self.wrap(part, original, name))

    def remove(self) -> None:
        while self._undo:
            owner, attribute, original = self._undo.pop()
            setattr(owner, attribute, original)

    def reset(self) -> None:
        for i in range(len(WRAPPED)):
            self.spent[i] = self.entered[i] = 0


def wrapper_cost(samples: int = 20000) -> float:
    """A timing wrapper's own cost, ns per call: a wrapped no-op's loop against the bare
    no-op's (the best of three, the machine being shared)."""
    def noop() -> None:
        return None

    timed = Timing().wrap("kernels", noop)
    best = []
    for fn in (noop, timed):
        runs = []
        for _ in range(3):
            start = time.perf_counter_ns()
            for _ in range(samples):
                fn()
            runs.append(time.perf_counter_ns() - start)
        best.append(min(runs) / samples)
    return best[1] - best[0]


def round_trips(address: tuple[str, int], packet: bytes, samples: int) -> list[int]:
    """``samples`` round trips of ``packet`` to ``address`` and its answer back (ns each;
    one lost to a one-second wait is left out), after 20 not counted."""
    times = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.settimeout(1.0)
        for i in range(samples + 20):
            start = time.perf_counter_ns()
            sock.send(packet)
            try:
                sock.recv(65536)
            except socket.timeout:
                continue
            if i >= 20:
                times.append(time.perf_counter_ns() - start)
    return times


def rank_job(out: Path, sizes: list[int], calls: int, warmup: int,
             echo: tuple[str, int], echo_core: int, opened: bool = False) -> None:
    """What each rank runs: the calls of every size, timed whole without the wrappers,
    then whole and by parts with them; rank 0 writes every rank's times to ``out``, and
    the bare round trips it timed (``echo``: the echo's address, on core ``echo_core``).
    ``opened``: every call opens through the switch (switch_predict off); else each call
    repeats the last of its size and goes predicted, with no opening."""
    from mpi4py import MPI

    import ina_collectives as ina
    from ina_collectives.ina.engine import InaEngine
    from ina_collectives.ina.kernels import API as KERNEL_API
    from ina_collectives.ina.link import WorkerLink

    # The engine the array API makes, for its kernels (set at its init).
    engines: list[InaEngine] = []
    init = InaEngine.__init__

    def remembered(self: InaEngine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        engines.append(self)

    InaEngine.__init__ = remembered  # type: ignore[method-assign]
    try:
        ina.init(switch_min_bytes=0, switch_predict=not opened)
    finally:
        InaEngine.__init__ = init  # type: ignore[method-assign]
    comm, n = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_size()
    rank = comm.Get_rank()
    switch = ina.stats()["switch"]
    if not switch.get("serving"):
        raise SystemExit(f"the switch does not serve: {switch}")
    engine = engines[0]
    kernels = engine.kernels
    setting = {"n": n, "k": switch["elements"], "block": switch["block"],
               "value_bits": switch["value_bits"],
               "slots": switch["aggregators"][0]["slots"], "kernels": kernels.name,
               "send_path": switch["send_path"], "receive_path": switch["receive_path"],
               "opened": opened}
    # Rank 0 times the bare round trips while the others sleep (MPI's waits spin): to
    # the echo from its own core and from another (a wake-up across cores costs more,
    # in a virtual machine most), and to the switch's PROBE from where it runs.
    address = P.parse_address(os.environ["INA_SWITCH"].split(",")[0])
    rtt: dict[str, list[int]] = {}
    if rank == 0:
        mine = os.sched_getaffinity(0)
        others = sorted(mine - {echo_core})
        for name, core in (("echo_same_core", echo_core),
                           ("echo_other_core", others[0] if others else None)):
            if core is not None and core in mine:
                os.sched_setaffinity(0, {core})
                try:
                    rtt[name] = round_trips(echo, b"\0" * 16, RTT_SAMPLES)
                finally:
                    os.sched_setaffinity(0, mine)
        rtt["probe"] = round_trips(address, P.control_packet(0, 0, [P.CTRL_PROBE]),
                                   RTT_SAMPLES)
    done = comm.Ibarrier()  # (a nonblocking barrier matches only its like)
    while not done.Test():
        time.sleep(0.001)
    cost = wrapper_cost()
    records = []
    timing = Timing()
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        before = ina.stats()
        served0, reasons0 = before["engines"].get("ina", 0), before["fallback_reasons"]
        comm.Barrier()
        for _ in range(warmup):
            ina.allreduce(x, out=y)
        plain = np.empty(calls, np.int64)
        for c in range(calls):
            start = time.perf_counter_ns()
            ina.allreduce(x, out=y)
            plain[c] = time.perf_counter_ns() - start
        timing.install(WorkerLink, "opening", "opening")
        timing.install(WorkerLink, "stream", "stream")
        timing.install(InaEngine, "prepare", "prepare")
        timing.install(InaEngine, "gate", "open")
        timing.install(InaEngine, "run", "run")
        for name in KERNEL_API:  # (every kernel, whichever the call runs)
            timing.install(kernels, name, "kernels", name)
        try:
            for _ in range(max(1, warmup // 4)):
                ina.allreduce(x, out=y)
            timing.count[:] = [0] * len(WRAPPED)
            timing.kernel_calls.clear()
            rows = np.empty((calls, len(PARTS) + len(ENTRIES)), np.int64)
            entries = [WRAPPED.index(part) for part in ENTRIES]
            for c in range(calls):
                timing.reset()
                start = time.perf_counter_ns()
                ina.allreduce(x, out=y)
                rows[c, 0] = time.perf_counter_ns() - start
                rows[c, 1:len(PARTS)] = timing.spent
                rows[c, len(PARTS):] = [timing.entered[i] for i in entries]
        finally:
            timing.remove()
        if y[0] != n or y[-1] != n:
            raise SystemExit(f"rank {rank}: {nbytes} bytes summed to {y[0]}, {y[-1]}, not "
                             f"{n}")
        # A call the switch did not serve (it failed midway: the ring finished it) stays
        # among the timed ones, and the report says so, with why.
        now = ina.stats()
        total = warmup + calls + max(1, warmup // 4) + calls
        not_served = total - (now["engines"].get("ina", 0) - served0)
        why = {reason: count - reasons0.get(reason, 0)
               for reason, count in now["fallback_reasons"].items()
               if count > reasons0.get(reason, 0) and reason.startswith("ina:")}
        records.append({"bytes": nbytes, "not_served": not_served, "why_not": why,
                        "plain": plain.tolist(), "rows": rows.tolist(),
                        "per_call": {p: c / calls for p, c in zip(WRAPPED, timing.count)},
                        "kernel_calls": {k: v / calls for k, v in timing.kernel_calls.items()}})
    gathered = comm.gather({"records": records, "wrapper_ns": cost}, root=0)
    ina.finalize()
    if rank == 0:
        out.write_text(json.dumps({"setting": setting, "rtt": rtt, "ranks": gathered}))


def echo_server(host: str) -> None:
    """A bare UDP echo on ``host``, on one core (the first this process may use): prints
    its port and that core, then answers every datagram with itself until killed (the
    round trip's other end, where the switch runs)."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        print(sock.getsockname()[1], core, flush=True)
        while True:
            data, peer = sock.recvfrom(65536)
            sock.sendto(data, peer)


# -- the harness -----------------------------------------------------------------------

@contextlib.contextmanager
def echo_at(host: str, launcher: Sequence[str] = ()) -> Iterator[tuple[str, int, int]]:
    """The echo server (``echo_server``) running on ``host``, ``launcher`` before its
    command (ip netns exec NS); its address and core."""
    process = subprocess.Popen([*launcher, sys.executable, "-m",
                                "bench.loopback.call_breakdown", "--echo-server", host],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env=child_env(keep_settings=True))
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        if not line.replace(" ", "").strip().isdigit():
            raise SystemExit(f"the UDP echo did not start on {host}: {line!r}")
        port, core = map(int, line.split())
        yield host, port, core
    finally:
        process.terminate()
        process.wait()


def _job_limit(args: argparse.Namespace) -> float:
    """A bound for one job: start-up, plus each call 20 times its bytes' time at 100
    Mbit/s (or the link's rate), plus 5 ms (the machine is shared)."""
    rate = (args.rate if args.netsim else 100.0) * 1e6 / 8
    per_round = sum(0.005 + 20 * s / rate for s in args.sizes)
    return 120 + 2 * (args.calls + args.warmup) * per_round


def rank_command(args: argparse.Namespace, out: Path, echo: tuple[str, int, int]
                 ) -> list[str]:
    return [sys.executable, "-m", "bench.loopback.call_breakdown", "--rank-job", str(out),
            "--sizes", *map(str, args.sizes), "--calls", str(args.calls), "--warmup",
            str(args.warmup), "--echo", f"{echo[0]}:{echo[1]}", "--echo-core",
            str(echo[2]), *(["--open"] if args.open else [])]


def run_loopback(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.runs`` jobs of n ranks under mpiexec, through the embedded switch."""
    from ina_collectives.launch.ranks import find_mpiexec
    from ina_collectives.switch.embedded import embedded_switch

    mpiexec = str(find_mpiexec())
    jobs = []
    with embedded_switch() as switch, echo_at("127.0.0.1") as echo, \
            tempfile.TemporaryDirectory(prefix="call-breakdown-") as tmp:
        env = child_env({"INA_SWITCH": switch.address_text}, keep_settings=True)
        for run in range(args.runs):
            out = Path(tmp, f"run{run}.json")
            command = mpiexec_line(mpiexec, rank_command(args, out, echo), n=args.n)
            code, output = run_group(command, env, _job_limit(args))
            if code is None:
                raise SystemExit(f"the ranks did not finish within {_job_limit(args):.0f} "
                                 f"s:\n{_tail(output)}")
            if code != 0 or not out.exists():
                raise SystemExit(f"the ranks failed ({code}):\n{_tail(output)}")
            jobs.append(json.loads(out.read_text()))
    return jobs


def run_netsim(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.runs`` jobs of n ranks, one in each worker's namespace of an emulated
    cluster (ina_collectives/testing/fabric.py), through a switch in its switch
    namespace."""
    import mpi4py

    mpi4py.rc.initialize = False  # the harness never communicates: only its ranks do

    from ina_collectives.launch.ranks import find_mpiexec
    from ina_collectives.testing.fabric import Fabric, aggregator_ip

    mpiexec = str(find_mpiexec())
    jobs = []
    with Fabric(args.n, link_mbit=args.rate, mtu=args.mtu) as cluster, \
            cluster.switch_at(0, "--idle", "30") as switch, \
            echo_at(aggregator_ip(0), cluster.in_switch([])) as echo, \
            tempfile.TemporaryDirectory(prefix="call-breakdown-") as tmp:
        env = child_env({**cluster.network_environment(0),
                         "INA_SWITCH": switch.address_text,
                         "INA_SWITCH_ELEMENTS": str(P.elements_for_mtu(args.mtu)),
                         "INA_TIMEOUT": "120"}, keep_settings=True)
        for run in range(args.runs):
            out = Path(tmp, f"run{run}.json")
            jobs.append(cluster.job_record(mpiexec, rank_command(args, out, echo), env,
                                           _job_limit(args), out,
                                           f"run {run + 1} of the breakdown"))
    return jobs


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# -- the arithmetic and the report -----------------------------------------------------

def wire(nbytes: int, k: int, block: int, value_bits: int, slots: int,
         opened: bool = True) -> dict[str, int]:
    """One call's packets and bytes on a link each way (a worker's uplink carries its
    packets, its downlink their results, the same sizes): the opening's, if ``opened``
    (one packet per slot of the first window: a header and G pairs; a predicted call has
    none), and the data's (a chunk of K values per packet, the last one short), each
    with FRAME_BYTES."""
    elements = nbytes // 4
    chunks = -(-elements // k)
    full, last = divmod(elements, k)
    data = full * P.packet_bytes(k, block, value_bits) + (
        P.packet_bytes(last, block, value_bits) if last else 0)
    opening = min(slots, chunks) if opened else 0
    g = P.sub_blocks(k, block)
    return {"data_packets": chunks, "opening_packets": opening,
            "bytes": data + chunks * FRAME_BYTES
            + opening * (P.HEADER_BYTES + P.PAIR_BYTES * g + FRAME_BYTES)}


def summarize(job: dict[str, Any]) -> dict[str, Any]:
    """One job's medians (us) per size over every rank's calls: each part, the waits for
    the last rank, Python and where it goes, the unwrapped call; the round trips; the
    wrapper's cost."""
    sizes = []
    for i, first in enumerate(job["ranks"][0]["records"]):
        per_rank = [np.asarray(r["records"][i]["rows"], np.int64) for r in job["ranks"]]
        rows = np.concatenate(per_rank)
        plain = np.concatenate([np.asarray(r["records"][i]["plain"], np.int64)
                                for r in job["ranks"]])
        part = {p: rows[:, j] for j, p in enumerate(PARTS)}
        # The same call on every rank is the same row: the last rank's entry less each
        # one's own is how long that one waited for it (0 where a part never ran); the
        # last rank itself waits for none, so a call's wait is the mean over the ranks.
        waits, mean_waits = {}, {}
        for j, name in enumerate(ENTRIES):
            at = np.stack([r[:, len(PARTS) + j] for r in per_rank])
            wait = np.where(at.min(axis=0) > 0, at.max(axis=0) - at, 0)
            waits[name], mean_waits[name] = wait.reshape(-1), wait.mean(axis=0)
        python = part["call"] - part["opening"] - part["stream"] - part["kernels"]
        rest = python - part["prepare"] - part["open"] - part["run"]
        median = {name: float(np.median(values)) / 1e3 for name, values in (
            *part.items(), ("opening_wait", mean_waits["opening"]),
            ("opening_after", part["opening"] - waits["opening"]),
            ("stream_wait", mean_waits["stream"]), ("python", python),
            ("api_and_chooser", rest), ("call_unwrapped", plain))}
        sizes.append({"bytes": first["bytes"], "median_us": median,
                      "per_call": first["per_call"], "kernel_calls": first["kernel_calls"]})
    rtt = {name: float(np.median(times)) / 1e3 for name, times in job["rtt"].items()}
    # The round trip the parts are set beside: the echo's across cores (where a call's
    # processes run, on a host of several), or on one where there is one.
    rtt["echo"] = rtt.get("echo_other_core", rtt["echo_same_core"])
    cost = float(np.median([r["wrapper_ns"] for r in job["ranks"]]))
    return {"sizes": sizes, "rtt_us": rtt, "wrapper_ns": cost}


# The table's rows: (label, the median's key in summarize's record). The "-" rows are
# medians of their own: they need not add up to the row above them.
ROWS = (("call", "call"), ("opening (WorkerLink.opening)", "opening"),
        ("- waiting for the last rank to open (mean over ranks)", "opening_wait"),
        ("- from the last rank's opening on", "opening_after"),
        ("stream (WorkerLink.stream)", "stream"),
        ("- waiting for the last rank's stream (mean over ranks)", "stream_wait"),
        ("kernels (outside the stream)", "kernels"),
        ("Python (the rest)", "python"), ("- in prepare", "prepare"),
        ("- around the opening", "open"), ("- around the stream", "run"),
        ("- array API and chooser", "api_and_chooser"),
        ("call, unwrapped", "call_unwrapped"))


def _cell(values: list[float], digits: int = 0) -> str:
    """A median, with the range over runs where there are several."""
    middle = float(np.median(values))
    text = f"{middle:.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return text


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def report(setting: dict[str, Any], summaries: list[dict[str, Any]],
           jobs: list[dict[str, Any]]) -> str:
    """The Markdown table of one setting: a row per part, a column per size (us); then
    the round trips, and any call the switch did not serve."""
    sizes = [s["bytes"] for s in summaries[0]["sizes"]]
    runs = len(summaries)
    where = (f"netsim, n = {setting['n']}, {setting['rate_mbit']:g} Mbit/s links, MTU "
             f"{setting['mtu']}" if setting.get("netsim") else f"loopback, n = {setting['n']}")
    head = (f"{where}; K {setting['k']}, S {setting['slots']}, B {setting['block']}, "
            f"{setting['value_bits']}-bit values; {setting['calls']} calls per size after "
            f"{setting['warmup']} warm-up, back to back; us, the median over every rank's "
            f"calls" + (f", median of {runs} runs (their range)" if runs > 1 else ""))
    lines = [head, "", "| part | " + " | ".join(map(_size, sizes)) + " |",
             "| --- |" + " --- |" * len(sizes)]

    def row(label: str, values: Callable[[dict[str, Any], int], float], digits: int = 0
            ) -> None:
        lines.append(f"| {label} | " + " | ".join(
            _cell([values(s, i) for s in summaries], digits) for i in range(len(sizes)))
            + " |")

    for label, key in ROWS:
        row(label, lambda s, i, key=key: s["sizes"][i]["median_us"][key])
    arithmetic = [wire(b, setting["k"], setting["block"], setting["value_bits"],
                       setting["slots"], setting.get("opened", True)) for b in sizes]
    lines.append("| packets each way (opening + data) | " + " | ".join(
        f"{a['opening_packets']} + {a['data_packets']}" for a in arithmetic) + " |")
    lines.append("| bytes each way | " + " | ".join(f"{a['bytes']:,}" for a in arithmetic)
                 + " |")
    rate = setting.get("rate_mbit")
    wire_us = [a["bytes"] * 8 / rate if rate else 0.0 for a in arithmetic]
    if rate:
        lines.append(f"| wire time at {rate:g} Mbit/s | " + " | ".join(
            f"{w:.0f}" for w in wire_us) + " |")
        row("ideal: the wire and one round trip (echo)",
            lambda s, i: wire_us[i] + s["rtt_us"]["echo"])
    row("round trips: (call - wire) / echo",
        lambda s, i: (s["sizes"][i]["median_us"]["call"] - wire_us[i]) / s["rtt_us"]["echo"],
        1)
    kernels = "; ".join(f"{name} x{count:g}" for name, count in
                        summaries[0]["sizes"][0]["kernel_calls"].items()) or "none"
    wrappers = sum(summaries[0]["sizes"][0]["per_call"].values())
    other = all("echo_other_core" in s["rtt_us"] for s in summaries)
    lines += ["", f"Bare UDP round trips from rank 0 (median): to a UDP echo where the "
                  f"switch runs, from the echo's core "
                  f"{_cell([s['rtt_us']['echo_same_core'] for s in summaries])} us"
                  + (f" and from another core "
                     f"{_cell([s['rtt_us']['echo_other_core'] for s in summaries])} us "
                     f"(\"echo\" above)" if other else " (\"echo\" above)")
                  + f"; to the switch's PROBE (its control path, in Python) "
                  f"{_cell([s['rtt_us']['probe'] for s in summaries])} us. A timing "
                  f"wrapper costs {_cell([s['wrapper_ns'] / 1e3 for s in summaries], 2)} "
                  f"us; a call at {_size(sizes[0])} passes {wrappers:g}. Kernels outside "
                  f"the stream, per call at "
                  f"{_size(sizes[0])}: {kernels}."]
    for i, nbytes in enumerate(sizes):
        for run, job in enumerate(jobs):
            missed = job["ranks"][0]["records"][i]
            if missed["not_served"]:
                lines.append(f"Run {run + 1}, {_size(nbytes)}: {missed['not_served']} call(s) "
                             f"of the warm-up and timed ones were not the switch's alone "
                             f"(on rank 0: {'; '.join(missed['why_not'])}).")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.loopback.call_breakdown",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, help="ranks (default 2 on loopback, 4 on netsim)")
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M"],
                        help="bytes of float32 per call, e.g. 4K 64K 1M (the default)")
    parser.add_argument("--calls", type=int, default=300,
                        help="timed calls per size, without the timing wrappers and "
                             "again with them (default 300)")
    parser.add_argument("--warmup", type=int, default=30,
                        help="calls per size before the timed ones (default 30)")
    parser.add_argument("--runs", type=int, default=1,
                        help="jobs, one after the other: the table gives the median of "
                             "their medians and the range (default 1)")
    parser.add_argument("--netsim", action="store_true",
                        help="on the namespace fabric's emulated links (needs root)")
    parser.add_argument("--rate", type=float, default=1000.0, metavar="MBIT",
                        help="--netsim: the links' rate in Mbit/s (default 1000)")
    parser.add_argument("--mtu", type=int, default=9000,
                        help="--netsim: the links' MTU; K follows from it (default 9000)")
    parser.add_argument("--open", action="store_true",
                        help="every call opens through the switch first (switch_predict "
                             "off); by default each call repeats the last of its size and "
                             "goes predicted, in one round trip")
    parser.add_argument("--json", type=Path,
                        help="the output (default bench/results/call_breakdown.json, "
                             "call_breakdown-netsim.json with --netsim)")
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes]
    except ValueError:
        parser.error(f"--sizes takes sizes such as 4K 64K 1M, got {' '.join(args.sizes)}")
    if any(s < 4 or s % 4 for s in args.sizes):
        parser.error("--sizes must be positive multiples of 4 bytes (float32)")
    args.n = args.n if args.n is not None else (4 if args.netsim else 2)
    if not 2 <= args.n <= P.MAX_WORKERS:
        parser.error(f"-n must be 2..{P.MAX_WORKERS} ranks, got {args.n}")
    if args.calls < 3 or args.warmup < 0 or args.runs < 1:
        parser.error("--calls must be 3 or more, --warmup 0 or more, --runs 1 or more")
    if args.rate <= 0 or not 576 <= args.mtu <= 65535:
        parser.error("--rate must be positive and --mtu 576..65535")
    if args.netsim and os.geteuid() != 0:
        parser.error("--netsim needs root (network namespaces and tc): run it as root")
    args.json = args.json or RESULTS / (
        "call_breakdown-netsim.json" if args.netsim else "call_breakdown.json")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--echo-server"]:  # (the harness's own: not in --help)
        echo_server(argv[1])
        return 0
    if argv[:1] == ["--rank-job"]:
        job = argparse.ArgumentParser(prog="python -m bench.loopback.call_breakdown --rank-job OUT")
        job.add_argument("out", type=Path)
        job.add_argument("--sizes", type=int, nargs="+", required=True)
        job.add_argument("--calls", type=int, required=True)
        job.add_argument("--warmup", type=int, required=True)
        job.add_argument("--echo", type=P.parse_address, required=True)
        job.add_argument("--echo-core", type=int, required=True)
        job.add_argument("--open", action="store_true")
        given = job.parse_args(argv[1:])
        rank_job(given.out, given.sizes, given.calls, given.warmup, given.echo,
                 given.echo_core, given.open)
        return 0
    args = parse_args(argv)
    harness = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:  # unwind: namespaces removed
        if os.getpid() != harness:
            os._exit(0)
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    jobs = run_netsim(args) if args.netsim else run_loopback(args)
    setting = {**jobs[0]["setting"], "netsim": args.netsim, "calls": args.calls,
               "warmup": args.warmup, "runs": args.runs,
               **({"rate_mbit": args.rate, "mtu": args.mtu} if args.netsim else {})}
    summaries = [summarize(job) for job in jobs]
    table = report(setting, summaries, jobs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "setting": setting, "parts": list(PARTS), "summaries": summaries,
        "wire": {str(b): wire(b, setting["k"], setting["block"], setting["value_bits"],
                              setting["slots"], args.open) for b in args.sizes},
        "table": table, "jobs": jobs}))
    print(table)
    print(f"\n{args.runs} run(s) in {time.monotonic() - started:.0f} s: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
