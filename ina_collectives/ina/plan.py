"""A switch call's plan, built once by the INA engine and taken whole by the striping,
the links and the compiled loop (docs/architecture.md, One call).

``CallPlan`` is the call: its prepared shares, its output and agreed exponents, the
per-call values every packet carries and its deadline. ``CallPlan.stream(share)`` is one
share's ``StreamPlan`` (ina/link.py, the link's input): its slices of those arrays and
the same values, what ``transport.Link.stream`` reads once into its C state (no Python
per packet).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..collectives.waiting import Deadline
from .link import StreamPlan
from .preparing import Prepared, Share

__all__ = ["CallPlan", "StreamPlan"]


@dataclass(frozen=True)
class CallPlan:
    """One switch call: ``prepared`` (its shares), ``out``, ``agreed`` (every chunk's
    exponents as far as agreed), ``deadline``, and the values each stream carries
    (StreamPlan's)."""
    prepared: Prepared
    out: np.ndarray
    agreed: np.ndarray
    deadline: Deadline
    average: bool = False
    value_bits: int = 0
    number: int = 0
    quorum: int = 0
    ident: int = 0
    learn: np.ndarray | None = None
    nonfinite: bool = False
    absent: bool = False

    def stream(self, share: Share) -> StreamPlan:
        """``share``'s stream: its slices, and this call's values."""
        x, into, local, theirs = self.prepared.arrays(share, self.out, self.agreed)
        return StreamPlan(x, into, local, theirs, self.average, self.value_bits,
                          self.number & 0xFFFF, self.quorum, share.ready, self.ident,
                          self.learn, self.nonfinite, self.absent)
