"""The kernel selector: the compiled kernels (_fast/) when built, else the NumPy reference.

Both backends export exactly ``API`` (pyzmq's public_api pattern): the selector copies
those names from the chosen one, so they cannot drift apart, and the kernel tests run
against both. ``select(settings.kernels)`` is what an engine uses, chosen at its init:
``numpy`` forces the reference; ``fast`` makes a missing build an error instead of a
silent fallback. The module's own names are the default choice, for code that has no
Settings (tests, benchmarks): ``BACKEND`` says which one that is. The INA engine
itself needs the compiled backend (its windowed stream is _fast/transport.pyx): with
the reference, every call takes the ring and stats() says why (``why_not_fast``: the
setting chose it, or the build is missing).
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
                f"'pip install -e .' (needs a C compiler) or set "
                f"INA_INTERNAL_KERNELS=numpy") from exc
    else:
        raise ValueError(f"INA_INTERNAL_KERNELS must be 'fast' or 'numpy', got {name!r}")
    found = {f: getattr(blockfp if hasattr(blockfp, f) else packets, f) for f in API}
    why = "" if name == "fast" else "INA_INTERNAL_KERNELS=numpy chose the NumPy reference kernels"
    return SimpleNamespace(name=name, why_not_fast=why, **found)


def select(wanted: str) -> SimpleNamespace:
    """The kernels the ``kernels`` setting asks for ("": the compiled ones when built,
    else the reference). Their ``why_not_fast`` says why they are not the compiled ones
    ("" when they are): the setting chose the reference, or the build is missing."""
    if wanted:
        return load(wanted)
    try:
        return load("fast")
    except ImportError as exc:
        kernels = load("numpy")
        kernels.why_not_fast = _not_built(exc)
        return kernels


def _not_built(exc: ImportError) -> str:
    return (f"the compiled fast path is not built ({exc}); 'pip install -e .' builds it "
            f"(needs a C compiler)")


def why_not_fast(settings: Settings | str) -> str:
    """Why an engine with these settings (or this ``kernels`` value) runs without the
    compiled kernels, in words for stats(); "" when it runs with them."""
    wanted = settings if isinstance(settings, str) else settings.kernels
    if wanted == "numpy":
        return "INA_INTERNAL_KERNELS=numpy chose the NumPy reference kernels"
    try:
        load("fast")
    except ImportError as exc:
        return _not_built(exc)
    return ""


_kernels = select(Settings.value("kernels"))
BACKEND: str = _kernels.name
block_exponents = _kernels.block_exponents
quantize = _kernels.quantize
dequantize = _kernels.dequantize
pack_chunks = _kernels.pack_chunks
unpack_results = _kernels.unpack_results
