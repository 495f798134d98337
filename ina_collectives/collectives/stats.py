"""Counters of what the collectives did: calls, bytes, which engine served, and why."""
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
        self.transport: dict[str, float] = {}  # the INA link's counters (ina/link.py)
        # The aggregator's periods: serving now, failures mid-call, returns after them.
        self.switch_state: Callable[[], dict[str, Any]] | None = None

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
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "engines": dict(self.by_engine),
            "bytes_by_engine": dict(self.bytes_by_engine),
            "fallback_reasons": dict(self.fallback_reasons),
            "last_call": dict(self.last) if self.last else None,
            "transport": dict(self.transport),
            "switch": (self.switch_state() if self.switch_state else
                       {"configured": False, "serving": False,
                        "reason": "no switch configured (INA_SWITCH is unset): every call "
                                  "takes the ring or MPI"}),
        }
