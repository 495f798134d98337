"""INA packets, compiled: the same functions as ina_collectives.ina.reference.packet."""
import numpy as np

from ina_collectives.protocol import JobFormat, Stamp

def pack_chunks(x: np.ndarray, fmt: JobFormat, agreed: np.ndarray, local: np.ndarray,
                first: int, count: int, rows: np.ndarray, stamp: Stamp) -> np.ndarray:
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1; their lengths."""

def unpack_results(rows: np.ndarray, lengths: np.ndarray, out: np.ndarray, fmt: JobFormat,
                   average: bool = False) -> np.ndarray:
    """parse_result for each row i (its first lengths[i] bytes); the statuses (uint8)."""
