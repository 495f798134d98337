"""Updates applied at each module's next forward, so that forward overlaps the last
transfers of the step before (issue 34; P3, ByteScheduler; docs/ordering.md).

``PendingUpdates`` is the machinery both optimizer wrappers share: the Horovod API's
``DistributedOptimizer(overlap=model)`` (torch/optimizer.py) and, for
torch.distributed, ``DistributedOptimizer`` here. A step's reduced gradients are left
pending; a forward pre-hook on every module that holds parameters waits for that
module's own and runs the wrapped optimizer's step on them alone. For optimizers that
update each parameter on its own (SGD, Adam, AdamW, RMSprop) that is the plain loop's
update, bit for bit.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .staging import PRIORITY


class PendingUpdates:
    """The updates a step left for the next forward. ``take(p, started)`` waits for
    ``p``'s reduction and returns its reduced gradient; ``step()`` is the wrapped
    optimizer's own step over ``param_groups`` (which this narrows to the parameters
    being updated while it runs)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor],
                 param_groups: list[dict], take: Callable[[torch.Tensor, Any], torch.Tensor],
                 step: Callable[[], Any]):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"overlap needs the model (a torch.nn.Module), got "
                            f"{type(model).__name__}")
        owned = {p for m in model.modules() for p in m.parameters(recurse=False)}
        missing = [i for i, p in enumerate(params) if p.requires_grad and p not in owned]
        if missing:
            raise ValueError(f"overlap: the model does not hold {len(missing)} of the "
                             f"optimizer's parameters (indices {missing[:8]}); their "
                             f"updates would wait for a forward that never uses them")
        self.param_groups, self.take, self.step = param_groups, take, step
        self.pending: dict[torch.Tensor, Any] = {}
        self.hooks = [m.register_forward_pre_hook(self._before_forward)
                      for m in model.modules() if any(True for _ in m.parameters(recurse=False))]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.pending:
            mine = [p for p in module.parameters(recurse=False) if p in self.pending]
            if mine:
                self.apply(mine)

    def add(self, started: dict[torch.Tensor, Any]) -> None:
        """A step's reductions, in flight: applied at their modules' next forward."""
        if self.pending:  # a module no forward used since the last step: update it first
            self.apply(list(self.pending))
        self.pending = dict(started)

    def apply(self, params: list[torch.Tensor]) -> None:
        """The wrapped optimizer's step on ``params`` alone, with their reduced gradients
        (waited for here); each parameter's ``grad`` is as the caller left it after."""
        saved = {}
        for p in params:
            started = self.pending.pop(p)
            saved[p] = p.grad  # (whatever zero_grad made of it since: kept)
            p.grad = self.take(p, started)
        wanted = set(params)
        groups = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p for p in group["params"] if p in wanted]
            self.step()
        finally:
            for group, kept in zip(self.param_groups, groups):
                group["params"] = kept
            for p in params:
                p.grad = saved[p]

    def apply_all(self) -> None:
        if self.pending:
            self.apply(list(self.pending))


@contextlib.contextmanager
def priority(value: int) -> Iterator[None]:
    """Allreduces submitted inside this block through the backend "ina" (or the Horovod
    API) get this priority: lower runs sooner (docs/ordering.md)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"priority must be an int, got {type(value).__name__}")
    token = PRIORITY.set(value)
    try:
        yield
    finally:
        PRIORITY.reset(token)


class _DistributedOptimizerMixin:
    """Mixed into the wrapped optimizer's own class (so isinstance checks still hold)."""

    def _ina_setup(self, model: torch.nn.Module, group: Any, overlap: bool) -> None:
        self._ina_group = group
        self._ina_size = dist.get_world_size(group)
        params = [p for g in self.param_groups for p in g["params"]]
        # The model's order is the order the next forward needs the parameters in.
        order = {p: i for i, p in enumerate(model.parameters())}
        self._ina_priority = {p: order.get(p, len(order)) for p in params}
        self._ina_started: dict[torch.Tensor, tuple[Any, torch.Tensor]] = {}
        self._ina_updates = (PendingUpdates(model, params, self.param_groups, self._ina_take,
                                            lambda: super(_DistributedOptimizerMixin,
                                                          self).step())
                             if overlap else None)
        self._ina_hooks = [p.register_post_accumulate_grad_hook(self._ina_start)
                           for p in params if p.requires_grad]

    def _ina_start(self, p: torch.Tensor) -> None:
        if p in self._ina_started:
            raise AssertionError("a gradient was computed twice before optimizer.step()")
        if self._ina_updates is not None and p in self._ina_updates.pending:
            self._ina_updates.apply([p])  # its module's forward did not run
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        with priority(self._ina_priority[p]):
            work = dist.all_reduce(p.grad, group=self._ina_group, async_op=True)
        self._ina_started[p] = (work, p.grad)

    def _ina_take(self, p: torch.Tensor, started: tuple[Any, torch.Tensor]) -> torch.Tensor:
        work, grad = started
        work.wait()
        return grad.div_(self._ina_size)

    def _ina_start_all(self) -> None:
        """Every rank reduces every gradient: those no backward produced here too."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and p not in self._ina_started:
                    self._ina_start(p)

    def synchronize(self) -> None:
        """Apply every update still pending (with overlap): before saving, evaluating or
        reading the parameters outside a forward."""
        if self._ina_updates is not None:
            self._ina_updates.apply_all()

    def step(self, closure: Any = None) -> Any:
        self._ina_start_all()
        started, self._ina_started = self._ina_started, {}
        if self._ina_updates is not None:
            if closure is not None:
                raise ValueError("with overlap, step() takes no closure: the updates are "
                                 "applied at each module's next forward")
            self._ina_updates.add(started)
            return None
        for p, s in started.items():
            p.grad = self._ina_take(p, s)
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ina_started:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step()")
        if self._ina_updates is not None and not set_to_none:
            for p in self._ina_updates.pending:  # their reductions still write there
                p.grad = None
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         group: Any = None, overlap: bool = True) -> torch.optim.Optimizer:
    """For torch.distributed (any backend; "ina" orders by priority): ``optimizer`` with
    its gradients averaged over ``group`` (default: the world) as backward produces
    them, each with its parameter's place in ``model`` as priority (the first layers
    first). With ``overlap`` (the default), step() returns at once and each module is
    updated just before its next forward, once its own gradients are in; call
    ``synchronize()`` before reading the parameters outside a forward. The plain loop's
    results for optimizers that update each parameter on its own (SGD, Adam, AdamW,
    RMSprop). The returned optimizer is an instance of ``optimizer``'s class."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("DistributedOptimizer needs torch.distributed: call "
                           "init_process_group first")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizerMixin,
                                              optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._ina_setup(model, group, overlap)
    return wrapped
