"""Chaos soak: a job kept busy for minutes while the switch dies, ranks stall, links lose
bursts of packets and a second job comes and goes.

    python -m bench.loopback.chaos --minutes 10              # bench/results/chaos.json
    python -m bench.loopback.chaos --minutes 0.5 --seed 3    # the suite's short run

Needs root (network namespaces, nftables). The fabric (ina_collectives/testing/fabric.py)
puts each rank in a namespace of its own and the software switch in the switch's; MPI
crosses the same veths (MPIR_CVAR_NOLOCAL). The main job's ranks (``-n``, workers 0..n-1)
loop over allreduces of mixed sizes (bench/loopback/soak.py's plan: integers times a
power of two, which the switch sums exactly) until told to stop; each result is compared
bit for bit with MPI's own exact sum. Meanwhile, every 1-4 s, one event at random (the
kinds taken in turn, each shuffled round holding every kind once):

  * ``restart``: the switch is SIGKILLed and started again at the same address 0.3-2.5 s
    later;
  * ``stop``: one rank is stopped (SIGSTOP) for 0.1 s up to twice the silence bound, then
    continued;
  * ``loss``: every worker's link drops 5-20% of the INA packets (to and from the
    switch's UDP port), both ways, for 0.3-2 s (nftables); ``--loss-all``: of every IPv4
    packet, MPI's TCP included, whose exponential retransmission backoff then bounds the
    host collectives' waits, not the library (two runs saw a ring call over MPI take 10 s
    and 19 s during overlapping bursts);
  * ``second job``: a job of 2 ranks (workers n, n+1) joins the same switch, makes 20-60
    calls, checked as the main job's, and leaves.

It prints the calls, the outages and returns the ranks counted, the events, and the
longest stall (the longest gap between two calls' starts on any rank), and the ranks'
TCP counters (nstat: retransmissions, timeouts). It fails on a result that is not the
exact sum, ranks that return different bits or engines, a stall longer than the bounds
allow (``stall_bound``: a stopped rank's pause, then the silence bound, the rejoin's join
timeout and the slack of a loaded machine), a job that does not end, or a second job that
fails. A call longer than 5 s prints its engine and why the engines before it did not
serve it (its hand-over's reason).

The ranks run ``python -m bench.loopback.chaos _rank PARAMS OUTDIR`` (this module).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import RESULTS
from bench.loopback import soak

DEFAULT_JSON = RESULTS / "chaos.json"
KINDS = ("restart", "stop", "loss", "second job")
PORT = 47474  # the switch's, in its namespace
RANK_SETTINGS = {"switch_min_bytes": 0, "ring_min_bytes": 0, "timeout": 60.0,
                 "switch_predict": False, "switch_silence": 1.0,
                 "switch_join_timeout": 1.0}
SLACK = 5.0  # seconds a loaded 2-core machine may add to a stall (scheduling, TCP's RTO)


def stall_bound(settings: dict[str, Any]) -> float:
    """The longest a call may be held up here: a rank stopped for up to twice the
    silence bound, then the others' silence bound, the rescue on the ring and a rejoin's
    join timeout, plus SLACK."""
    silence = float(settings["switch_silence"])
    return 2 * silence + silence + float(settings["switch_join_timeout"]) + SLACK


# -- what each rank runs -------------------------------------------------------------------

def rank_main(params: dict[str, Any], outdir: str) -> int:
    """One rank's loop; writes OUTDIR/rank<r>.json (also after an error); 0 if it ran to
    its end."""
    from mpi4py import MPI

    import ina_collectives as ina
    from ina_collectives.collectives.waiting import Deadline, wait

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    settings = {**RANK_SETTINGS, **params.get("settings", {})}
    timeout = float(settings["timeout"])
    Path(outdir, f"{params['name']}{rank}.pid").write_text(str(os.getpid()))
    out: dict[str, Any] = {"rank": rank, "starts": [], "seconds": [], "engines": [],
                           "digests": [], "wrong": [], "error": None}
    stop_file = Path(outdir, "stop")

    def bounded(request: MPI.Request, what: str) -> None:
        wait(request, Deadline(timeout), lambda: what)

    try:
        ina.init(comm, switch=params["switch"], **settings)
        i = 0
        while True:
            plan = soak.plan_call(params["seed"], i, n, params["max_bytes"])
            x = soak.make_input(params["seed"], plan, rank)
            out["starts"].append(time.monotonic())
            result = ina.allreduce(x, op=plan["op"])
            out["seconds"].append(time.monotonic() - out["starts"][-1])
            last = ina.stats()["last_call"]
            out["engines"].append(last["engine"])
            if out["seconds"][-1] > 5.0:  # (what held a long call up: its engine's reasons)
                print(f"chaos rank {rank}: call {i} (started at monotonic "
                      f"{out['starts'][-1]:.2f}) took {out['seconds'][-1]:.2f} s on "
                      f"{last['engine']}: {last}", file=sys.stderr, flush=True)
            out["digests"].append(soak._digest(result))
            exact = np.empty(x.size, np.float64)
            bounded(comm.Iallreduce(x.astype(np.float64), exact, MPI.SUM),
                    f"the exact sum of call {i}")
            if plan["op"] == "average":
                exact /= n
            diff = soak._diff(result, exact.astype(plan["dtype"]))
            if diff is not None:
                out["wrong"].append({"call": i, "engine": out["engines"][-1], **diff})
            i += 1
            done = np.array([int(i >= params["calls"] if params["calls"]
                                 else rank == 0 and stop_file.exists())], np.int64)
            bounded(comm.Iallreduce(MPI.IN_PLACE, done, MPI.MAX), "the stop flag")
            if done[0]:
                break
        out["stats"] = ina.stats()
    except BaseException as exc:  # recorded, then the job ends with it
        out["error"] = f"{type(exc).__name__}: {exc}"
    Path(outdir, f"{params['name']}{rank}.json").write_text(json.dumps(out))
    if out["error"] is None:
        ina.finalize()
        return 0
    print(f"chaos rank {rank}: {out['error']}", file=sys.stderr, flush=True)
    return 1


# -- the launcher ------------------------------------------------------------------------

class Job:
    """One mpiexec job of this module's ranks over fabric workers ``workers``."""

    def __init__(self, fabric: Any, name: str, workers: list[int], params: dict[str, Any],
                 outdir: str):
        from ina_collectives.launch.ranks import find_mpiexec
        from ina_collectives.testing.jobs import ROOT, child_env

        self.name, self.workers, self.outdir = name, workers, outdir
        command = [sys.executable, "-m", "bench.loopback.chaos", "_rank",
                   json.dumps({**params, "name": name}), outdir]
        env = child_env({**fabric.network_environment(workers[0])})
        self.process = subprocess.Popen(
            fabric.mpiexec_command(find_mpiexec(), command, workers), cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output += line

    def pid(self, rank: int) -> int | None:
        try:
            return int(Path(self.outdir, f"{self.name}{rank}.pid").read_text())
        except (OSError, ValueError):
            return None

    def finish(self, limit: float) -> tuple[int | None, list[dict[str, Any]]]:
        """Its exit code (None: killed after ``limit`` s, the ranks asked for their stacks
        first) and each rank's record."""
        from ina_collectives.testing.jobs import STACKS_SECONDS, ask_for_stacks

        try:
            code: int | None = self.process.wait(limit)
        except subprocess.TimeoutExpired:
            if ask_for_stacks(self.process.pid):
                time.sleep(STACKS_SECONDS)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            code = None
        self._reader.join(5)
        records = []
        for rank in range(len(self.workers)):
            path = Path(self.outdir, f"{self.name}{rank}.json")
            records.append(json.loads(path.read_text()) if path.exists()
                           else {"rank": rank, "error": "left no record"})
        return code, records


def check_job(name: str, code: int | None, ranks: list[dict[str, Any]],
              bound: float, events: list[dict[str, Any]] = ()
              ) -> tuple[dict[str, Any], list[str]]:
    """A job's figures and what failed. A stall is held to ``bound`` for each event
    that began while it lasted (``events``, with their monotonic times), one more than
    there were: one call may meet several events (they come every 1-4 s, and a call the
    switch failed takes a few seconds to end on the ring), each with its own bound."""
    failures = []
    if code != 0:
        failures.append(f"{name}: " + ("did not end in time (killed)" if code is None
                                       else f"exited {code}"))
    for r in ranks:
        if r.get("error"):
            failures.append(f"{name}: rank {r['rank']}: {r['error']}")
        for wrong in r.get("wrong", [])[:3]:
            failures.append(f"{name}: rank {r['rank']}: not the exact sum: {wrong}")
    done = min((len(r.get("digests", [])) for r in ranks), default=0)
    differ = [i for i in range(done) if len({r["digests"][i] for r in ranks}) != 1
              or len({r["engines"][i] for r in ranks}) != 1]
    if differ:
        failures.append(f"{name}: {len(differ)} calls differ between the ranks; first: "
                        f"call {differ[0]}")
    stall, at, where, allowed = 0.0, None, None, bound
    over: tuple[float, float] | None = None
    times = sorted(e["mono"] for e in events)
    for r in ranks:
        starts = r.get("starts", [])
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            held = bound * (1 + sum(a < t < b for t in times)) if b - a > bound else bound
            if b - a > stall:
                stall, at, allowed = b - a, a, held
                where = (r["rank"], i, r["engines"][i], round(r["seconds"][i], 3))
            if b - a > held and (over is None or b - a - held > over[0] - over[1]):
                over = (b - a, held)
    if over is not None:
        failures.append(f"{name}: a stall of {over[0]:.2f} s, over its bound of "
                        f"{over[1]:.1f} s ({bound:g} s for each event it met, and one)")
    engines: dict[str, int] = {}
    for e in (ranks[0].get("engines", []) if ranks else []):
        engines[e] = engines.get(e, 0) + 1
    switch = ((ranks[0].get("stats") or {}).get("switch") or {}) if ranks else {}
    return {"calls": done, "engines": engines, "outages": switch.get("outages"),
            "returns": switch.get("returns"), "longest_stall_s": round(stall, 3),
            "longest_stall_at": at, "longest_stall_call": where,
            "longest_stall_bound_s": allowed,
            "wrong": sum(len(r.get("wrong", [])) for r in ranks),
            "ranks_differ": len(differ)}, failures


TCP_COUNTERS = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLostRetransmit",
                "TcpExtTCPRcvQDrop", "TcpExtTCPZeroWindowDrop", "TcpExtTCPWinProbe")


