"""The switch restarted under a training loop: is every call exact, and how soon after
the switch answers again does the job use it?

    python -m bench.loopback.restart                       # 1 run: 4 ranks, 1 MiB, 40 s
    python -m bench.loopback.restart --runs 5 --hog        # 5 runs beside two busy loops
    python -m bench.loopback.restart --json bench/results/restart.json

The scenario of docs/reliability.md, The return: n ranks under mpiexec loop for
--seconds over a float32 allreduce of --size bytes through the library, each call
between MPI's own Allreduce on COMM_WORLD and an allreduce of rank 0's "stop" flag
(INA_SWITCH_MIN_BYTES=0, INA_SWITCH_SILENCE=1). A standalone ina-switch is SIGKILLed
--kill-at seconds in and started again on the same port --down seconds later. The
inputs are small integers, so every sum is exact through the switch as on the ring.

Per run it prints: the calls, those not exact, whether every rank returned the same bits,
the outages and returns the library counted, and the return: the seconds from the moment
the switch listened again to the first call that started after it and was served by it.
The bound (docs/reliability.md) is 1 s, or the next call after that second: a run fails
if a call that started more than 1 s after the switch listened went elsewhere. --hog
runs two busy loops (nice 0) beside each run, as a loaded 2-core machine. Exit code 0
only if every run passed.

The ranks run ``python -m bench.loopback.restart _rank PARAMS OUTDIR`` (this module).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line

BOUND = 1.0  # seconds: the return's bound once the switch listens again


def rank_main(params: dict[str, Any], outdir: str) -> int:
    """One rank's loop (module docstring); writes rank<r>.json to ``outdir``."""
    from mpi4py import MPI

    import ina_collectives as ina

    comm = MPI.COMM_WORLD
    ina.init(comm)
    count = params["size"] // 4
    end = time.monotonic() + params["seconds"]
    own = np.empty(4, np.float64)
    rng = np.random.default_rng(comm.rank)
    calls: list[dict[str, Any]] = []
    i = 0
    while True:
        comm.Allreduce(np.full(4, comm.rank, np.float64), own, op=MPI.SUM)
        x = rng.integers(-64, 64, count).astype(np.float32)
        want = np.empty_like(x)
        comm.Allreduce(x, want, op=MPI.SUM)  # (exact: small integers)
        start = time.monotonic()
        y = ina.allreduce(x)
        calls.append({"start": start, "seconds": time.monotonic() - start,
                      "engine": ina.stats()["last_call"]["engine"],
                      "exact": bool(np.array_equal(y, want)),
                      "digest": hashlib.sha1(y.tobytes()).hexdigest()})
        i += 1
        stop = comm.allreduce(int(comm.rank == 0 and time.monotonic() >= end), op=MPI.MAX)
        if stop:
            break
        time.sleep(params.get("pause", 0.0))
    switch = ina.stats().get("switch", {})
    out = {"rank": comm.rank, "calls": calls,
           "outages": switch.get("outages", 0), "returns": switch.get("returns", 0)}
    Path(outdir, f"rank{comm.rank}.json").write_text(json.dumps(out))
    ina.finalize()
    return 0


