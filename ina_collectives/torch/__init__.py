"""Horovod's PyTorch API over ina_collectives: ``import ina_collectives.torch as hvd``.

    hvd.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 *
                                         hvd.size()), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    ... loss.backward(); optimizer.step() ...
    print(hvd.summary())    # what the switch served, what took the ring and why

Launch with ``ina-run -np 4 -- python train.py`` (an embedded software switch serves the
float allreduces) or plain ``mpiexec`` (INA_SWITCH names a switch; without one every
reduction takes the ring or MPI). A background thread owns communication: named
operations are negotiated among the ranks each cycle, checked for agreement before any
data moves, fused, and reduced in the network where they can be.
"""
from .compression import Compression, Compressor
from .functions import (
                        allgather_object,
                        broadcast_object,
                        broadcast_optimizer_state,
                        broadcast_parameters,
)
from .mpi_ops import *  # noqa: F401,F403 - Horovod's flat namespace
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer

__all__ = [*_ops_all, "Compression", "Compressor", "DistributedOptimizer",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]
