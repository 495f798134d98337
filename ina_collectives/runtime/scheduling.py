"""What a cycle runs of the ready allreduces, in what order, and how fused: pure
functions of the agreed requests and the settings, the same on every rank
(docs/ordering.md).

Ready allreduces are cut into partitions of at most ``partition_bytes`` (``cut``),
ordered by priority, lowest first, ties in the order they became ready (``order``),
grouped into fusion buffers of one dtype, op, scale and switch width (``fusion_groups``),
each piece at a multiple of the switch's sub-block (``layout``), and a cycle runs groups
up to ``partition_bytes`` of them, carrying the rest (``take``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .negotiation import OpRequest, Ready


@dataclass
class Piece:
    """Elements [start, stop) of a ready allreduce: the unit the runtime orders, fuses
    and reduces (the whole tensor unless it is larger than ``partition_bytes``)."""

    item: Ready
    start: int
    stop: int
    order: int  # when its tensor became ready (ties of priority keep the agreed order)

    @property
    def request(self) -> OpRequest:
        return self.item.any_request()

    @property
    def size(self) -> int:
        return self.stop - self.start


def align(req: OpRequest, block: int) -> int:
    """Where a float tensor's pieces start in a fusion buffer: at a multiple of the
    switch's sub-block ``block``, so that every sub-block holds one tensor's values and
    their quantization is the same wherever the tensor lands (elements otherwise)."""
    return block if req.wire.kind == "f" else 1


def cut(reductions: list[Ready], limit: int, block: int, first: int
        ) -> tuple[list[Piece], dict[str, int]]:
    """Each ready allreduce as its partitions: whole if it is at most ``limit`` bytes
    (0: no limit), else in pieces of that many bytes (a multiple of the sub-block, the
    last one shorter); numbered in order from ``first``. Also: each name's count."""
    pieces, counts = [], {}
    for order, item in enumerate(reductions, first):
        req = item.any_request()
        count = math.prod(req.shape)
        step = count
        if limit and count * req.wire.itemsize > limit:
            unit = align(req, block)
            step = max(unit, limit // req.wire.itemsize // unit * unit)
        starts = range(0, count, step) if count else [0]
        counts[item.name] = len(starts)
        pieces += [Piece(item, start, min(start + step, count), order) for start in starts]
    return pieces, counts


def order(pieces: list[Piece], fifo: bool) -> list[Piece]:
    """Lowest priority first (``fifo``: priorities ignored), ties as they became ready."""
    return sorted(pieces, key=lambda p: (0 if fifo else p.request.priority, p.order,
                                         p.start))


def layout(group: list[Piece], block: int) -> tuple[list[int], int]:
    """Each piece's offset in the group's buffer, and the buffer's length: a lone piece
    at 0 with no padding, fused ones each at a multiple of ``align``."""
    if len(group) == 1:
        return [0], group[0].size
    unit = align(group[0].request, block)
    offsets, end = [], 0
    for piece in group:
        end = -(-end // unit) * unit
        offsets.append(end)
        end += piece.size
    return offsets, end


def fusion_groups(pieces: list[Piece], threshold: int, partition_bytes: int
                  ) -> list[list[Piece]]:
    """Runs of one dtype, op, scale, switch width and set of absent ranks (quorum mode:
    negotiation.Ready), in the pieces' order, each of up to ``threshold`` (and
    ``partition_bytes``, where set) bytes."""
    groups: list[list[Piece]] = []
    open_groups: dict[tuple, tuple[list[Piece], int]] = {}
    limit = min(threshold, partition_bytes) if partition_bytes else threshold
    for piece in pieces:
        req = piece.request
        key = (req.wire, req.op, req.prescale, req.postscale, req.switch_bits,
               piece.item.absent, piece.item.waited)
        nbytes = piece.size * req.wire.itemsize
        members, used = open_groups.get(key, (None, 0))
        if members is None or used + nbytes > limit:
            members, used = [], 0
            groups.append(members)
        members.append(piece)
        open_groups[key] = (members, used + nbytes)
    return groups


def take(groups: list[list[Piece]], budget: int, block: int
         ) -> tuple[list[list[Piece]], list[Piece]]:
    """The groups a cycle runs, at least one and at most ``budget`` bytes of them (0:
    all), and the pieces it carries to the next cycle."""
    if not budget:
        return groups, []
    run: list[list[Piece]] = []
    spent = 0
    for group in groups:
        if run and spent >= budget:
            break
        run.append(group)
        spent += layout(group, block)[1] * group[0].request.wire.itemsize
    return run, [piece for group in groups[len(run):] for piece in group]