def _switch(port: int, bound: float = 15.0) -> tuple[subprocess.Popen, float]:
    """A standalone ina-switch on ``port``; it and the moment it listened (within
    ``bound`` seconds, or RuntimeError saying so)."""
    proc = subprocess.Popen([sys.executable, "-m", "ina_collectives.switch", "--host",
                             "127.0.0.1", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(None), cwd=ROOT)
    heard = threading.Event()

    def read() -> None:  # (the switch's output read to its end, so that it never blocks)
        for line in proc.stdout:
            if "listening on" in line:
                heard.set()
    threading.Thread(target=read, daemon=True).start()
    if heard.wait(bound):
        return proc, time.monotonic()
    proc.kill()
    proc.wait()
    raise RuntimeError(f"ina-switch did not say it listened on 127.0.0.1:{port} "
                       f"within {bound:g} s")


@contextlib.contextmanager
def _hog(on: bool):
    """Two busy loops at nice 0 while the block runs (``on``)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(2 if on else 0)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def one_run(n: int, size: int, seconds: float, kill_at: float, down: float,
            hog: bool) -> dict[str, Any]:
    """One run of the scenario: its figures and verdict."""
    from ina_collectives.launch.cli import free_udp_ports
    from ina_collectives.launch.ranks import find_mpiexec

    port = free_udp_ports(1)[0]
    with tempfile.TemporaryDirectory(prefix="ina-restart-") as outdir, _hog(hog):
        sw, _ = _switch(port)
        env = child_env({"INA_SWITCH": f"127.0.0.1:{port}", "INA_SWITCH_MIN_BYTES": "0",
                         "INA_SWITCH_SILENCE": "1"})
        params = json.dumps({"size": size, "seconds": seconds})
        cmd = mpiexec_line(find_mpiexec(), [sys.executable, "-m", "bench.loopback.restart",
                                            "_rank", params, outdir], n=n)
        job = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        try:
            time.sleep(max(0.0, started + kill_at - time.monotonic()))
            sw.kill()
            sw.wait(5)
            killed = time.monotonic()
            time.sleep(down)
            sw, back = _switch(port)
            _, err = job.communicate(timeout=seconds + 120)
        except subprocess.TimeoutExpired:
            return {"passed": False, "failures": [
                f"the job did not end within {seconds + 120:g} s of its start"]}
        finally:
            sw.kill()
            sw.wait(5)
            if job.poll() is None:  # (timed out, or the restart failed: the job goes too)
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        ranks = []
        for r in range(n):
            path = Path(outdir, f"rank{r}.json")
            if path.exists():
                ranks.append(json.loads(path.read_text()))
    failures = []
    if job.returncode != 0 or len(ranks) != n:
        failures.append(f"mpiexec exited {job.returncode}; {len(ranks)} of {n} ranks left "
                        f"results: {err[-500:]}")
        return {"passed": False, "failures": failures}
    calls = ranks[0]["calls"]
    wrong = sum(not c["exact"] for r in ranks for c in r["calls"])
    alike = all([c["digest"] for c in r["calls"]] == [c["digest"] for c in calls]
                for r in ranks)
    served_after = [c["start"] - back for c in calls
                    if c["start"] >= back and c["engine"] == "ina"]
    late = [c for c in calls if c["start"] > back + BOUND and c["engine"] != "ina"]
    if wrong:
        failures.append(f"{wrong} results not exact")
    if not alike:
        failures.append("the ranks returned different bits")
    if not served_after:
        failures.append("never served again after the restart")
    if late:
        failures.append(f"{len(late)} calls that started over {BOUND:g} s after the switch "
                        f"listened went to {sorted({c['engine'] for c in late})}")
    between = [c for c in calls if killed <= c["start"] < back]
    return {"passed": not failures, "failures": failures, "calls": len(calls),
            "wrong": wrong, "alike": alike, "hog": hog,
            "fallback_calls": sum(c["engine"] != "ina" for c in calls),
            "calls_while_down": len(between),
            "outages": ranks[0]["outages"], "returns": ranks[0]["returns"],
            "return_seconds": served_after[0] if served_after else None,
            "calls_to_return": sum(1 for c in calls if back <= c["start"]
                                   and (not served_after or c["start"] - back
                                        < served_after[0])),
            "longest_call": max(c["seconds"] for c in calls)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        return rank_main(json.loads(argv[1]), argv[2])
    ap = argparse.ArgumentParser(prog="python -m bench.loopback.restart",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes per call (1 MiB)")
    ap.add_argument("--seconds", type=float, default=40.0, help="each run's loop (40)")
    ap.add_argument("--kill-at", type=float, default=12.0, help="the SIGKILL, s in (12)")
    ap.add_argument("--down", type=float, default=3.0, help="s until the restart (3)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--hog", action="store_true", help="two busy loops beside each run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.n < 2 or args.size < 4 or args.runs < 1:
        ap.error(f"-n must be 2 or more, --size 4 bytes or more and --runs 1 or more; got "
                 f"{args.n}, {args.size}, {args.runs}")
    if not (0 < args.kill_at and args.down > 0 and args.kill_at + args.down < args.seconds):
        ap.error(f"the restart must fall within the loop: 0 < --kill-at, 0 < --down and "
                 f"--kill-at + --down < --seconds; got {args.kill_at}, {args.down}, "
                 f"{args.seconds}")
    results = []
    for i in range(args.runs):
        r = one_run(args.n, args.size, args.seconds, args.kill_at, args.down, args.hog)
        results.append(r)
        if "calls" in r:
            print(f"run {i + 1}: {'PASS' if r['passed'] else 'FAIL'}: {r['calls']} calls, "
                  f"{r['wrong']} not exact, ranks alike {r['alike']}, "
                  f"{r['fallback_calls']} off the switch, outages {r['outages']}, returns "
                  f"{r['returns']}, back on the switch "
                  f"{r['return_seconds'] * 1e3:.0f} ms after it listened "
                  f"({r['calls_to_return']} call(s) later); longest call "
                  f"{r['longest_call']:.2f} s" if r["return_seconds"] is not None else
                  f"run {i + 1}: FAIL: {'; '.join(r['failures'])}", flush=True)
        else:
            print(f"run {i + 1}: FAIL: {'; '.join(r['failures'])}", flush=True)
        for failure in r["failures"] if r["passed"] is False and "calls" in r else []:
            print(f"  {failure}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    passed = sum(r["passed"] for r in results)
    print(f"{passed} of {len(results)} runs passed{' (beside two busy loops)' if args.hog else ''}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
