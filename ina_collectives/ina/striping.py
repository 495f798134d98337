"""How a call is split across several aggregators: contiguous shares of its chunks in
proportion to each one's measured throughput (``Shares``), and the shares streamed at
once, one thread each (``Streams``; docs/striping.md).

Every rank holds the same estimates (they are updated from the times every rank learns
in the call's outcome), so every rank splits alike.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CollectiveTimeout
from ..settings import Settings
from .link import Queued, Timers, WorkerLink
from .plan import CallPlan
from .preparing import Share

if TYPE_CHECKING:
    from .._fast.transport import Result

log = logging.getLogger("ina_collectives")


class Shares:
    """Each aggregator's measured elements/s, smoothed (0: not measured yet), and the
    split they give. ``prior``: each one's rate as the topology says it (docs/trees.md,
    a root's ``mbit``), which splits a call among those not measured yet: alone while
    none is, else scaled to the measured ones' units by theirs."""

    # Of a call's chunks, the share each serving aggregator gets at least, over the
    # number of them: a slow one keeps being measured, and so can win its share back.
    MIN_SHARE = 0.25
    # Weight of the newest throughput measurement in each aggregator's estimate.
    SMOOTHING = 0.5

    def __init__(self, aggregators: int, prior: tuple[float, ...] | None = None):
        self.capacity = np.zeros(aggregators)
        if prior is not None and len(prior) != aggregators:
            raise ValueError(f"{len(prior)} prior rates for {aggregators} aggregators")
        self.prior = None if prior is None else np.asarray(prior, np.float64)

    def split(self, serving: list[int], chunks: int) -> np.ndarray:
        """Chunk boundaries of the serving aggregators' shares of ``chunks`` chunks (one
        more than there are serving ones): contiguous, in proportion to each one's
        measured throughput, at least MIN_SHARE of an equal share each."""
        if len(serving) == 1:
            return np.array([0, chunks], np.int64)
        measured = self.capacity[serving]
        known = measured[measured > 0]
        if self.prior is not None:
            prior = self.prior[serving]
            unmeasured = prior * (known.sum() / prior[measured > 0].sum() if known.size
                                  else 1.0)
        else:
            unmeasured = known.mean() if known.size else 1.0
        weights = np.where(measured > 0, measured, unmeasured)
        weights = weights / weights.sum()
        weights = np.maximum(weights, self.MIN_SHARE / len(serving))
        edges = np.concatenate([[0.0], np.cumsum(weights / weights.sum())])
        return np.round(edges * chunks).astype(np.int64)

    def measured(self, i: int, elements: int, seconds: float) -> None:
        """Aggregator i reduced ``elements`` in ``seconds`` (the slowest rank's time)."""
        rate = elements / seconds
        old = self.capacity[i]
        self.capacity[i] = rate if old <= 0 else (
            self.SMOOTHING * rate + (1 - self.SMOOTHING) * old)

    def forget(self, i: int) -> None:
        """Aggregator i left: measured anew when it serves again."""
        self.capacity[i] = 0.0


class Streams:
    """A call's shares streamed through their aggregators: the first in the calling
    thread, the others in threads of their own (the streams run without the GIL). Ctrl-C
    or an error in one cancels the others before it propagates."""

    # Seconds a cancelled stream may take to end (it looks every 20 ms).
    CANCEL_BOUND = 5.0

    def __init__(self, aggregators: int, settings: Settings,
                 where: Callable[[int], str]):
        self.aggregators, self.settings, self.where = aggregators, settings, where
        self.timers = Timers.of(settings)  # (built once: every stream's waits)
        self._threads: ThreadPoolExecutor | None = None

    def run(self, links: list[WorkerLink | None], plan: CallPlan,
            then: Queued | None = None, pause: bool = False) -> list[Result | None]:
        """Stream each of the call's shares (``plan``, ina.plan.CallPlan) through its
        aggregator's link, by its deadline; for a call of one share, ``then``: the next
        call, queued behind it, or ``pause``: its stream returns None at its drain
        (WorkerLink.stream)."""
        s = self.settings
        remaining = max(0.0, plan.deadline.expires - time.monotonic())
        cancel = np.zeros(1, np.uint8)
        shares = plan.prepared.shares

        def stream(share: Share) -> Result:
            return links[share.aggregator].stream(
                plan.stream(share), self.timers, remaining, cancel,
                *((then, pause) if len(shares) == 1 else (None, False)))

        if not shares:  # an empty call
            return []
        if len(shares) > 1 and self._threads is None:
            self._threads = ThreadPoolExecutor(self.aggregators - 1,
                                               thread_name_prefix="ina-stripe")
        others = [self._threads.submit(stream, share) for share in shares[1:]]
        # Each stream ends by its own bounds (the call's deadline, the silence bound);
        # these bounds only back them up.
        bound = remaining + s.switch_silence + self.CANCEL_BOUND
        try:
            results = [stream(shares[0])]
            for share, future in zip(shares[1:], others):
                try:
                    results.append(future.result(timeout=bound))
                except futures.TimeoutError:
                    raise CollectiveTimeout(
                        f"waited {bound:g} s for the stream of a share through the "
                        f"aggregator at {self.where(share.aggregator)}") from None
        except BaseException:
            cancel[0] = 1
            _, late = futures.wait(others, timeout=self.CANCEL_BOUND)
            if late:
                log.error("%d stream(s) of a striped call did not end within %g s of "
                          "being cancelled", len(late), self.CANCEL_BOUND)
            raise
        return results

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
