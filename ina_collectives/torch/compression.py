"""Gradient compression for allreduce, as Horovod's ``hvd.Compression``, and one Horovod
lacks: ``Compression.switch16``, 16-bit values on the wire through the switch."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch


class Compressor:
    """Turns a tensor into what is sent, and the reduced result back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes), restores their dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class Switch16Compressor(NoneCompressor):
    """Leaves the tensor as it is and asks the switch to sum it as 16-bit values (wire
    format 3: int16 per value, an exponent per sub-block): half the bytes on the wire, with
    14 - log2(n) bits per sub-block of 32 (docs/quantization.md). The job's aggregator must
    take 16-bit calls: the software switch does in any job; a P4 build of 32-bit values
    does not, and the call is then served as 32-bit values (stats()["switch"] counts the
    calls by width). Calls that take the ring or MPI are exact, as ever."""

    switch_value_bits = 16


class Compression:
    """``Compression.none`` (the default), ``Compression.fp16`` (as Horovod) and
    ``Compression.switch16`` (16-bit values on the switch's wire)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    switch16 = Switch16Compressor


# The switch width the allreduces submitted inside switch_values() ask for (0: the job's).
SWITCH_BITS: ContextVar[int] = ContextVar("switch_value_bits", default=0)


@contextmanager
def switch_values(compression: type[Compressor]) -> Iterator[None]:
    """Submissions in this block ask for ``compression``'s switch value width, if any."""
    token = SWITCH_BITS.set(getattr(compression, "switch_value_bits", 0))
    try:
        yield
    finally:
        SWITCH_BITS.reset(token)
