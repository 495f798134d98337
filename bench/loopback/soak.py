"""Soak: many consecutive allreduces of mixed sizes through the switch under injected faults.

    python -m bench.loopback.soak -n 2 --calls 1000          # bench/results/soak.json
    python -m bench.loopback.soak -n 4 --calls 1000 --json bench/results/soak-4.json
    python -m bench.loopback.soak -n 2 --calls 200 --loss 0.1 --jitter-ms 5 \
        --setting switch_silence=1

Issue 19, item 5. Starts the embedded software switch (ina_collectives/switch/embedded.py)
with fault injection in both directions: loss, duplication and reordering (per packet,
the switch's own faults) and delay jitter. The switch delays packets by a fixed amount
only (a FIFO per direction, _fast/switch_faults.pxi), so the jitter is made here: a
thread sets a new random delay in 0 .. --jitter-ms for each direction every
--jitter-period-ms (send_faults, which also re-sends the other faults). Packets queued
under a longer delay are overtaken by those sent after the delay dropped, so jitter also
reorders; within one period every packet of a direction sees the same delay.

Every rank then makes --calls allreduces through ``ina_collectives.allreduce`` with every
size taking the switch (switch_min_bytes 0): per call a size class (a few elements up
to --max-bytes), float32 or float64, SUM or (n a power of two) AVERAGE, out of place or
in place, the same choice on every rank. The inputs are integers times a power of two
per call (2^-20 .. 2^20), of magnitudes below 2^(23 - ceil(log2 n)): the block floating
point quantization (docs/quantization.md) then loses nothing and every sum fits a
float32 mantissa, so the switch must serve the exact sum, and the ring must return the
same bits. Each call's result is compared bit for bit with
  * the exact sum (MPI's own Allreduce of the input widened to float64, cast back), and
  * the ring's result on the same input (a second instance of the library, with no
    switch and ring_min_bytes 0, so its calls go through the ring engine), every
    --ring-every calls (default: every call),
and its digest is compared across ranks here, after the job. Only the allreduce through
the switch is timed (after a barrier; a call's time is the slowest rank's).

Every wait is bounded: each collective by the library's timeout (--setting timeout=...,
default 60 s, CollectiveTimeout otherwise), the whole job by --timeout (the ranks' process
group is killed and the run fails saying so). The JSON holds p50/p90/p99/max call time
per size class, the counters (the links' retransmissions, NACK resends, stale results;
the switch's drops; fallbacks with their reasons) and the wall time. Exit code 0 only
if every check passed and at least --min-ina-fraction of the calls were served by the
switch (a soak where everything fell back to the ring must not pass).

The ranks run ``python -m bench.loopback.soak _rank PARAMS OUTDIR`` (this module).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from bench import RESULTS
from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line

DEFAULT_JSON = RESULTS / "soak.json"

# Size classes by bytes: [low, high) and the share of calls drawn from each.
SIZE_CLASSES: tuple[tuple[str, int, int, float], ...] = (
    ("tiny <1KiB", 4, 1 << 10, 0.20),
    ("small 1-64KiB", 1 << 10, 64 << 10, 0.25),
    ("medium 64-512KiB", 64 << 10, 512 << 10, 0.25),
    ("large 0.5-2MiB", 512 << 10, 2 << 20, 0.20),
    ("xlarge 2-4MiB", 2 << 20, 4 << 20, 0.10),
)
FAULT_DEFAULTS = {"loss": 0.05, "duplicate": 0.05, "reorder": 0.05, "jitter_ms": 2.0,
                  "jitter_period_ms": 10.0}
# (Every call opened: its exponents are what its inputs need, so that the sums are exact.
# A call that repeats an earlier one's length, dtype and op would go predicted, its first
# window summed with exponents up to the earlier inputs' scale, 2^20 here: docs/quantization.md.)
RANK_SETTINGS = {"switch_min_bytes": 0, "ring_min_bytes": 0, "timeout": 60.0,
                 "switch_predict": False}


class SoakFailed(RuntimeError):
    """The soak could not run to its end (the job failed, hung or left no results)."""


# -- what each rank runs -------------------------------------------------------------------

def plan_call(seed: int, i: int, n: int, max_bytes: int, fixed_count: int = 0
              ) -> dict[str, Any]:
    """Call i's shape, the same on every rank: size class, count, dtype, op, magnitudes.
    ``fixed_count``: every call float32 SUM of that many elements with the same
    magnitudes (new values each call), as a training loop's gradients are."""
    if fixed_count:
        top = 23 - math.ceil(math.log2(n)) if n > 1 else 23
        return {"i": i, "size_class": f"fixed {fixed_count * 4} B", "count": fixed_count,
                "dtype": "float32", "op": "sum", "bits": top, "scale": 0, "sparse": False,
                "in_place": False}
    rng = np.random.default_rng([seed, i, 0xC0FFEE])
    classes = [c for c in SIZE_CLASSES if c[1] < max_bytes]
    weights = np.array([c[3] for c in classes])
    name, low, high, _ = classes[rng.choice(len(classes), p=weights / weights.sum())]
    high = min(high, max_bytes)
    dtype = "float64" if rng.random() < 0.2 else "float32"
    itemsize = np.dtype(dtype).itemsize
    nbytes = int(math.exp(rng.uniform(math.log(low), math.log(high))))
    count = max(1, nbytes // itemsize)
    power_of_two = n & (n - 1) == 0
    op = "average" if power_of_two and rng.random() < 0.2 else "sum"
    # |m| < 2^bits with bits <= 23 - ceil(log2 n): n of them sum below 2^23 (a float32
    # mantissa holds it), and the quantum 2^(e + floor(log2 n) - 30) stays below the
    # inputs' 2^scale: the switch adds them exactly.
    top = 23 - math.ceil(math.log2(n)) if n > 1 else 23
    bits = int(rng.integers(1, top + 1))
    scale = int(rng.integers(-20, 21))
    return {"i": i, "size_class": name, "count": count, "dtype": dtype, "op": op,
            "bits": bits, "scale": scale, "sparse": bool(rng.random() < 0.1),
            "in_place": bool(rng.random() < 0.1)}


def make_input(seed: int, plan: dict[str, Any], rank: int) -> np.ndarray:
    rng = np.random.default_rng([seed, plan["i"], rank])
    limit = 1 << plan["bits"]
    m = rng.integers(-limit + 1, limit, plan["count"], dtype=np.int32)
    if plan["sparse"]:  # mostly zeros: whole blocks of zeros among the values
        m[rng.random(plan["count"]) < 0.9] = 0
    return np.ldexp(m.astype(plan["dtype"]), plan["scale"])


def _digest(a: np.ndarray) -> str:
    return hashlib.blake2b(a.tobytes(), digest_size=12).hexdigest()


def _diff(result: np.ndarray, expected: np.ndarray) -> dict[str, Any] | None:
    """None if the bits are equal, else where they differ."""
    width = {4: np.uint32, 8: np.uint64}[result.itemsize]
    bad = np.flatnonzero(result.view(width) != expected.view(width))
    if bad.size == 0:
        return None
    j = int(bad[0])
    return {"elements": int(bad.size), "first": j, "got": float(result[j]),
            "expected": float(expected[j])}


def rank_main(params: dict[str, Any], outdir: str) -> int:
    """One rank's soak; writes OUTDIR/rank<r>.json (also after an error) and returns 0."""
    from mpi4py import MPI

    import ina_collectives as ina
    from ina_collectives.collectives import Collectives
    from ina_collectives.collectives.waiting import Deadline, wait
    from ina_collectives.settings import Settings

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    seed, calls = params["seed"], params["calls"]
    settings = {**RANK_SETTINGS, **params.get("settings", {})}
    timeout = float(settings["timeout"])
    out: dict[str, Any] = {"rank": rank, "n": n, "records": [], "error": None}
    path = Path(outdir, f"rank{rank}.json")
    ring = None
    try:
        ina.init(comm, switch=params["switch"], **settings)
        # The ring alone: a second instance of the library with no switch.
        ring = Collectives(comm, Settings.load({**settings, "switch": ""}))

        def bounded(request: MPI.Request, what: str) -> None:
            wait(request, Deadline(timeout), lambda: what)

        started = time.monotonic()
        for i in range(calls):
            plan = plan_call(seed, i, n, params["max_bytes"], params.get("fixed_count", 0))
            x = make_input(seed, plan, rank)
            wide = x.astype(np.float64)
            op = plan["op"]
            src = x.copy() if plan["in_place"] else x
            before = dict(ina.stats()["transport"])
            bounded(comm.Ibarrier(), f"the barrier before call {i}")
            t0 = time.perf_counter()
            result = ina.allreduce(x, op=op, out=x if plan["in_place"] else None)
            seconds = time.perf_counter() - t0
            last = ina.stats()["last_call"]
            after = ina.stats()["transport"]
            # The exact sum, from MPI itself in float64 (integers times 2^scale, below 2^53).
            exact = np.empty_like(wide)
            bounded(comm.Iallreduce(wide, exact, MPI.SUM), f"the exact sum of call {i}")
            if op == "average":
                exact /= n  # n is a power of two: exact
            expected = exact.astype(plan["dtype"])
            record = {"i": i, "size_class": plan["size_class"], "count": plan["count"],
                      "dtype": plan["dtype"], "op": op, "seconds": seconds,
                      "engine": last["engine"], "passed_over": last["passed_over"],
                      "digest": _digest(result), "exact_diff": _diff(result, expected),
                      "transport": {k: after.get(k, 0) - before.get(k, 0)
                                    for k in after if k not in ("srtt", "rto")}}
            if params["ring_every"] and i % params["ring_every"] == 0:
                t0 = time.perf_counter()
                by_ring = ring.allreduce(src, op)
                record["ring_seconds"] = time.perf_counter() - t0
                record["ring_engine"] = ring.stats.last["engine"]
                record["ring_diff"] = _diff(result, by_ring)
            out["records"].append(record)
            if rank == 0 and params.get("progress") and (i + 1) % params["progress"] == 0:
                print(f"soak: {i + 1}/{calls} calls, {time.monotonic() - started:.1f} s",
                      flush=True)
        out["seconds"] = time.monotonic() - started
        out["stats"] = ina.stats()
        out["ring_stats"] = ring.stats.snapshot()
    except BaseException as exc:  # recorded, then the job ends with it
        out["error"] = {"type": type(exc).__name__, "message": str(exc),
                        "call": len(out["records"]), "traceback": traceback.format_exc()}
        try:
            out["stats"] = ina.stats()
        except Exception:
            pass
    path.write_text(json.dumps(out))
    if out["error"] is None:
        if ring is not None:
            ring.free()
        ina.finalize()
        return 0
    print(f"soak rank {rank}: {out['error']['type']}: {out['error']['message']}",
          file=sys.stderr, flush=True)
    return 1


# -- the launcher ------------------------------------------------------------------------

def fault_settings(loss: float, duplicate: float, reorder: float,
                   delay_in: float = 0.0, delay_out: float = 0.0) -> dict[str, float]:
    return {"drop_in": loss, "drop_out": loss, "duplicate_in": duplicate,
            "duplicate_out": duplicate, "reorder_in": reorder, "reorder_out": reorder,
            "delay_ms_in": delay_in, "delay_ms_out": delay_out}


class Jitter(threading.Thread):
    """Sets a new random delay per direction every period (with the other faults)."""

    def __init__(self, address: tuple[str, int], faults: dict[str, float], jitter_ms: float,
                 period_ms: float, seed: int):
        super().__init__(daemon=True, name="soak-jitter")
        self.address, self.faults = address, faults
        self.jitter_ms, self.period = jitter_ms, period_ms / 1e3
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.updates = 0
        self.errors: list[str] = []
        self.delays: list[float] = []

    def run(self) -> None:
        from ina_collectives.switch import send_faults

        while not self.stop.wait(self.period):
            d_in = round(self.rng.uniform(0, self.jitter_ms), 3)
            d_out = round(self.rng.uniform(0, self.jitter_ms), 3)
            try:
                send_faults(self.address, timeout=2.0,
                            **{**self.faults, "delay_ms_in": d_in, "delay_ms_out": d_out})
                self.updates += 1
                self.delays += [d_in, d_out]
            except Exception as exc:  # the switch dropped every try: counted, reported
                self.errors.append(f"{type(exc).__name__}: {exc}")
                if len(self.errors) > 20:
                    return


def _parse_switch_status(line: str) -> dict[str, Any]:
    """The numbers of the switch's last status line (ina_collectives.switch.parse_status)."""
    from ina_collectives.switch import parse_status

    status = parse_status(line)
    return {"line": line, "packets_in": status["in"], "packets_out": status["out"],
            "results": status["results"],
            "retransmits_answered": status["retransmits_answered"],
            "nacks": status["nacks"], "drops": status["drops"]}


def percentiles(seconds: list[float]) -> dict[str, float]:
    a = np.asarray(seconds) * 1e3
    if a.size == 0:
        return {"calls": 0}
    return {"calls": int(a.size), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "mean_ms": float(a.mean())}


def summarize(ranks: list[dict[str, Any]], calls: int, min_ina_fraction: float
              ) -> dict[str, Any]:
    """Checks and figures from every rank's output; ``verdict`` lists what failed."""
    failures: list[str] = []
    for r in ranks:
        if r.get("error"):
            e = r["error"]
            failures.append(f"rank {r['rank']} raised {e['type']} at call {e['call']}: "
                            f"{e['message']}")
        elif len(r["records"]) != calls:
            failures.append(f"rank {r['rank']} made {len(r['records'])} of {calls} calls")
    done = min((len(r["records"]) for r in ranks), default=0)
    records = [[r["records"][i] for r in ranks] for i in range(done)]
    exact_bad, ring_bad, differ, ring_checked, ring_engines = [], [], [], 0, set()
    for per_rank in records:
        head = per_rank[0]
        for rec in per_rank:
            if rec["exact_diff"]:
                exact_bad.append({"call": rec["i"], "rank": ranks[per_rank.index(rec)]["rank"],
                                  "engine": rec["engine"], "dtype": rec["dtype"],
                                  "op": rec["op"], "count": rec["count"], **rec["exact_diff"]})
            if "ring_diff" in rec:
                ring_engines.add(rec["ring_engine"])
                if rec["ring_diff"]:
                    ring_bad.append({"call": rec["i"], "engine": rec["engine"],
                                     **rec["ring_diff"]})
        ring_checked += "ring_diff" in head
        if len({rec["digest"] for rec in per_rank}) != 1:
            differ.append(head["i"])
    if exact_bad:
        failures.append(f"{len(exact_bad)} results (call, rank) differ from the exact sum; "
                        f"first: {exact_bad[0]}")
    if ring_bad:
        failures.append(f"{len(ring_bad)} results differ from the ring's; first: {ring_bad[0]}")
    if ring_engines - {"ring"}:
        failures.append(f"the reference calls were served by {sorted(ring_engines)}, "
                        f"not the ring alone")
    if differ:
        failures.append(f"{len(differ)} calls gave different bits on different ranks; "
                        f"first: call {differ[0]}")
    engines: dict[str, int] = {}
    fallbacks: list[dict[str, Any]] = []
    for per_rank in records:
        head = per_rank[0]
        engines[head["engine"]] = engines.get(head["engine"], 0) + 1
        if len({rec["engine"] for rec in per_rank}) != 1:
            failures.append(f"call {head['i']}: ranks disagree on the engine")
        if head["engine"] != "ina":
            fallbacks.append({"call": head["i"], "engine": head["engine"],
                              "size_class": head["size_class"], "count": head["count"],
                              "dtype": head["dtype"],
                              "seconds": max(rec["seconds"] for rec in per_rank),
                              "reasons_by_rank": [rec["passed_over"] for rec in per_rank]})
    ina_calls = engines.get("ina", 0)
    if done and ina_calls < min_ina_fraction * calls:
        failures.append(f"only {ina_calls} of {calls} calls were served by the switch "
                        f"(at least {min_ina_fraction:.0%} required): {engines}")
    # A call's time is the slowest rank's.
    times: dict[str, list[float]] = {}
    ring_times: dict[str, list[float]] = {}
    for per_rank in records:
        head = per_rank[0]
        if head["engine"] == "ina":
            times.setdefault(head["size_class"], []).append(max(r["seconds"] for r in per_rank))
        if "ring_seconds" in head:
            ring_times.setdefault(head["size_class"], []).append(
                max(r["ring_seconds"] for r in per_rank))
    order = [c[0] for c in SIZE_CLASSES] + sorted(set(times) - {c[0] for c in SIZE_CLASSES})
    by_class = {c: percentiles(times[c]) for c in order if c in times}
    all_ina = [t for c in times for t in times[c]]
    transport = [{"rank": r["rank"], **(r.get("stats") or {}).get("transport", {})}
                 for r in ranks]
    totals: dict[str, float] = {}
    for t in transport:
        for key, value in t.items():  # every counter the links keep (not SRTT, RTO)
            if key not in ("rank", "srtt", "rto", "seconds"):
                totals[key] = totals.get(key, 0) + value
    stats0 = (ranks[0].get("stats") or {}) if ranks else {}
    slowest = sorted((max(rec["seconds"] for rec in pr), pr[0]["i"], pr[0]["size_class"],
                      pr[0]["count"], pr[0]["dtype"],
                      sum(rec["transport"].get("retransmitted", 0) for rec in pr))
                     for pr in records)[-5:][::-1]
    return {
        "calls": calls, "completed": done, "engines": engines,
        "ina_fraction": ina_calls / calls if calls else 0.0,
        "fallbacks": {"count": len(fallbacks), "calls": fallbacks[:50],
                      "reasons_rank0": stats0.get("fallback_reasons", {}),
                      "switch": stats0.get("switch")},
        "exact": {"mismatches": len(exact_bad), "first": exact_bad[:5]},
        "ring": {"checked_calls": ring_checked, "mismatches": len(ring_bad),
                 "first": ring_bad[:5],
                 "seconds_by_class": {c: percentiles(ring_times[c]) for c in order
                                      if c in ring_times}},
        "identical_on_all_ranks": not differ, "ranks_differ_at": differ[:20],
        "seconds_by_class": by_class, "seconds_all_ina": percentiles(all_ina),
        "slowest_calls": [{"ms": round(s * 1e3, 2), "call": i, "size_class": c,
                           "count": k, "dtype": d, "retransmitted_all_ranks": rt}
                          for s, i, c, k, d, rt in slowest],
        "transport_totals": totals, "transport_by_rank": transport,
        "verdict": {"ok": not failures, "failures": failures},
    }


def run_soak(n: int = 2, calls: int = 1000, seed: int = 1, max_bytes: int = 4 << 20,
             loss: float = FAULT_DEFAULTS["loss"],
             duplicate: float = FAULT_DEFAULTS["duplicate"],
             reorder: float = FAULT_DEFAULTS["reorder"],
             jitter_ms: float = FAULT_DEFAULTS["jitter_ms"],
             jitter_period_ms: float = FAULT_DEFAULTS["jitter_period_ms"],
             ring_every: int = 1, min_ina_fraction: float = 0.95,
             settings: dict[str, Any] | None = None, timeout: float | None = None,
             progress: int = 0, echo: bool = False, fixed_count: int = 0,
             faults_override: dict[str, float] | None = None) -> dict[str, Any]:
    """Run the soak; the summary (``summary["verdict"]["ok"]``). SoakFailed if the job
    did not finish within ``timeout`` (killed), or left no results."""
    from ina_collectives.launch.ranks import find_mpiexec
    from ina_collectives.switch import send_faults
    from ina_collectives.switch.embedded import embedded_switch

    if timeout is None:
        timeout = 120.0 + 1.5 * calls * (1 + n / 4)
    faults = {**fault_settings(loss, duplicate, reorder), **(faults_override or {})}
    wall = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ina-soak-") as outdir, \
            embedded_switch("--stats-interval", "0") as switch:
        address = (switch.host, switch.port)
        send_faults(address, **faults)
        jitter = (Jitter(address, faults, jitter_ms, jitter_period_ms, seed)
                  if jitter_ms > 0 else None)
        if jitter:
            jitter.start()
        params = {"seed": seed, "calls": calls, "max_bytes": max_bytes,
                  "ring_every": ring_every, "switch": switch.address_text,
                  "settings": settings or {}, "progress": progress,
                  "fixed_count": fixed_count}
        # (streamed as it runs: the job's group killed past the bound, as run_group does)
        cmd = mpiexec_line(find_mpiexec(), [sys.executable, "-m", "bench.loopback.soak",
                                            "_rank", json.dumps(params), outdir], n=n)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if echo:
                    print(line, end="", flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        hung = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            reader.join(5)
            if jitter:
                jitter.stop.set()
                jitter.join(5)
        send_faults(address)  # cleared, so that the status line is the soak's alone
        switch_alive = switch.process.poll() is None
        switch.stop()
        switch_status = _parse_switch_status(switch.final_status)
        wall = time.monotonic() - wall
        output = "\n".join(lines[-60:])
        if hung:
            raise SoakFailed(f"the soak of {calls} calls on {n} ranks did not finish within "
                             f"{timeout:g} s (killed); its output:\n{output}")
        ranks = []
        for r in range(n):
            path = Path(outdir, f"rank{r}.json")
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:  # killed by mpiexec after another rank failed, or died
                ranks.append({"rank": r, "records": [], "error": {
                    "type": "NoResult", "call": "?", "message": f"left no results (mpiexec "
                    f"exit {proc.returncode})"}})
        if all(r["error"] and r["error"]["type"] == "NoResult" for r in ranks):
            raise SoakFailed(f"no rank left results (mpiexec exit {proc.returncode}); the "
                             f"output:\n{output}")
    summary = summarize(ranks, calls, min_ina_fraction)
    if proc.returncode != 0:
        summary["verdict"]["failures"].append(f"mpiexec exited {proc.returncode}")
    if not switch_alive:
        summary["verdict"]["failures"].append("the switch died during the soak")
    summary["verdict"]["ok"] = not summary["verdict"]["failures"]
    summary.update({
        "n": n, "seed": seed, "max_bytes": max_bytes, "wall_seconds": wall,
        "rank_seconds": max(r.get("seconds", 0.0) for r in ranks),
        "faults": {**faults, "delay_ms": f"0..{jitter_ms:g} per direction, redrawn every "
                                         f"{jitter_period_ms:g} ms" if jitter else 0},
        "jitter": ({"updates": jitter.updates, "errors": jitter.errors[:5],
                    "mean_delay_ms": float(np.mean(jitter.delays)) if jitter.delays else 0.0}
                   if jitter else None),
        "switch": switch_status, "settings": {**RANK_SETTINGS, **(settings or {})},
        "output_tail": lines[-20:],
    })
    return summary


def report(summary: dict[str, Any]) -> str:
    rows = [f"soak: n={summary['n']} calls={summary['calls']} completed="
            f"{summary['completed']} wall {summary['wall_seconds']:.1f} s (ranks "
            f"{summary['rank_seconds']:.1f} s)",
            f"faults: {summary['faults']}",
            f"engines: {summary['engines']}  fallbacks: {summary['fallbacks']['count']} "
            f"{[f['reasons_by_rank'] for f in summary['fallbacks']['calls']] or ''}",
            f"exact mismatches: {summary['exact']['mismatches']}  ring mismatches: "
            f"{summary['ring']['mismatches']} of {summary['ring']['checked_calls']} checked  "
            f"identical on all ranks: {summary['identical_on_all_ranks']}",
            "INA call time (slowest rank) per size class:",
            f"  {'class':18} {'calls':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
            f"{'max ms':>8} | ring p50 ms"]
    ring = summary["ring"]["seconds_by_class"]
    for name, p in [*summary["seconds_by_class"].items(),
                    ("all", summary["seconds_all_ina"])]:
        if not p.get("calls"):
            continue
        r = ring.get(name, {}).get("p50_ms")
        rows.append(f"  {name:18} {p['calls']:5d} {p['p50_ms']:8.2f} {p['p90_ms']:8.2f} "
                    f"{p['p99_ms']:8.2f} {p['max_ms']:8.2f} | "
                    + (f"{r:8.2f}" if r is not None else "       -"))
    rows.append(f"links (all ranks): {summary['transport_totals']}")
    sw = summary["switch"]
    rows.append(f"switch: {({k: v for k, v in sw.items() if k != 'line'})}")
    if summary.get("jitter"):
        rows.append(f"jitter: {summary['jitter']}")
    rows.append(f"slowest calls: {summary['slowest_calls']}")
    v = summary["verdict"]
    rows.append("verdict: " + ("PASS" if v["ok"] else "FAIL\n  " + "\n  ".join(v["failures"])))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        return rank_main(json.loads(argv[1]), argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-bytes", default="4M", help="largest call (default 4M)")
    parser.add_argument("--loss", type=float, default=FAULT_DEFAULTS["loss"],
                        help="drop probability per packet, each direction (default 0.05)")
    parser.add_argument("--duplicate", type=float, default=FAULT_DEFAULTS["duplicate"],
                        help="duplication probability per packet, each direction")
    parser.add_argument("--reorder", type=float, default=FAULT_DEFAULTS["reorder"],
                        help="probability per packet of being held back behind the next")
    parser.add_argument("--jitter-ms", type=float, default=FAULT_DEFAULTS["jitter_ms"],
                        help="delay drawn in 0..this per direction (0: no delay)")
    parser.add_argument("--jitter-period-ms", type=float,
                        default=FAULT_DEFAULTS["jitter_period_ms"],
                        help="a new delay this often")
    parser.add_argument("--fixed-count", type=int, default=0,
                        help="every call float32 SUM of this many elements, the same "
                             "magnitudes (a training loop's shape) instead of the mix")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME=VALUE",
                        help="one switch fault set apart, e.g. reorder_in=0.3 (repeatable; "
                             "names of ina_collectives.switch.send_faults)")
    parser.add_argument("--ring-every", type=int, default=1,
                        help="compare with the ring every so many calls (0: never)")
    parser.add_argument("--min-ina-fraction", type=float, default=0.95,
                        help="fail unless at least this share of calls took the switch")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a library setting for the ranks (repeatable), e.g. timeout=30")
    parser.add_argument("--timeout", type=float, default=None,
                        help="bound of the whole job in seconds (default from --calls)")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    from ina_collectives.settings import parse_size

    settings = {}
    for item in args.setting:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--setting {item!r}: expected NAME=VALUE")
        settings[name] = value
    override = {}
    for item in args.fault:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--fault {item!r}: expected NAME=VALUE")
        override[name] = float(value)
    try:
        summary = run_soak(args.n, args.calls, args.seed, parse_size(args.max_bytes),
                           args.loss, args.duplicate, args.reorder, args.jitter_ms,
                           args.jitter_period_ms, args.ring_every, args.min_ina_fraction,
                           settings, args.timeout, progress=100, echo=True,
                           fixed_count=args.fixed_count, faults_override=override)
    except SoakFailed as exc:
        print(f"soak FAILED: {exc}", file=sys.stderr)
        return 2
    text = report(summary)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    summary["report"] = text.splitlines()
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"saved {args.json}")
    return 0 if summary["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