def _tcp_counters(ns: str) -> dict[str, int]:
    """The TCP counters of a rank's namespace since it was made (nstat), which tell a
    stall in MPI's own TCP by its retransmission timeouts."""
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az", *TCP_COUNTERS],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 1 and fields[0] in TCP_COUNTERS and fields[1].isdigit():
            found[fields[0].removeprefix("TcpExt")] = int(fields[1])
    return found


def run_chaos(minutes: float, n: int = 2, seed: int = 1, max_bytes: int = 256 << 10,
              settings: dict[str, Any] | None = None, echo: bool = True,
              kinds: tuple[str, ...] = KINDS, loss_all: bool = False) -> dict[str, Any]:
    """Run the chaos soak (the events of ``kinds``; loss on every IPv4 packet with
    ``loss_all``, else on the INA packets); its summary (``summary["ok"]``)."""
    from ina_collectives.testing.fabric import SWITCH_IP, Fabric

    settings = {**RANK_SETTINGS, **(settings or {})}
    bound = stall_bound(settings)
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    failures: list[str] = []
    second_jobs: list[dict[str, Any]] = []

    def say(text: str) -> None:
        if echo:
            print(f"chaos: {text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="ina-chaos-") as outdir, \
            Fabric(n=n + 2) as fabric:
        switch_args = ("--port", str(PORT), "--stats-interval", "0")
        running = fabric.switch_at(0, *switch_args)
        switch = running.__enter__()
        params = {"seed": seed, "calls": 0, "max_bytes": max_bytes,
                  "switch": f"{SWITCH_IP}:{PORT}", "settings": settings}
        start = time.monotonic()
        main = Job(fabric, "main", list(range(n)), params, outdir)
        try:
            queue: list[str] = []
            while time.monotonic() - start < minutes * 60 and main.process.poll() is None:
                time.sleep(rng.uniform(1.0, 4.0))
                if not queue:
                    queue = rng.sample(kinds, len(kinds))
                kind, at, mono = queue.pop(), time.monotonic() - start, time.monotonic()
                if kind == "restart":
                    switch.process.kill()
                    running.__exit__(None, None, None)
                    down = rng.uniform(0.3, 2.5)
                    time.sleep(down)
                    running = fabric.switch_at(0, *switch_args)
                    switch = running.__enter__()
                    events.append({"at": round(at, 2), "kind": kind,
                                   "down_s": round(down, 2)})
                elif kind == "stop":
                    rank = rng.randrange(n)
                    pid = main.pid(rank)
                    pause = rng.uniform(0.1, 2 * float(settings["switch_silence"]))
                    try:
                        if pid is not None:
                            os.kill(pid, signal.SIGSTOP)
                            time.sleep(pause)
                            os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # the rank has ended: the job's end says why
                    events.append({"at": round(at, 2), "kind": kind, "rank": rank,
                                   "stopped_s": round(pause, 2)})
                elif kind == "loss":
                    p, span = rng.uniform(0.05, 0.2), rng.uniform(0.3, 2.0)
                    fabric.set_loss(p, None if loss_all else PORT)
                    time.sleep(span)
                    fabric.set_loss(0.0)
                    events.append({"at": round(at, 2), "kind": kind, "loss": round(p, 3),
                                   "for_s": round(span, 2)})
                else:
                    calls = rng.randint(20, 60)
                    name = f"second{len(second_jobs)}_"
                    job = Job(fabric, name, [n, n + 1],
                              {**params, "calls": calls,
                               "seed": seed + 1000 + len(second_jobs)}, outdir)
                    code, ranks = job.finish(120.0)
                    figures, failed = check_job(name.rstrip("_"), code, ranks, bound)
                    failures += failed
                    if figures["calls"] != calls:
                        failures.append(f"{name}: {figures['calls']} of {calls} calls")
                    second_jobs.append({"calls": calls, "engines": figures["engines"],
                                        "ok": not failed})
                    events.append({"at": round(at, 2), "kind": kind, "calls": calls,
                                   "engines": figures["engines"]})
                events[-1]["mono"] = mono
                say(f"{at:7.1f} s: {events[-1]}")
        finally:
            fabric.set_loss(0.0)
            Path(outdir, "stop").touch()
            code, ranks = main.finish(120.0)
            running.__exit__(None, None, None)
            status = switch.final_status
            switch_lines = switch.lines[-40:]
            tcp = [_tcp_counters(fabric.worker_ns[w]) for w in range(n)]
        figures, failed = check_job("main job", code, ranks, bound, events)
        failures += failed
        if figures["longest_stall_at"] is not None:  # the events around the longest stall
            begin = figures["longest_stall_at"]
            figures["events_near_longest_stall"] = [
                e for e in events if begin - 5 <= e["mono"] <= begin + figures[
                    "longest_stall_s"]]
        if main.output.strip() and failed:
            failures.append("main job's output:\n" + main.output[-3000:])
    counts = {k: sum(e["kind"] == k for e in events) for k in kinds}
    summary = {"minutes": minutes, "n": n, "seed": seed, "settings": settings,
               "loss_all": loss_all,
               "stall_bound_s": bound, "main": figures, "events": events,
               "event_counts": counts, "second_jobs": second_jobs, "switch_status": status,
               "switch_lines": switch_lines, "tcp": tcp,
               "main_output": main.output[-20000:],
               "ok": not failures, "failures": failures}
    return summary


def report(s: dict[str, Any]) -> str:
    m = s["main"]
    lines = [f"chaos soak, {s['minutes']:g} min, n = {s['n']}, seed {s['seed']}: "
             f"{m['calls']} calls ({m['engines']}), {m['outages']} outages, "
             f"{m['returns']} returns, longest stall {m['longest_stall_s']:.2f} s "
             f"(its bound {m['longest_stall_bound_s']:.1f} s: {s['stall_bound_s']:.1f} s "
             f"for each event it met, and one; the call: rank, index, engine, seconds "
             f"{m['longest_stall_call']})",
             "the ranks' TCP (nstat): " + "; ".join(
                 f"rank {r}: " + ", ".join(f"{k} {v}" for k, v in c.items())
                 for r, c in enumerate(s["tcp"])),
             "events: " + ", ".join(f"{k} {v}" for k, v in s["event_counts"].items()),
             f"wrong results: {m['wrong']}, calls that differ between ranks: "
             f"{m['ranks_differ']}; second jobs: {len(s['second_jobs'])}, "
             f"{sum(j['ok'] for j in s['second_jobs'])} passed",
             "verdict: " + ("PASS" if s["ok"] else "FAIL")]
    near = m.get("events_near_longest_stall")
    if near and m["longest_stall_s"] > s["stall_bound_s"]:
        lines.append("events near the longest stall (from 5 s before it): " + "; ".join(
            ", ".join(f"{k} {v}" for k, v in e.items() if k != "mono") for e in near))
    long_calls = [line for line in s.get("main_output", "").splitlines()
                  if line.startswith("chaos rank ") and " took " in line]
    if long_calls:  # what held each call over 5 s up (its engine's reasons)
        lines.append(f"calls over 5 s: {len(long_calls)}")
        lines += [f"  {line[:600]}" for line in long_calls[-6:]]
    lines += [f"  {f}" for f in s["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        return rank_main(json.loads(argv[1]), argv[2])
    ap = argparse.ArgumentParser(prog="python -m bench.loopback.chaos",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("-n", type=int, default=2, help="the main job's ranks (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-bytes", type=int, default=256 << 10)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"the events, comma-separated (default: {','.join(KINDS)})")
    ap.add_argument("--loss-all", action="store_true",
                    help="loss bursts drop every IPv4 packet (MPI's TCP too), not only the "
                         "INA packets")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(","))
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: each of {', '.join(KINDS)}")
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    s = run_chaos(args.minutes, args.n, args.seed, args.max_bytes, kinds=kinds,
                  loss_all=args.loss_all)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(s, indent=1))
    print(report(s))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
