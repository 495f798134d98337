"""How a call is split across several aggregators: contiguous shares of its chunks in
proportion to each one's measured throughput (docs/striping.md).

Every rank holds the same estimates (they are updated from the times every rank learns
in the call's outcome), so every rank splits alike.
"""
from __future__ import annotations

import numpy as np


class Shares:
    """Each aggregator's measured elements/s, smoothed (0: not measured yet), and the
    split they give."""

    # Of a call's chunks, the share each serving aggregator gets at least, over the
    # number of them: a slow one keeps being measured, and so can win its share back.
    MIN_SHARE = 0.25
    # Weight of the newest throughput measurement in each aggregator's estimate.
    SMOOTHING = 0.5

    def __init__(self, aggregators: int):
        self.capacity = np.zeros(aggregators)

    def split(self, serving: list[int], chunks: int) -> np.ndarray:
        """Chunk boundaries of the serving aggregators' shares of ``chunks`` chunks (one
        more than there are serving ones): contiguous, in proportion to each one's
        measured throughput, at least MIN_SHARE of an equal share each."""
        if len(serving) == 1:
            return np.array([0, chunks], np.int64)
        measured = self.capacity[serving]
        known = measured[measured > 0]
        weights = np.where(measured > 0, measured, known.mean() if known.size else 1.0)
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
