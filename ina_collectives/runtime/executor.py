"""The runtime's executor of calls, one for both controllers (negotiated.py, ordered.py):
a ready allreduce cut into pieces (``cut``), each call's pieces reduced through
``Collectives`` with Horovod's scaling (``run``: a lone piece in its output, fused ones
in the fusion buffer) and their results handed back as each completes; the next call
made ready while this one drains; the gate of an operation other than allreduce."""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ..collectives.agreement import CallSignature
from ..collectives.chooser import Collectives, Following
from ..collectives.waiting import Deadline
from ..errors import CollectiveTimeout, InaError
from ..settings import Settings
from . import scaling, scheduling
from .handles import Submissions
from .negotiation import OpRequest, Ready
from .running_ahead import RunAhead
from .scheduling import Piece

log = logging.getLogger("ina_collectives")

# What comes after a call: its pieces, or what finds them once the call drains.
After = list[Piece] | Callable[[], list[Piece] | None] | None


class Executor:
    """Runs the calls a controller hands it, in that order, on the runtime's thread.
    ``keyed``: calls are known to the offload by their tensors' names and ranges (the
    negotiated runtime's are alike on every rank; program order's names are the
    callers' and need not repeat)."""

    def __init__(self, collectives: Collectives, settings: Settings,
                 submissions: Submissions, late: RunAhead, keyed: bool):
        self.collectives, self.settings = collectives, settings
        self.subs, self.late, self.keyed = submissions, late, keyed
        self.size, self.rank = collectives.comm.Get_size(), collectives.comm.Get_rank()
        self.counters = late.counters
        self._fusion_buffer = np.empty(0, np.uint8)
        self._fusion_spare = np.empty(0, np.uint8)
        # The next call, made ready in this one's drain (``_ready_ahead``): its group,
        # buffer, offsets and length; a fused one fills the spare fusion buffer.
        self._ahead: tuple[list[Piece], np.ndarray, list[int], int] | None = None
        # The partitions of each tensor not reduced yet, and the number of the next
        # ready one.
        self._parts_left: dict[str, int] = {}
        self._ready_count = 0

    def cut(self, ready: list[Ready]) -> list[Piece]:
        """Ready allreduces cut into partitions of at most partition_bytes (a
        partition's results go back as it completes)."""
        s = self.settings
        pieces, counts = scheduling.cut(ready, s.partition_bytes, s.switch_block,
                                        self._ready_count)
        self._ready_count += len(counts)
        self._parts_left.update(counts)
        for item in ready:
            if item.owed is not None:
                item.owed.parts = counts[item.name]
        return pieces

    def gate(self, request: OpRequest) -> None:
        """The gate of an operation other than allreduce: the call checked as the array
        API checks a call it hands to MPI (an opening through the switch, or the
        agreement), where a rank that could not finish the switch call before it meets
        the others (collectives/recovery.py)."""
        # (A quorum's setting is gated by the agreement: the next switch call, in the new
        # mode, would meet an opening of its number in the cells it uses.)
        self.collectives.check_agreement(CallSignature(
            CallSignature.MPI_DIRECT, -1, -1, -1, request.describe()),
            Deadline(self.settings.timeout), through_offload=request.kind != "quorum")

    def run(self, group: list[Piece], after: After = None) -> set[str]:
        """One call: ``group``'s pieces reduced, their results handed back. ``after``:
        the call that comes next (or what finds it), made ready in this one's drain.
        The names that failed (their handles finished with the error); a timeout, which
        ends the runtime, is raised."""
        req = group[0].request
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is group:
            _, buffer, offsets, total = ahead
            if len(group) > 1:  # (its buffer the spare one: the other is free now)
                self._fusion_buffer, self._fusion_spare = (self._fusion_spare,
                                                           self._fusion_buffer)
        else:
            ahead = None
            buffer, offsets, total = self._buffer(group)
        if len(group) > 1:
            self.counters["fused calls"] += 1
            self.counters["tensors fused"] += len(group)
        try:
            if ahead is None:
                self._fill(group, buffer, offsets)  # (a staged input's copy may time out)
            if total:
                key, present = self._call_of(group)
                following = ((lambda: self._ready_ahead(after)) if after is not None
                             else None)
                scaling.reduce(self.collectives, buffer, req, self.size, key=key,
                               present=present, prescaled=ahead is not None,
                               following=following)
        except InaError as exc:
            for piece in group:
                if piece.item.owed is not None:
                    self.late.part(piece, None, exc)
            failed = {piece.item.name for piece in group}
            for name in failed:
                self._parts_left.pop(name, None)
                self.late.added(name)
                self.subs.finish(name, error=exc)
            if isinstance(exc, CollectiveTimeout):
                raise
            return failed
        inflight = self.subs.inflight
        for piece, offset in zip(group, offsets):
            name = piece.item.name
            handle = inflight.get(name)
            if piece.item.owed is not None:  # run without this rank: kept for it
                self.late.part(piece, buffer[offset:offset + piece.stop - piece.start])
            elif handle is not None:
                recv = handle.data["recv"]
                if len(group) > 1:
                    np.copyto(recv[piece.start:piece.stop],
                              buffer[offset:offset + piece.stop - piece.start])
                if "arrived" in handle.data:  # this range is final: it may go back now
                    handle.data["arrived"](piece.start, piece.stop)
            left = self._parts_left.get(name, 1) - 1
            if left > 0:
                self._parts_left[name] = left
                continue
            self._parts_left.pop(name, None)
            self.late.added(name)
            if handle is not None:
                self.subs.finish(name, handle.data["recv"])
        return set()

    def _buffer(self, group: list[Piece], spare: bool = False
                ) -> tuple[np.ndarray, list[int], int]:
        """Where ``group``'s call reduces, its pieces' offsets there and its length: a
        lone piece in its output (no copy out) unless it is an input the caller still
        needs unchanged; fused pieces in the fusion buffer (``spare``: the other one, for
        a call made ready while one runs)."""
        wire = group[0].request.wire
        offsets, total = scheduling.layout(group, self.settings.switch_block)
        if len(group) == 1:
            handle = self.subs.inflight.get(group[0].item.name)
            recv = handle.data["recv"] if handle else None
            return (recv[group[0].start:group[0].stop] if recv is not None
                    else np.empty(total, wire)), offsets, total
        fusion = self._fusion_spare if spare else self._fusion_buffer
        if fusion.nbytes < total * wire.itemsize:
            fusion = np.empty(max(total * wire.itemsize, self.settings.fusion_threshold),
                              np.uint8)
            if spare:
                self._fusion_spare = fusion
            else:
                self._fusion_buffer = fusion
        buffer = fusion[:total * wire.itemsize].view(wire)
        if total > offsets[-1] + group[-1].stop - group[-1].start or any(
                offsets[i] + p.stop - p.start != offsets[i + 1]
                for i, p in enumerate(group[:-1])):
            buffer[...] = 0  # the padding between pieces adds nothing
        return buffer, offsets, total

    def _call_of(self, group: list[Piece]) -> tuple[Any, int]:
        """``group``'s call's key and the ranks present (AllreduceCall)."""
        key = tuple((p.item.name, p.start, p.stop) for p in group) if self.keyed else None
        # (Fused only with its like: scheduling.) Every rank present and named: a call
        # that waited for a rank at its bound, counted in sync.
        item = group[0].item
        present = (sum(1 << r for r in range(self.size) if r not in item.absent)
                   if item.absent or item.waited else 0)
        return key, present

    def _ready_ahead(self, after: After) -> Following | None:
        """The next call made ready while this one drains (Collectives.allreduce_flat's
        ``following``): its input filled in and prescaled, if none of it waits to land
        (a staged input) and it is not empty; its arguments, else None."""
        group = after() if callable(after) else after
        if not group:
            return None
        for piece in group:
            handle = self.subs.inflight.get(piece.item.name)
            if handle is not None and "landed" in handle.data:
                return None
        buffer, offsets, total = self._buffer(group, spare=True)
        if not total:
            return None
        try:
            self._fill(group, buffer, offsets)
            op = scaling.ahead(self.collectives, buffer, group[0].request)
        except Exception:  # (its own run fills it again, and raises it there)
            log.debug("the next call could not be made ready ahead", exc_info=True)
            return None
        self._ahead = (group, buffer, offsets, total)
        key, present = self._call_of(group)
        return Following(None, buffer, op, group[0].request.switch_bits, key, present)

    def _fill(self, group: list[Piece], buffer: np.ndarray, offsets: list[int]) -> None:
        """Each piece's input into its place in ``buffer`` (zeros for a joined rank),
        once it has landed where it is staged."""
        for piece, offset in zip(group, offsets):
            handle = self.subs.inflight.get(piece.item.name)
            place = buffer[offset:offset + piece.stop - piece.start]
            if handle is None:          # this rank has joined: it adds nothing
                place[...] = 0
                continue
            if "landed" in handle.data:  # staged a window at a time: wait for this range
                handle.data["landed"](piece.start, piece.stop)
            if handle.data["send"] is not None or len(group) > 1:
                # (send None: in place, the input is in recv, where a lone piece is)
                source = handle.data["send"]
                if source is None:
                    source = handle.data["recv"]
                np.copyto(place, source[piece.start:piece.stop])
            carried = self.late.adding(piece.item.name)  # its late inputs, carried
            if carried is not None:
                place += carried[piece.start:piece.stop]
