"""The worker's data path: a tensor streamed through the aggregator, windowed and reliable."""
import numpy as np

STATUS: tuple[str, ...]
"""What stream() returns first, by index: done, silent, timeout, a send failed,
cancelled, lost (quorum: done but for chunks the switch no longer holds)."""
COMPLETE: tuple[int, ...]
"""The statuses of a stream that ended without a failure: done, lost."""
CALLS: tuple[str, ...]
"""The failed system call of counters["call"], by index: send, recvmmsg, poll."""

def rtt_update(state: np.ndarray, sample: float, rto_min: float, rto_max: float) -> float:
    """One round-trip sample into state [SRTT, RTTVAR, RTO] (for tests); the new RTO."""

def stream_scratch(slots: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Buffers a stream may reuse from call to call (stream's ``scratch``)."""


def stream(fd: int, switch_addr_be: int, switch_port_be: int, x: np.ndarray,
           out: np.ndarray, local: np.ndarray, agreed: np.ndarray, versions: np.ndarray,
           n: int, k: int, job: int, worker: int, average: bool, rto: float,
           rto_min: float, rto_max: float, silence: float, deadline: float,
           rtt: np.ndarray, epoch: int = 0, seq: np.ndarray | None = None,
           block: int = 32, value_bits: int = 32, send_state: np.ndarray | None = None,
           cancel: np.ndarray | None = None, call: int = 0, quorum: int = 0,
           ready: int = -1, scratch: tuple[np.ndarray, np.ndarray] | None = None
           ) -> tuple[int, dict[str, float], np.ndarray]:
    """Allreduce x into out through the aggregator: (status, counters, chunks missing)."""


OPEN_MISMATCH: int
"""What opening() returns first when a result said the workers' identities differ."""

def opening(fd: int, switch_addr_be: int, switch_port_be: int, proposals: np.ndarray,
            versions: np.ndarray, job: int, worker: int, block: int, value_bits: int,
            ident_offset: int, ident_word: int, rto: float,
            rto_min: float, rto_max: float, silence: float, deadline: float,
            rtt: np.ndarray, epoch: int, seq: np.ndarray, call: int,
            send_state: np.ndarray, scratch: tuple[np.ndarray, np.ndarray]
            ) -> tuple[int, dict[str, float]]:
    """A call's opening through the aggregator: (status, counters); ``proposals``
    (S x G int16) becomes the max over the workers."""
