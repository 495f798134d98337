"""The worker's data path: a tensor streamed through the aggregator, windowed and reliable."""
from typing import Callable, Protocol

import numpy as np

from ina_collectives.protocol import JobFormat

STATUS: tuple[str, ...]
"""A Result's status, by index: done, silent, timeout, a send failed, cancelled, lost
(quorum: done but for chunks the switch no longer holds)."""
COMPLETE: tuple[int, ...]
"""The statuses of a call that ended without a failure: done, lost."""
OPEN_MISMATCH: int
RTO_MARGIN: float
"""The RTO's least margin over SRTT, a fraction of it (RFC 6298's SRTT + 4 RTTVAR alone
fired on a steady queue's ordinary swings)."""
"""An opening's status when a result said the workers' identities differ."""
CALLS: tuple[str, ...]
"""The system calls whose failure a Result reports (``failed_call``): send, recvmmsg,
poll."""

def rtt_update(state: np.ndarray, sample: float, rto_min: float, rto_max: float) -> float:
    """One round-trip sample into state [SRTT, RTTVAR, RTO] (for tests); the new RTO."""


class _Timers(Protocol):  # ina.link.Timers
    first: float
    least: float
    most: float
    silence: float


class _StreamPlan(Protocol):  # ina.link.StreamPlan
    x: np.ndarray
    out: np.ndarray
    local: np.ndarray
    agreed: np.ndarray
    average: bool
    value_bits: int
    call: int
    quorum: int
    ready: int
    ident: int
    learn: np.ndarray | None
    nonfinite: bool
    absent: bool


class Result:
    """How one stream or opening ended, built once at its end."""
    status: int
    """An index of STATUS, or OPEN_MISMATCH."""
    missing: np.ndarray
    """The chunks not completed (int64)."""
    counted_all: int
    """The workers every result counted (a bitmap; all ones if no result came)."""
    counted_any: int
    """The workers some result counted (-1 if no result came)."""
    mode: int
    """The newest mode the results announced: generation << 8 | quorum."""
    error: int
    """The errno of the system call that failed (0: none)."""
    failed_call: str
    """That call, one of CALLS ("": none)."""
    reason: str
    """The caller's words for the status (WorkerLink fills it in)."""
    def __init__(self, status: int = 0, counters: dict[str, float] | None = None,
                 missing: np.ndarray | None = None, counted_all: int = -1,
                 counted_any: int = -1, mode: int = 0, error: int = 0,
                 failed_call: str = "") -> None: ...
    @property
    def ok(self) -> bool:
        """Ended without a failure (LOST included)."""
    @property
    def counters(self) -> dict[str, float]:
        """The call's counts by name (made when read; the link keeps their totals)."""
    @property
    def seconds(self) -> float:
        """How long the stream (or the opening) took."""
    @property
    def overflows(self) -> int:
        """A predicted call's chunks sent again (their values overflowed)."""
    @property
    def left_out(self) -> int:
        """A quorum call's chunks this worker's values were not counted in."""
    @property
    def skipped(self) -> int:
        """A quorum call's chunks this worker sent no values for."""
    @property
    def nonfinite(self) -> bool:
        """This worker's input held a NaN or an Inf."""
    @property
    def nonfinite_seen(self) -> bool:
        """A result said some worker's input held a NaN or an Inf."""


class Link:
    """One worker's data path to one aggregator: the socket, the job's format and the
    state that lasts from call to call (slot versions, RTT estimates, packet numbers,
    the send path, the window and its buffers)."""
    job: int
    worker: int
    n: int
    k: int
    block: int
    value_bits: int
    groups: int
    """G: sub-blocks per chunk."""
    slots: int
    row_width: int
    epoch: int
    nacking: bool
    """Whether the aggregator NACKs (CAP_NACKS, or it sent a NACK)."""
    watch: Callable[[], object] | None
    """Called every 20 ms while the aggregator holds this worker's packets: a non-None
    answer (a peer failed) ends the call, cancelled."""
    gso: int
    """1 while new packets may leave with UDP_SEGMENT (cleared if the kernel refuses)."""
    def __init__(self, fd: int, switch_addr_be: int, switch_port_be: int, fmt: JobFormat,
                 worker: int, slots: int, epoch: int = 0, gso: bool = True) -> None: ...
    def resize(self, slots: int) -> None:
        """S slots from now on, each from version 0."""
    def new_epoch(self, epoch: int) -> None:
        """A new epoch, every slot from version 0 again."""
    @property
    def versions(self) -> np.ndarray:
        """Each slot's next version (a copy)."""
    @property
    def next_packet(self) -> int:
        """The number of the next new packet (mod 256, counted across calls)."""
    @property
    def totals(self) -> dict[str, float]:
        """Its calls' counts all told, by name (as a Result's counters)."""
    @property
    def stream_rtt(self) -> tuple[float, float, float]:
        """The streams' (SRTT, RTTVAR, RTO), seconds."""
    @property
    def opening_rtt(self) -> tuple[float, float, float]:
        """The openings' (SRTT, RTTVAR, RTO), seconds."""
    def stream(self, plan: _StreamPlan, timers: _Timers, deadline: float,
               cancel: np.ndarray | None = None,
               then: tuple[_StreamPlan, _Timers, float] | None = None,
               pause: bool = False) -> Result | None:
        """One call's stream (``plan``, read once) through the aggregator; ``then``, the
        next call, queued behind it and adopted in its drain (docs/protocol.md, Calls
        back to back); ``pause``: None at its drain, ``proceed`` goes on."""
    @property
    def paused(self) -> bool:
        """Whether a stream paused at its drain waits for ``proceed``."""
    def proceed(self, then: tuple[_StreamPlan, _Timers, float] | None = None) -> Result:
        """The paused stream run on to its end, ``then`` adopted at once."""
    @property
    def adopted(self) -> bool:
        """Whether the call queued behind the last stream was adopted in its drain and
        not yet resumed or abandoned."""
    def resume(self, then: tuple[_StreamPlan, _Timers, float] | None = None,
               pause: bool = False) -> Result | None:
        """The adopted call run to its end (``then``, ``pause``: as ``stream``'s)."""
    def abandon(self) -> bool:
        """Drop the adopted call, if any (True if there was one)."""
    def settle(self, chunks: int) -> None:
        """The last sync call of ``chunks`` chunks, finished from a peer's kept window:
        each slot's version as its completion leaves it."""
    def opening(self, proposals: np.ndarray, ident_offset: int, ident_word: int,
                timers: _Timers, deadline: float, call: int) -> Result:
        """A call's opening through the aggregator; ``proposals`` (S x G int16) becomes
        the max over the workers."""
