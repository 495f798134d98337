"""The framework-neutral runtime behind the Horovod API (NumPy arrays in, handles out).

``negotiation``: each cycle's agreement of the ranks on which named operations are
ready, and the comparison of their metadata; ``background``: the thread that owns the
communication, its cycle and the handles; ``scheduling``: the order, partitions and
fusion of the ready allreduces (pure functions); ``scaling``: Horovod's prescale,
postscale and AVERAGE around a reduction; ``host_collectives``: the other kinds, on the
host by MPI; ``world``: the job as ``init`` made it, its process sets; ``hot_rows``: which
rows of a sparse tensor go as a dense allreduce (elected alike on every rank);
``handle_group``: the handles of one call waited on as one; ``p2p``: point-to-point on a
group's peers (MPI's polled, gloo's framed).
The framework bindings (ina_collectives.torch) only convert tensors and build requests.
"""
from .background import BackgroundRuntime, Handle
from .negotiation import OpRequest

__all__ = ["BackgroundRuntime", "Handle", "OpRequest"]
