"""mpi4py buffer specifications (``buf``, ``[buf, datatype]``, ``[buf, count, datatype]``,
``[buf, (count, displ), datatype]``, ``MPI.IN_PLACE``) as 1-D NumPy views.

A spec this library cannot take over (derived datatypes, GPU memory, non-contiguous or
read-only buffers, types NumPy lacks) parses to None: the caller hands the call to MPI,
which accepts or rejects it exactly as mpi4py would.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

IN_PLACE = object()  # the parsed form of MPI.IN_PLACE (mpi4py also reads None so)


def parse(spec: Any, writable: bool) -> np.ndarray | object | None:
    """The elements ``spec`` names, as a 1-D view; IN_PLACE; or None (leave it to MPI)."""
    if spec is None or spec is MPI.IN_PLACE:
        return IN_PLACE
    buf, count, displ, datatype = spec, None, 0, None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            buf, second = spec
            if isinstance(second, (MPI.Datatype, str)):
                datatype = second
            elif isinstance(second, tuple):
                count, displ = second
            else:
                count = second
        elif len(spec) == 3:
            buf, count, datatype = spec
            if isinstance(count, tuple):
                count, displ = count
        elif len(spec) == 4:
            buf, count, displ, datatype = spec
        else:
            return None
    raw = _raw_bytes(buf, writable)
    if raw is None:
        return None
    dtype = _dtype_of(buf, datatype)
    if dtype is None:
        return None
    if count is None:
        if raw.size % dtype.itemsize:
            return None
        count = raw.size // dtype.itemsize - displ
    start = displ * dtype.itemsize
    stop = start + count * dtype.itemsize
    if count < 0 or displ < 0 or stop > raw.size:
        return None  # MPI (mpi4py) reports this with its own message
    return raw[start:stop].view(dtype)


def _raw_bytes(buf: Any, writable: bool) -> np.ndarray | None:
    if hasattr(buf, "__cuda_array_interface__"):
        return None
    if hasattr(buf, "__dlpack_device__") and not isinstance(buf, np.ndarray):
        if buf.__dlpack_device__()[0] != 1:  # kDLCPU
            return None
    if isinstance(buf, np.ndarray):
        array = buf
    else:
        try:
            array = np.frombuffer(memoryview(buf), dtype=np.uint8)
        except (TypeError, ValueError, BufferError):
            return None
    if not array.flags.c_contiguous or (writable and not array.flags.writeable):
        return None
    return array.reshape(-1).view(np.uint8)


def _dtype_of(buf: Any, datatype: MPI.Datatype | str | None) -> np.dtype | None:
    try:
        if datatype is None:
            if isinstance(buf, np.ndarray):
                return buf.dtype if buf.dtype.fields is None else None
            return np.dtype(memoryview(buf).format)
        if isinstance(datatype, str):
            return np.dtype(datatype)
        if not datatype.is_predefined or datatype in (MPI.DATATYPE_NULL, MPI.BYTE,
                                                         MPI.PACKED):
            return None  # untyped bytes: MPI reduces none of them, and says so
        dtype = dtlib.to_numpy_dtype(datatype)
        return dtype if dtype.fields is None and dtype.subdtype is None else None
    except (TypeError, ValueError, KeyError):
        return None
