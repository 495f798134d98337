"""INA packets, compiled: the same functions as ina_collectives.ina.reference.packet."""
import numpy as np

def pack_chunks(x: np.ndarray, k: int, n: int, agreed: np.ndarray, local: np.ndarray,
                first: int, count: int, rows: np.ndarray, slots: int, version_base: int,
                job: int, worker: int, flags: int = 0, epoch: int = 0, block: int = 32,
                value_bits: int = 32) -> np.ndarray:
    """Write chunks first .. first+count-1 of x into rows 0 .. count-1; their lengths."""

def unpack_results(rows: np.ndarray, lengths: np.ndarray, out: np.ndarray, n: int, k: int,
                   job: int, average: bool = False, block: int = 32,
                   value_bits: int = 32) -> np.ndarray:
    """parse_result for each row i (its first lengths[i] bytes); the statuses (uint8)."""
