"""Predicted first windows (docs/protocol.md, One round trip): what a call that repeats
an earlier one sends its first window with, instead of opening it through the switch.

Every rank sees the same results, and updates and clears its table at the same calls, so
every rank predicts the same exponents for the same call: the switch sums only packets
whose exponents agree, and marks the others OVERFLOW (then the chunk is sent again).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from .. import protocol as P
from .reference import blockfp as ref_blockfp

# The identities a rank keeps predictions for (the least recently used leave first).
PREDICTIONS = 256
# The most bits a prediction adds to the exponents it learned (settings:
# switch_predict_headroom): an identity starts at 0 (exact), each call of it that
# overflowed adds one, each CLEAN_CALLS calls in a row without one take one back.
PREDICT_HEADROOM = 2
CLEAN_CALLS = 16
# Calls of one identity in a row are told apart by their place in the run, up to this
# many (a step's same-shaped layers: each predicted from its own last call).
RUN_PLACES = 64


@dataclass
class _Entry:
    needs: np.ndarray      # the max of every worker's own exponents (PROPOSAL_NONE: unknown)
    used: np.ndarray | None  # the exponents the last call was summed with
    headroom: int = 0
    clean: int = 0         # calls in a row without an overflow
    predicted: np.ndarray | None = None  # what the next call goes with (made at learn)


class Predictions:
    """Per call identity (and the link's shape: K, S, epoch), what the first window of
    its next call goes with, per sub-block: the max over every worker of the last
    call's own exponents there, plus the identity's headroom; where that max is not
    known (a slot's last chunk shorter than its first proposes fewer), the exponent the
    last call was summed with.

    A call's place (``place``, alike on every rank) is part of its key: the caller's key
    for the call where it has one (the Horovod runtime's tensor names), else its place
    in its run (how many calls of the same identity came just before it). A model's
    same-shaped layers make calls of one identity in a row, whose gradients differ in
    scale: each is predicted from its own call of the last step. A place not learned yet
    is predicted from the identity's latest call (a loop over one tensor: every call
    from the last)."""

    def __init__(self, size: int = PREDICTIONS, headroom: int = PREDICT_HEADROOM):
        self.size, self.most = size, headroom
        self._table: OrderedDict[tuple[int, Hashable, int | None], _Entry] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._table)

    def apart(self, ident: int, shape: Hashable, place: Hashable, other: Hashable) -> bool:
        """Whether ``place`` has an entry of its own, not ``other``'s: a call there is
        predicted from nothing that a call of the identity at ``other`` learns."""
        key = _place(place)
        return key != _place(other) and (ident, shape, key) in self._table

    def headroom(self, ident: int, shape: Hashable, place: Hashable = 0) -> int | None:
        entry = self._table.get((ident, shape, _place(place)))
        return None if entry is None else entry.headroom

    def predict(self, ident: int, shape: Hashable, span: int, dtype: np.dtype,
                place: Hashable = 0, touch: bool = True) -> np.ndarray | None:
        """The first window's predicted exponents (``span`` int16 values, the layout of
        ``Prepared.local``'s window), or None where nothing was learned for this call:
        its place's entry, else the identity's latest. ``touch`` False: a look that
        leaves the table as it was (its order, which says what leaves first, and its
        hits), for a call started before a rank that did not start it yet would look."""
        key = (ident, shape, _place(place))
        entry = self._table.get(key)
        if entry is None:
            key = (ident, shape, None)
            entry = self._table.get(key)
        if entry is None or entry.needs.size < span:
            return None
        if touch:
            self._table.move_to_end(key)
            self.hits += 1
        if entry.predicted is None:  # (made once: calls of one identity share a dtype)
            needs = entry.needs
            predicted = needs + np.int16(entry.headroom)  # (needs <= 1024: no overflow)
            if entry.used is not None:
                unknown = needs == P.PROPOSAL_NONE
                predicted[unknown] = entry.used[unknown]
            # (at most the dtype's largest exponent, transport's ceiling; never below its
            # floor: what a worker proposes never is)
            ceiling = 2 - ref_blockfp.EXPONENT_MIN[np.dtype(dtype)]
            entry.predicted = np.minimum(predicted, ceiling, out=predicted)
        return entry.predicted[:span]

    def learn(self, ident: int, shape: Hashable, needs: np.ndarray,
              used: np.ndarray | None = None, overflowed: bool = False,
              place: Hashable = 0) -> None:
        """What a call with this identity taught of its first window: ``needs``, the max
        of every worker's own exponents (PROPOSAL_NONE where not known), ``used``, the
        exponents it was summed with; ``overflowed``: some chunk of it was sent again (a
        prediction too small). Nothing is kept of a window that held a NaN or an Inf,
        nor where neither says an exponent. Kept for the call's place in its run and as
        the identity's latest."""
        for key in ((ident, shape, _place(place)), (ident, shape, None)):
            self._learn(key, needs, used, overflowed)

    def _learn(self, key: tuple, needs: np.ndarray, used: np.ndarray | None,
               overflowed: bool) -> None:
        old = self._table.get(key)
        if (old is not None and not overflowed and _same(old.needs, needs)
                and (_same(old.used, used) if used is not None else old.used is None)):
            # The window the last call taught again (every step of a steady job): the
            # entry stands, its prediction made once, unless the headroom shrinks.
            self._table.move_to_end(key)
            old.clean += 1
            if old.clean >= CLEAN_CALLS and old.headroom:
                old.headroom, old.clean, old.predicted = old.headroom - 1, 0, None
            return
        if old is not None:
            del self._table[key]
        known = needs != P.PROPOSAL_NONE
        if (needs == P.NONFINITE_MARK).any() or not (known.all() or used is not None):
            return
        entry = _Entry(needs.copy(), None if used is None else used.copy())
        if old is not None:
            entry.headroom, entry.clean = old.headroom, old.clean + 1
        if overflowed:
            entry.headroom, entry.clean = min(entry.headroom + 1, self.most), 0
        elif entry.clean >= CLEAN_CALLS and entry.headroom:
            entry.headroom, entry.clean = entry.headroom - 1, 0
        self._table[key] = entry
        while len(self._table) > self.size:
            self._table.popitem(last=False)

    def forget(self, ident: int, shape: Hashable) -> None:
        """Every entry of this identity."""
        for key in [key for key in self._table if key[:2] == (ident, shape)]:
            del self._table[key]

    def clear(self) -> None:
        """Every rank forgets alike: a new epoch, an aggregator lost, a rescue."""
        self._table.clear()


def _place(place: Hashable) -> Hashable:
    """A place as keyed: a run's places past RUN_PLACES share one entry."""
    return min(place, RUN_PLACES) if isinstance(place, int) else ("key", place)


def _same(a: np.ndarray | None, b: np.ndarray) -> bool:
    """Whether two int16 windows hold the same values (small: compared as bytes)."""
    return a is not None and a.size == b.size and a.tobytes() == b.tobytes()
