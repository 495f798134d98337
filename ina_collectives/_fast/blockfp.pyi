"""Block floating point, compiled: the same functions as ina_collectives.ina.reference.blockfp."""
import numpy as np

def block_exponents(x: np.ndarray, k: int, b: int = 32) -> tuple[np.ndarray, bool]:
    """Each sub-block's exponent proposal (int16, G = ceil(k / b) per chunk) and whether x
    holds a NaN or an Inf."""

def quantize(x: np.ndarray, exps: np.ndarray, n: int, k: int, b: int = 32,
             bits: int = 32) -> np.ndarray:
    """x as int32 or int16 in network byte order, sub-block j scaled by exps[j]."""

def dequantize(q: np.ndarray, exps: np.ndarray, n: int, k: int, out: np.ndarray,
               average: bool = False, b: int = 32) -> None:
    """Write the aggregated payload q (int32 or int16, network order) into out."""
