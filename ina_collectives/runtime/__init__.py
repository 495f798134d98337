"""The framework-neutral runtime behind the Horovod API (NumPy arrays in, handles out).

``negotiation``: each cycle's agreement of the ranks on which named operations are
ready, and the comparison of their metadata; ``background``: the thread that owns the
communication, fuses ready allreduces and runs them through the collectives layer.
The framework bindings (ina_collectives.torch) only convert tensors and build requests.
"""
from .background import BackgroundRuntime, Handle
from .negotiation import OpRequest

__all__ = ["BackgroundRuntime", "Handle", "OpRequest"]
