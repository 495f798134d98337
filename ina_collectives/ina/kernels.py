"""The kernel selector: the compiled kernels (_fast/) when built, else the NumPy reference.

Both backends export exactly ``API`` (pyzmq's public_api pattern): the selector copies
those names from the chosen one, so they cannot drift apart, and the kernel tests run
against both. ``select(settings.kernels)`` is what an engine uses, chosen at its init:
``numpy`` forces the reference; ``fast`` makes a missing build an error instead of a
silent fallback. The module's own names are the default choice, for code that has no
Settings (tests, benchmarks): ``BACKEND`` says which one that is. The INA engine
itself needs the compiled backend (its windowed stream is _fast/transport.pyx): with
the reference, every call takes the ring and stats() says so.
"""
from __future__ import annotations

from types import SimpleNamespace

from ..settings import Settings
from .reference import blockfp as _ref_blockfp
from .reference import packet as _ref_packets

API = ("block_exponents", "quantize", "dequantize", "pack_chunks", "unpack_results")


def load(name: str) -> SimpleNamespace:
    """The kernels of backend ``name`` ("fast" or "numpy"), as one namespace."""
    if name == "numpy":
        blockfp, packets = _ref_blockfp, _ref_packets
    elif name == "fast":
        try:
            from .._fast import blockfp
            from .._fast import packet as packets
        except ImportError as exc:
            raise ImportError(
                f"the compiled fast path is not built ({exc}); reinstall with "
                f"'pip install -e .' (needs a C compiler) or set INA_KERNELS=numpy") from exc
    else:
        raise ValueError(f"INA_KERNELS must be 'fast' or 'numpy', got {name!r}")
    found = {f: getattr(blockfp if hasattr(blockfp, f) else packets, f) for f in API}
    return SimpleNamespace(name=name, **found)


def select(wanted: str) -> SimpleNamespace:
    """The kernels the ``kernels`` setting asks for ("": the compiled ones when built,
    else the reference)."""
    if wanted:
        return load(wanted)
    try:
        return load("fast")
    except ImportError:
        return load("numpy")


_kernels = select(Settings.value("kernels"))
BACKEND: str = _kernels.name
block_exponents = _kernels.block_exponents
quantize = _kernels.quantize
dequantize = _kernels.dequantize
pack_chunks = _kernels.pack_chunks
unpack_results = _kernels.unpack_results
