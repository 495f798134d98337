"""Quorum mode (docs/quorum.md): the k a switch-served call's chunks complete at, and what
the ranks learn from each call.

Every rank holds the same state and changes it at the same call boundary, from values
every rank has alike: the k asked with ``set`` (a collective call), the mode the
aggregators announce in their results (the newest is agreed in each call's outcome vote),
and the workers each call's results counted (every rank receives the same results).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import protocol as P
from ..collectives.ops import check_quorum

log = logging.getLogger("ina_collectives")

# A training step, as the staleness bound counts it, ends where a call repeats one the
# rank was left out of since its step began (every step repeats its tensors' calls), or
# after this many calls with none repeated (a job whose calls never repeat still counts).
STEP_CALLS = 64


class Quorum:
    """One job's quorum mode, on one rank: ``k`` (0: sync), the staleness bound (in
    training steps, Serene's window: ``max_steps``), and the counts ``report`` gives."""

    def __init__(self, n: int, rank: int, k: int, max_steps: int):
        self.n, self.rank = n, rank
        self.k = check_quorum(k)
        self.max_steps = max_steps
        self.generation = 0  # the control plane's mode last adopted (0: none yet)
        # Whether every aggregator completes chunks at a quorum (CAP_QUORUM): where one
        # does not, every call is stamped sync and quorum acts in the runtime alone.
        self.cells = True
        # The staleness bound's count: the training steps in a row each rank was left out
        # of some chunk of every call, and the calls of its current such step.
        self.steps = np.zeros(n, np.int64)
        self._step_calls: list[set] = [set() for _ in range(n)]
        self._key: object = None
        self._present = 0  # the call under way's ranks counted (0: all; AllreduceCall)
        self.calls = 0  # switch-served calls started: the call number (mod 65536)
        self._stamp = 0  # the quorum stamped in the packets of the call under way
        self.quorum_calls = self.waited_calls = self.changes = 0
        self.calls_left_out = 0  # quorum calls that left this rank out of some chunk
        self.repaired = 0  # chunks a rank lost that another sent it (repair.py)
        self.last: dict[str, Any] = {}

    def set(self, k: int) -> None:
        """Quorum k (0: sync) from the next call on; the caller made sure every rank
        asks the same k at the same point."""
        self.k = check_quorum(k)

    def active(self) -> bool:
        """Whether calls now complete with fewer than every rank."""
        return 0 < self.k < self.n

    def next_call(self, key: object = None, present: int = 0) -> tuple[int, int]:
        """(call number, quorum stamp) of the switch-served call about to start; ``key``:
        what the call repeats from step to step (its length, dtype, op and width). The
        stamp is 0 (sync) when k is 0 or covers all n, and for one call when a worker
        has been left out of every call of ``max_steps`` training steps (the staleness
        bound: a step ends where a call repeats, see STEP_CALLS). ``present``: the ranks
        that contribute (0: all): where some do not (the runtime ran ahead of them,
        docs/quorum.md), the stamp is at most their number in quorum mode, and the bound
        waits for those present (the runtime bounds the absent ones' absence itself); in
        sync, or with all n named (the runtime waited for a rank at its bound), the stamp
        is 0: every rank adds its values, an absent one zeros."""
        self.calls += 1
        self._key = key
        self._present = present
        stamp = self.k if 0 < self.k < self.n and self.cells else 0
        waiting = (self.max_steps and (stamp or present)
                   and bool((self.steps >= self.max_steps).any()))
        if present and (present.bit_count() >= self.n or not stamp):
            stamp = 0  # every rank named, or sync: every rank adds (an absent one zeros)
        elif present:
            stamp = present.bit_count() if waiting else min(stamp or self.n,
                                                             present.bit_count())
        elif waiting:
            stamp = 0
        self.waited_calls += bool(waiting)
        self._stamp = stamp
        return self.calls & 0xFFFF, stamp

    def call_not_made(self) -> None:
        """The call ``next_call`` numbered did not happen (the switch said the ranks called
        differently): its number is the next call's, as on a rank whose opening of it
        failed alike (an opening numbers its call without taking the number)."""
        self.calls -= 1

    def after_call(self, counted_all: int, counted_any: int, announced: int, left_out: int,
                   skipped: int) -> None:
        """A call's outcome. counted_all, counted_any: the workers every result of the
        call counted, and those some result counted (bitmaps over the shares that
        completed; the same on every rank); announced: the
        newest mode the aggregators announced (generation << 8 | k, the vote's max);
        left_out, skipped: this rank's chunks not counted, and those it sent no values for
        (they did not fit the exponents agreed without it)."""
        stamp = self._stamp
        if stamp:
            out = [r for r in range(self.n) if not (counted_all >> r) & 1]
            never = [r for r in out if not (counted_any >> r) & 1]
            for r in range(self.n):
                if not self._present or (self._present >> r) & 1:  # (absent: the runtime's)
                    self._count_step(r, r in out)
            self.quorum_calls += 1
            self.calls_left_out += self.rank in out
        else:  # a sync call counts every rank
            out, never = [], []
            if self.steps.any() or any(self._step_calls):
                self.steps.fill(0)
                for calls in self._step_calls:
                    calls.clear()
        self.last = {"quorum": stamp, "counted": self.rank not in out,
                     "ranks_left_out": out, "ranks_never_counted": never,
                     "chunks_left_out": left_out,
                     "chunks_skipped": skipped}
        generation, k = announced >> 8, announced & 0xFF
        if generation and generation != self.generation:
            self.generation = generation
            self.changes += 1
            k = min(k, P.MAX_WORKERS)  # (the mode in force, as the warning names it)
            if k != self.k:
                log.warning("the control plane asks for %s (mode generation %d): in force "
                            "from the next call", f"quorum {k}" if k else "sync", generation)
            self.k = k

    def _count_step(self, r: int, left_out: bool) -> None:
        """Rank r's staleness count after a quorum call that left it out or counted it."""
        calls = self._step_calls[r]
        if not left_out:
            self.steps[r] = 0
            calls.clear()
            return
        if self._key in calls or len(calls) >= STEP_CALLS:  # a new step begins
            self.steps[r] += 1
            calls.clear()
        calls.add(self._key)

    def report(self) -> dict[str, Any]:
        """stats()["quorum"]: the mode in force, the counts, and the last call's flags
        (``last_call["counted"]`` is False when this rank's values were left out of some
        chunk of it)."""
        return {"mode": f"quorum {self.k}" if 0 < self.k < self.n else "sync", "k": self.k,
                "generation": self.generation, "mode_changes": self.changes,
                "max_steps": self.max_steps, "quorum_calls": self.quorum_calls,
                "waited_calls": self.waited_calls, "calls_left_out": self.calls_left_out,
                "chunks_repaired": self.repaired,
                "last_call": dict(self.last)}
