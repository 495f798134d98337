"""Counters of what the collectives did: calls, bytes, which engine served, and why; and
``summarize``, the paragraph ina_collectives.summary() prints."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

log = logging.getLogger("ina_collectives")


class Stats:
    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.by_engine: Counter[str] = Counter()
        self.bytes_by_engine: Counter[str] = Counter()
        self.fallback_reasons: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None
        # The quantization and packet kernels the switch engine runs: "fast" (compiled)
        # or "numpy" (the reference); None without a switch engine. Set by whoever gave
        # the chooser its switch engine (the APIs: they know it is ina's).
        self.kernels: str | None = None
        # The engines' own reports (Engine.report): a switch engine's link counters
        # ("transport") and its aggregators' state ("switch").
        self.reports: list[Callable[[], dict[str, Any]]] = []

    def record(self, engine: str, nbytes: int, passed_over: list[str]) -> None:
        """One call served by ``engine``; ``passed_over`` says why better engines declined."""
        self.calls += 1
        self.bytes += nbytes
        self.by_engine[engine] += 1
        self.bytes_by_engine[engine] += nbytes
        for reason in passed_over:
            if reason not in self.fallback_reasons:
                log.info("allreduce served by %s: %s (logged once per reason)", engine, reason)
            self.fallback_reasons[reason] += 1
        self.last = {"engine": engine, "bytes": nbytes, "passed_over": list(passed_over)}

    def snapshot(self) -> dict[str, Any]:
        reported: dict[str, Any] = {}
        for report in self.reports:
            reported.update(report())
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "engines": dict(self.by_engine),
            "bytes_by_engine": dict(self.bytes_by_engine),
            "fallback_reasons": dict(self.fallback_reasons),
            "last_call": dict(self.last) if self.last else None,
            "kernels": self.kernels,
            "transport": {},
            "switch": {"configured": False, "serving": False,
                       "reason": "no switch configured (INA_SWITCH is unset): every call "
                                 "takes the ring or MPI"},
            **reported,
        }


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # (not reached)


# The engine whose reasons say why the switch did not serve a call. The exact engines'
# own reasons (the ring's ring_min_bytes, MPI's dtypes) say why *they* passed a call on
# to the next exact engine: not a reason against the switch, so not in the summary.
SWITCH = "ina"

# What the kernels setting's values are, in the summary's words.
KERNELS = {"fast": "compiled", "numpy": "the NumPy reference (the switch does not serve "
                                        "with it)"}


def summarize(snapshot: dict[str, Any]) -> str:
    """One paragraph a user can print at the end of training, from a stats() snapshot:
    what the switch served (calls and share of the bytes), what took which other engine
    (ring, mpi, or gloo: the peers' own allreduce without an MPI job), why the switch did
    not serve (its most frequent reasons), the switch's state, the packets this rank
    sent, and the kernels that ran."""
    calls, total = snapshot.get("calls", 0), snapshot.get("bytes", 0)
    if not calls:
        return "No allreduce yet."
    engines = snapshot.get("engines", {})
    by_bytes = snapshot.get("bytes_by_engine", {})
    served, served_bytes = engines.get(SWITCH, 0), by_bytes.get(SWITCH, 0)
    share = 100.0 * served_bytes / total if total else 0.0
    parts = [f"ina served {served} of {calls} calls ({share:.0f}% of "
             f"{_size(total)})"]
    others = [f"{n} took {name}" for name, n in sorted(engines.items(),
                                                         key=lambda kv: -kv[1])
              if name != SWITCH]
    if others:
        parts.append(", ".join(others))
    text = "; ".join(parts) + "."
    prefix = f"{SWITCH}: "
    reasons = sorted(((why[len(prefix):], n)
                      for why, n in snapshot.get("fallback_reasons", {}).items()
                      if why.startswith(prefix)), key=lambda kv: -kv[1])
    if reasons:
        shown = "; ".join(f"{why} ({n})" for why, n in reasons[:3])
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        text += f" Why not the switch: {shown}{more}."
    switch = snapshot.get("switch") or {}
    if switch.get("configured") is False:
        text += " No switch configured (INA_SWITCH is unset)."
    elif switch:
        state = "serving" if switch.get("serving") else "not serving"
        text += (f" Switch: {state}, {switch.get('outages', 0)} outage(s), "
                 f"{switch.get('returns', 0)} return(s).")
    transport = snapshot.get("transport") or {}
    if transport.get("sent"):
        sent, again = int(transport["sent"]), int(transport.get("retransmitted", 0))
        text += (f" This rank sent {sent} packets, {again} of them again after a timeout "
                 f"({100.0 * again / sent:.1f}%).")
    kernels = snapshot.get("kernels")
    if kernels:
        text += f" Kernels: {KERNELS.get(kernels, kernels)}."
    return text
