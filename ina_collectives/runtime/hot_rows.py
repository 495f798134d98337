"""Hot rows (Libra) of a sparse tensor of one sparse dimension that is reduced again and
again under one name (a DistributedOptimizer's embedding gradient): which of its rows are
summed as a dense allreduce (through the switch where it serves) and which are gathered
exactly, decided alike on every rank with no message of its own.

Framework-neutral (NumPy): a binding's sparse allreduce (``torch/sparse.py``) keeps one
``HotRows`` per tensor name, asks it for the hot set as each call starts
(``HotRows.start_call``) and gives it, as the call ends, what the call's layout gather
brought from every rank: the rows they touched and the slowest rank's time of its previous
call (``HotRows.end_call``). Every rank gives the same, so every rank elects the same rows.

The election is by periods of calls: the first period is exact (it times the gather); at
each period's end the rows touched most over the ranks are elected where they pay by bytes
(``elect``) and tried for a period; a trial whose calls were measured slower than the
exact gather's is set aside for 1, 2, 4 ... 32 periods (``HotRows.choose``); the touches
weigh half at each period's end, so that a skew that moves moves the hot set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


def no_rows() -> np.ndarray:
    """An empty set of rows (int64)."""
    return np.zeros(0, np.int64)


@dataclass
class HotRows:
    """What the ranks know alike of one sparse tensor (by name): how often each row was
    touched over every rank, the hot rows in use, the calls' times, and the traffic.

    Every field but ``elapsed`` and the byte counts is the same on every rank: each is
    made from what the layout gather brought (every rank's touches and last time)."""

    counts: np.ndarray                   # touches per row, summed over the ranks
    hot: np.ndarray = field(default_factory=no_rows)  # the hot rows in use, ascending
    calls: int = 0
    counted_calls: float = 0.0           # the calls ``counts`` stand for (they decay)
    rows_touched: int = 0                # over the calls: distinct rows with entries
    hot_rows_touched: int = 0            # of those, hot ones
    bytes_through_allreduce: int = 0     # this rank's hot blocks (the switch's, if it serves)
    bytes_gathered: int = 0              # this rank's share of the exact gather
    elapsed: float = 0.0                 # this rank's last call: exchange and finish (s)
    last_hot: bool = False               # whether the last call had hot rows
    exact_times: list[float] = field(default_factory=list)  # the slowest rank's, recent
    hot_times: list[float] = field(default_factory=list)    # the same, the last trial's
    new_trial: bool = False              # a trial began and has no times yet
    wait: int = 0                        # more periods to stay exact before a new trial
    backoff: int = 1                     # the next wait after a trial that did not pay
    declined: int = 0                    # trials measured slower than the exact gather

    @classmethod
    def of_rows(cls, rows: int) -> "HotRows":
        """A tensor of ``rows`` rows, nothing counted yet."""
        return cls(np.zeros(rows, np.int64))

    def start_call(self, most: int, n: int, row_bytes: int, period: int
                   ) -> tuple[np.ndarray, bool]:
        """A call starts (on every rank alike, whatever this rank's input): at the end of
        a period of ``period`` calls, the hot set for the next (``end_period``: at most
        ``most`` rows of ``row_bytes`` over ``n`` ranks). The hot rows this call sums
        densely, and whether the previous call had hot rows (the time this call's layout
        gather brings, its slowest rank's, is that call's: ``end_call``)."""
        if self.calls and self.calls % period == 0:
            self.end_period(most, n, row_bytes)
        self.calls += 1
        previous_hot, self.last_hot = self.last_hot, bool(self.hot.size)
        return self.hot, previous_hot

    def end_call(self, rows: int, cold: np.ndarray, hot: np.ndarray,
                 hot_touches: np.ndarray | None, slowest: float, timed_hot: bool,
                 period: int) -> None:
        """A call ends, with what its layout gather brought from every rank: the tensor
        has ``rows`` rows; the rows gathered exactly (``cold``, a row once per rank that
        sent it); of the call's ``hot`` rows, how many ranks touched each
        (``hot_touches``; None without hot rows); the slowest rank's time of its previous
        call, which had hot rows or not (``timed_hot``, from ``start_call``)."""
        self.resize(rows)
        self.count(cold)
        touched = cold
        if hot.size:
            self.counts[hot] += hot_touches
            self.hot_rows_touched += int((hot_touches > 0).sum())
            touched = np.concatenate([cold, hot[hot_touches > 0]])
        self.rows_touched += int(np.unique(touched).size)
        if self.calls > 2:  # (the first call's time is the connections' set-up)
            self.record(slowest, timed_hot, max(period, 3))

    def record(self, slowest: float, hot: bool, keep: int) -> None:
        """The slowest rank's time of the previous call (the layout gather brings it),
        which had hot rows or not."""
        times = self.hot_times if hot else self.exact_times
        if hot and self.new_trial:  # the last trial's times are kept until now (stats)
            times.clear()
            self.new_trial = False
        times.append(slowest)
        del times[:-keep]

    def choose(self, elect_now: Callable[[], np.ndarray]) -> None:
        """At the end of a period: the hot set for the next one. A trial whose calls were
        slower (median of the slowest rank's times) than the exact gather's recent calls
        is set aside for 1, 2, 4 ... 32 periods; one that paid is elected again from the
        counts; after a wait the rows are elected (by bytes: ``elect``) and tried."""
        if self.hot.size:
            if self.exact_times and self.hot_times and not self.new_trial and (
                    np.median(self.hot_times) > np.median(self.exact_times)):
                self.hot = no_rows()
                self.declined += 1
                self.wait, self.backoff = self.backoff - 1, min(2 * self.backoff, 32)
                return
            self.backoff = 1
        elif self.wait > 0:
            self.wait -= 1
            return
        trial = elect_now()
        self.new_trial = self.new_trial or bool(trial.size and not self.hot.size)
        self.hot = trial

    def resize(self, rows: int) -> None:
        """The tensor has ``rows`` rows now (on every rank): counts and hot rows follow."""
        if rows != self.counts.size:
            counts = np.zeros(rows, np.int64)
            kept = min(rows, self.counts.size)
            counts[:kept] = self.counts[:kept]
            self.counts = counts
            self.hot = self.hot[self.hot < rows]

    def count(self, rows: np.ndarray) -> None:
        """One call's touches over every rank (a row once per rank that touched it)."""
        np.add.at(self.counts, rows, 1)
        self.counted_calls += 1

    def end_period(self, most: int, n: int, row_bytes: int) -> None:
        """The hot set for the next period (``choose``, electing by bytes); then the
        touches so far weigh half, so that a skew that moves moves the hot set within a
        few periods."""
        self.choose(lambda: elect(self.counts, self.counted_calls, most, n, row_bytes))
        self.counts >>= 1
        self.counted_calls /= 2

    def report(self) -> dict[str, Any]:
        touched = max(self.rows_touched, 1)
        return {"calls": self.calls, "hot_rows": int(self.hot.size),
                "hot_share_of_touched_rows": round(self.hot_rows_touched / touched, 4),
                "bytes_through_allreduce": self.bytes_through_allreduce,
                "bytes_gathered": self.bytes_gathered,
                "trials_declined": self.declined,
                "median_ms": {"exact": _median_ms(self.exact_times),
                              "hot": _median_ms(self.hot_times)}}


def _median_ms(times: list[float]) -> float | None:
    return round(float(np.median(times)) * 1e3, 3) if times else None


def elect(counts: np.ndarray, calls: float, most: int, n: int, row_bytes: int
          ) -> np.ndarray:
    """The hot rows: the ``most`` rows touched most over the ranks in ``calls`` calls
    (``counts``), ascending; none where they would not pay. By bytes: each hot row's
    entries would otherwise reach every other rank by the gather ((n - 1) x its entries
    per rank x (8 + row_bytes) received per rank), and summed densely they cost one row
    each way through the switch; the set pays when what it saves exceeds what it costs.
    The same counts on every rank give the same rows on every rank."""
    if calls == 0:
        return no_rows()
    ranked = np.argsort(-counts, kind="stable")[:most]
    hot = np.sort(ranked[counts[ranked] > 0])
    entries_per_rank = counts[hot].sum() / calls / n
    saved = (n - 1) * entries_per_rank * (8 + row_bytes)
    return hot if saved > hot.size * row_bytes else no_rows()


def locate(hot: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``rows`` sits in the ascending ``hot`` set, and whether it is there
    (a hot row) or not (a row for the exact gather)."""
    at = np.minimum(np.searchsorted(hot, rows), max(hot.size - 1, 0))
    is_hot = (hot[at] == rows) if hot.size else np.zeros(rows.size, bool)
    return at, is_hot
