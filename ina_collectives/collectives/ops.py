"""Reduction operations and which dtype/op pairs each engine can compute.

This module does not import mpi4py.MPI (importing it initialises MPI): the package's
top level imports Op, and so does every process that imports the package (ina-run
among them), without starting MPI.
"""
from __future__ import annotations

import enum
import sys
from typing import Any

import numpy as np

from ..protocol import MAX_WORKERS


class Op(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVERAGE = "average"  # SUM then divided by the number of ranks (not an MPI op)


SUM, PROD, MIN, MAX, AVERAGE = Op.SUM, Op.PROD, Op.MIN, Op.MAX, Op.AVERAGE

# The dtypes the ring (and later INA) computes itself, in a fixed order: a dtype's index
# here is its code in the ranks' agreement check.
RING_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in (
    "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
))
FLOAT_DTYPES: tuple[np.dtype, ...] = tuple(d for d in RING_DTYPES if d.kind == "f")
# Only MPI's own Allreduce computes these (the ring leaves them to it).
MPI_ONLY_DTYPES: tuple[np.dtype, ...] = (np.dtype("complex64"), np.dtype("complex128"))

UFUNC = {Op.SUM: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum, Op.MAX: np.maximum,
         Op.AVERAGE: np.add}
_MPI_NAMES = {Op.SUM: "SUM", Op.PROD: "PROD", Op.MIN: "MIN", Op.MAX: "MAX",
              Op.AVERAGE: "SUM"}


def mpi_op(op: Op) -> Any:
    """The MPI.Op that computes ``op`` (AVERAGE: SUM, divided afterwards)."""
    from mpi4py import MPI

    return getattr(MPI, _MPI_NAMES[op])

_BY_NAME = {op.value: op for op in Op} | {"avg": Op.AVERAGE, "mean": Op.AVERAGE,
                                          "product": Op.PROD}


def as_op(op: Any) -> Op | None:
    """Our Op for ``op`` (an Op, its name, or a predefined MPI.Op).

    None means an MPI.Op we do not compute ourselves (user-defined, MAXLOC, LAND...):
    the caller hands such calls to MPI. Anything else is a TypeError/ValueError.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        try:
            return _BY_NAME[op.lower()]
        except KeyError:
            raise ValueError(f"unknown op {op!r}; expected one of {', '.join(_BY_NAME)}") from None
    mpi = sys.modules.get("mpi4py.MPI")  # an MPI.Op exists only once MPI is imported
    if mpi is not None and isinstance(op, mpi.Op):
        for ours, name in _MPI_NAMES.items():
            if ours is not Op.AVERAGE and op == getattr(mpi, name):
                return ours
        return None
    raise TypeError(f"op must be an ina_collectives.Op, its name or an MPI.Op, got {op!r}")


def check_supported(dtype: np.dtype, op: Op) -> None:
    """Raise TypeError/ValueError naming both if no engine can reduce dtype with op."""
    if dtype in RING_DTYPES:
        if op is Op.AVERAGE and dtype not in FLOAT_DTYPES:
            raise ValueError(f"op AVERAGE is not defined for dtype {dtype}: the mean of "
                             f"integers is not an integer; use SUM and divide")
        return
    if dtype in MPI_ONLY_DTYPES:
        if op in (Op.MIN, Op.MAX):
            raise TypeError(f"op {op.name} is not defined for dtype {dtype} (complex numbers "
                            f"are not ordered)")
        return
    supported = ", ".join(str(d) for d in RING_DTYPES + MPI_ONLY_DTYPES)
    raise TypeError(f"dtype {dtype} with op {op.name} is not supported; supported dtypes: "
                    f"{supported}")


_OP_CODES = {op: i for i, op in enumerate(Op)}


def op_code(op: Op) -> int:
    """A small integer naming ``op``, equal on every rank of a job (its place in Op)."""
    return _OP_CODES[op]


def dtype_code(dtype: np.dtype) -> int:
    """A small integer naming dtype, equal on every rank of a job."""
    known = RING_DTYPES + MPI_ONLY_DTYPES
    return known.index(dtype) if dtype in known else 1000 + dtype.num


def check_quorum(k: Any) -> int:
    """The quorum an API takes (0: sync; docs/quorum.md), as an int, or ValueError."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_WORKERS:
        raise ValueError(f"quorum must be an int 0 (sync) .. {MAX_WORKERS}, got {k!r}")
    return int(k)
