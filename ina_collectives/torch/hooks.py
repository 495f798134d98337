"""DDP communication hooks that reduce gradients through the switch, whatever backend the
process group has: the group (nccl, gloo) keeps its broadcasts, all-gathers, FSDP and
checkpoints, and the gradient buckets take the switch.

    from ina_collectives.torch.hooks import allreduce_hook
    model = DistributedDataParallel(model)           # any backend
    model.register_comm_hook(None, allreduce_hook)   # one line, nothing else

The hook reduces each bucket through a process group of backend "ina" over the same
ranks (``distributed.companion``: the DDP group itself if it is one, else one made on
the first bucket), which serves float32, float16 and bfloat16 buckets through the switch
where it serves and exactly elsewhere (NaN or Inf in a gradient, no switch: the ring or
gloo), averaged over the group's ranks as DDP averages. The future it returns completes
from the runtime's thread, so DDP overlaps the buckets with the backward pass.
``ina_collectives.stats()`` and ``summary()`` report the hook's calls. FSDP's
reduce-scatter is not a DDP hook and gains nothing from a switch (docs/ddp.md).
"""
# (No "from __future__ import annotations": DDP checks the hook's annotations as objects.)
from typing import Any

import torch
import torch.distributed as dist

from . import distributed


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce, through the switch: ``state`` None (DDP's default process group)
    or a ProcessGroup (whose ranks reduce the bucket); returns the averaged bucket's
    future."""
    group = _process_group(state)
    torch_group, _ = distributed.companion(group)
    tensor = bucket.buffer()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=torch_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _process_group(state: Any) -> Any:  # noqa: ANN401
    if state is None:
        if not dist.is_initialized():
            raise RuntimeError("allreduce_hook needs torch.distributed initialized "
                               "(init_process_group) before DDP's first backward pass")
        return dist.distributed_c10d._get_default_group()
    if isinstance(state, dist.ProcessGroup):
        return state
    raise TypeError(f"allreduce_hook's state must be None (the default process group) or "
                    f"a torch.distributed ProcessGroup, got {type(state).__name__}")


__all__ = ["allreduce_hook"]
