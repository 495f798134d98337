"""Block floating point, compiled: the same functions as ina_collectives.ina.reference.blockfp."""
import numpy as np

def block_exponents(x: np.ndarray, k: int) -> tuple[np.ndarray, bool]:
    """Each block's exponent proposal (int16) and whether x holds a NaN or an Inf."""

def quantize(x: np.ndarray, exps: np.ndarray, n: int, k: int) -> np.ndarray:
    """x as int32 in network byte order, block b scaled by its agreed exponent exps[b]."""

def dequantize(q: np.ndarray, exps: np.ndarray, n: int, k: int, out: np.ndarray,
               average: bool = False) -> None:
    """Write the aggregated int32 payload q (network order) into out, in out's dtype."""
