"""Counters of what the collectives did: calls, bytes, which engine served, and why; the
engines' own reports beside them; and ``paragraph``, the engine-neutral part of the one
paragraph a user prints at the end of training (the offload's layer writes the rest:
ina/summary.py)."""
from __future__ import annotations

import copy
import logging
from collections import Counter
from typing import Any, Callable

log = logging.getLogger("ina_collectives")


class Stats:
    def __init__(self, absent: dict[str, Any] | None = None) -> None:
        self.calls = 0
        self.bytes = 0
        self.by_engine: Counter[str] = Counter()
        self.bytes_by_engine: Counter[str] = Counter()
        self.fallback_reasons: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None
        # The engines' own reports (Engine.report), merged into the snapshot; and
        # ``absent``, what stats() shows of an offload the chooser was not given (the
        # keys its report would have, from the layer that knows it), under them.
        self.reports: list[Callable[[], dict[str, Any]]] = []
        self.absent: dict[str, Any] = absent or {}

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
        reported: dict[str, Any] = copy.deepcopy(self.absent)
        for report in self.reports:
            reported.update(report())
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "engines": dict(self.by_engine),
            "bytes_by_engine": dict(self.bytes_by_engine),
            "fallback_reasons": dict(self.fallback_reasons),
            "last_call": dict(self.last) if self.last else None,
            **reported,
        }


def size_text(nbytes: float) -> str:
    """A byte count in words: 80 B, 1.5 KiB, 100.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # (not reached)


def paragraph(snapshot: dict[str, Any], first: str,
              about: Callable[[dict[str, Any], list[tuple[str, int]]], str]) -> str:
    """One paragraph from a stats() snapshot: what the engine named ``first`` (the
    offload) served (calls and share of the bytes), what took which other engine (ring,
    mpi, or gloo: the peers' own allreduce without an MPI job), then ``about(snapshot,
    reasons)``: the sentences that engine's layer writes of itself, given its reasons for
    not serving (the reasons it recorded, its name's prefix off, most frequent first).
    The exact engines' own reasons (the ring's ring_min_bytes, MPI's dtypes) say why
    *they* passed a call on to the next exact engine: not reasons against ``first``, so
    not given."""
    calls, total = snapshot.get("calls", 0), snapshot.get("bytes", 0)
    if not calls:
        return "No allreduce yet."
    engines = snapshot.get("engines", {})
    by_bytes = snapshot.get("bytes_by_engine", {})
    served, served_bytes = engines.get(first, 0), by_bytes.get(first, 0)
    share = 100.0 * served_bytes / total if total else 0.0
    parts = [f"{first} served {served} of {calls} calls ({share:.0f}% of "
             f"{size_text(total)})"]
    others = [f"{n} took {name}" for name, n in sorted(engines.items(),
                                                         key=lambda kv: -kv[1])
              if name != first]
    if others:
        parts.append(", ".join(others))
    prefix = f"{first}: "
    reasons = sorted(((why[len(prefix):], n)
                      for why, n in snapshot.get("fallback_reasons", {}).items()
                      if why.startswith(prefix)), key=lambda kv: -kv[1])
    return "; ".join(parts) + "." + about(snapshot, reasons)
