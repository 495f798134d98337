"""A switch call made ready for its exponent agreement: the input in the dtype reduced
in, its shares across the serving aggregators, and this rank's proposal for the first
window's exponents (docs/protocol.md: the first window's exponents are agreed before the
stream, the rest ride in-band on the results).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Hashable, NamedTuple

import numpy as np

from ..collectives.engine import AllreduceCall
from .link import WorkerLink

# The most int16 values a gate carries for a call's first window: 1,152 bytes a rank,
# every first window of up to 575 sub-blocks (netsim's at MTU 9000: S 8 x G 70, at
# MTU 1500 S 8 x G 11); a call with more makes its own exponent round.
GATE_WINDOW = 576


class Share(NamedTuple):
    """One serving aggregator's share of a call: chunks ``first`` .. ``end`` - 1."""

    aggregator: int           # its index among the links
    first: int                # the share's first chunk
    end: int                  # the chunk after its last
    ready: int = -1           # its chunks whose exponents are agreed before the stream
    window: tuple[int, int] = (0, 0)  # their place in ``Prepared.local``


@dataclass
class Prepared:
    """A switch call made ready for its exponent round (``prepare``)."""

    x: np.ndarray                       # the input, in the dtype reduced in
    wide: type                          # that dtype
    k: int                              # values per chunk
    g: int                              # sub-blocks per chunk
    shares: list[Share]                 # one per serving aggregator with chunks to stream
    local: np.ndarray                   # this rank's exponents (filled in as streamed)
    proposal: np.ndarray                # [NaN or Inf seen, the windows' exponents], int16
    quorum: bool                        # made for a quorum call (every chunk's window)
    key: Hashable = None                # the call's key (AllreduceCall.key)

    def agreed(self, first: np.ndarray) -> np.ndarray:
        """Every chunk's exponents as far as agreed: the windows' from ``first`` (the max
        of every rank's proposal), the rest filled in by the streams."""
        agreed = np.empty_like(self.local)
        at = 1
        for share in self.shares:
            a, b = share.window
            agreed[a:b] = first[at:at + b - a]
            at += b - a
        return agreed

    def arrays(self, share: Share, out: np.ndarray, agreed: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``share``'s part of the input, of ``out``, of this rank's exponents and of
        ``agreed`` (every chunk's exponents, G each): what its stream takes."""
        k, g = self.k, self.g
        a, b = share.first * k, min(share.end * k, self.x.size)
        e0, e1 = share.first * g, share.end * g
        return self.x[a:b], out[a:b], self.local[e0:e1], agreed[e0:e1]


def window_size(links: list[WorkerLink | None], serving: list[int]) -> int:
    """The int16 values every rank passes in a gate for a call's first window: the most a
    ``Prepared.proposal`` may hold (one, then G exponents per slot of each serving
    aggregator), at most GATE_WINDOW; 0 while none serves."""
    if not serving:
        return 0
    first = links[serving[0]]
    g = -(-first.k // first.block)
    return min(1 + g * sum(links[i].slots for i in serving), GATE_WINDOW)


def prepare(call: AllreduceCall, links: list[WorkerLink | None], serving: list[int],
            edges: np.ndarray, quorum: bool, kernels: SimpleNamespace) -> Prepared:
    """What a call needs before its exponents are agreed: the input (widened), the shares
    (``edges``: the chunk boundaries of the serving aggregators' shares, from a function
    of the chunk count), and this rank's proposal: [NaN or Inf seen in the first window,
    the first window's exponents of each share]. In a quorum call the window is every
    chunk: a result carries the proposals of the workers it counted only, and the values
    of one it left out would not fit them (docs/quorum.md)."""
    first_link = links[serving[0]]
    k, block = first_link.k, first_link.block
    source = call.recv if call.send is None else call.send
    # The input stays intact until the result is whole: the fallback may need it.
    wide = np.float32 if call.dtype == np.float16 else call.dtype
    x = source.astype(wide) if (call.send is None or wide != call.dtype) else source
    g = -(-k // block)
    chunks = -(-x.size // k)
    bounds = (0, chunks) if len(serving) == 1 else edges(chunks)
    shares = []
    for j, i in enumerate(serving):
        c0, c1 = int(bounds[j]), int(bounds[j + 1])
        if c1 <= c0:
            continue
        r = c1 - c0 if quorum else min(links[i].slots, c1 - c0)
        # The window's exponents in ``local``: G per chunk, but only as many of its last
        # chunk's as that chunk has sub-blocks (a small call proposes a few, not G).
        window = (c0 * g, c0 * g + (r - 1) * g
                  + -(-(min((c0 + r) * k, x.size) - (c0 + r - 1) * k) // block))
        shares.append(Share(i, c0, c1, r, window))
    # Only those chunks' own exponents are computed before the stream: the streams compute
    # the rest as they go, while they wait on the network (a pass over the whole tensor
    # here was the largest cost of a call outside its stream).
    local = np.empty(chunks * g, np.int16)
    nonfinite = False
    for share in shares:
        c0, r = share.first, share.ready
        local[c0 * g:(c0 + r) * g], bad = kernels.block_exponents(
            x[c0 * k:min((c0 + r) * k, x.size)], k, block)
        nonfinite |= bad
    proposal = np.empty(1 + sum(b - a for a, b in (share.window for share in shares)),
                        np.int16)
    proposal[0] = nonfinite
    at = 1
    for share in shares:
        a, b = share.window
        proposal[at:at + b - a] = local[a:b]
        at += b - a
    return Prepared(x, wide, k, g, shares, local, proposal, quorum, call.key)
