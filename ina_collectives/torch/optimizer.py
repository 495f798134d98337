"""``DistributedOptimizer``: reduces gradients while backward still runs, as Horovod's.

A hook on every parameter starts its gradient's allreduce as soon as autograd has
accumulated it, so communication overlaps the rest of backward; the background
runtime fuses the gradients that are ready together, the first layers' first (each
gradient's priority is its parameter's place in the model: the next forward needs them
first; docs/ordering.md). A gradient too small for the switch waits for the next one
(``_ina_ready``). ``step()`` waits for them all, or, with ``overlap=model``, waits for
none: each module's parameters are updated just before its next forward, as soon as
their reduced gradients are in, so that forward overlaps the last transfers.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator

import torch

from ..runtime import world
from ..runtime.world import ProcessSet, global_process_set
from . import mpi_ops
from .compression import Compression, Compressor, switch_values
from .overlap import PendingUpdates
from .staging import Average, Sum, op_of


class DistributedOptimizerMixin:
    """Mixed into the wrapped optimizer's own class (so isinstance checks still hold)."""

    def local_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's own step, on this rank's gradients as they are: no
        allreduce (broadcast_optimizer_state initializes a missing state with it)."""
        return super().step(closure)  # type: ignore[misc]

    def _ina_setup(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                   compression: type[Compressor], backward_passes_per_step: int, op: str,
                   gradient_predivide_factor: float, process_set: ProcessSet,
                   sparse_as_dense: bool = False,
                   overlap: torch.nn.Module | None = None) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [name for name, _ in named]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"named_parameters has repeated names: {repeated}")
            by_id = {id(p): name for name, p in named}
            unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
            if unnamed:
                raise ValueError(f"named_parameters does not name {len(unnamed)} of the "
                                 f"optimizer's {len(params)} parameters (indices "
                                 f"{unnamed[:8]})")
        else:
            # Horovod's names, so that every rank names the same parameter alike.
            by_id = {id(p): f"allreduce.noname.{i}.{j}"
                     for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])}
        self._ina_names = {p: f"grad.{by_id[id(p)]}" for p in params}
        # Lower runs sooner: the parameters' order in the model (named_parameters'), which
        # is the order the forward pass needs them in.
        order = ([p for _, p in named] if named_parameters is not None else params)
        self._ina_priority = {p: i for i, p in enumerate(order)}
        # Horovod's attribute (parameter -> name), which scripts and its tests read.
        self._parameter_names = {p: by_id[id(p)] for p in params}
        self._ina_compression = compression
        self._ina_passes = backward_passes_per_step
        self._ina_op = op
        self._ina_sparse_as_dense = sparse_as_dense
        self._ina_prescale = 1.0 / gradient_predivide_factor
        self._ina_postscale = gradient_predivide_factor
        self._ina_delay = {p: backward_passes_per_step for p in params}
        self.process_set = process_set
        self._ina_handles: dict[torch.Tensor, tuple[Any, Any, torch.Tensor | None]] = {}
        # Sparse gradients reduced dense: their sparse dims, to hand them back sparse.
        self._ina_densified: dict[torch.Tensor, int] = {}
        self._ina_synchronized = False
        self._ina_carrying = False
        self._ina_skip_sync = False
        # Small gradients held back to be fused with the next (_ina_ready); the bytes of
        # every gradient a step has, and of those ready so far in this step.
        self._ina_held: list[torch.Tensor] = []
        self._ina_held_bytes = 0
        self._ina_min_bytes: int | None = None
        self._ina_total_bytes = sum(p.numel() * p.element_size() for p in params
                                    if p.requires_grad)
        self._ina_seen_bytes = 0
        # overlap: the updates step() leaves for each module's next forward (overlap.py).
        self._ina_updates = (PendingUpdates(
            overlap, params, self.param_groups, self._ina_reduced,
            lambda: super(DistributedOptimizerMixin, self).step())
            if overlap is not None else None)
        # A rank outside the process set steps on its own gradients, as in Horovod.
        self._ina_hooks = [p.register_post_accumulate_grad_hook(self._ina_hook)
                           for p in params if p.requires_grad and process_set.included()]

    def _ina_hook(self, p: torch.Tensor) -> None:
        if self._ina_updates is not None and p in self._ina_updates.pending:
            self._ina_updates.apply([p])  # its module's forward did not run: update it now
        if p in self._ina_handles and self._ina_delay[p] <= 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before "
                "optimizer.step() or optimizer.synchronize(); raise backward_passes_per_step")
        self._ina_delay[p] -= 1
        if self._ina_delay[p] == 0:
            self._ina_ready(p)

    def _ina_ready(self, p: torch.Tensor) -> None:
        """Start ``p``'s allreduce. A dense gradient waits for the next one while more are
        to come this step and either what waits, or what is still to come, is below
        switch_min_bytes: started together, the runtime fuses them into one call that
        the switch serves, where alone each would have gone by MPI (the first gradients
        of backward are often a small last layer's, the last ones a first layer's
        bias)."""
        grad = p.grad
        held = self._ina_held
        nbytes = grad.numel() * grad.element_size() if grad is not None else 0
        self._ina_seen_bytes += nbytes
        more = len(self._ina_handles) + len(held) + 1 < len(self._ina_hooks)
        # (The gradients still to come, if too small together to be served alone, wait
        # for nothing: this one waits for them instead.)
        tail = self._ina_total_bytes - self._ina_seen_bytes
        if (more and grad is not None and not grad.is_sparse
                and min(self._ina_held_bytes + nbytes, tail) < self._ina_floor()):
            held.append(p)
            self._ina_held_bytes += nbytes
            return
        if not self._ina_carrying:  # (once the runtime exists: hvd.init came first)
            # A late rank's gradients count late rather than not at all (quorum mode
            # running ahead, docs/quorum.md): these names carry gradients only.
            mpi_ops.carry_late_inputs(self._ina_names.values(), self.process_set)
            self._ina_carrying = True
        with mpi_ops.submitted_together(self.process_set):
            self._ina_release()
            self._ina_handles[p] = self._ina_start(p)

    def _ina_release(self) -> None:
        """Start the gradients held back by _ina_ready (together)."""
        if self._ina_held:
            with mpi_ops.submitted_together(self.process_set):
                for q in self._ina_held:
                    self._ina_handles[q] = self._ina_start(q)
            self._ina_held.clear()
            self._ina_held_bytes = 0

    def _ina_floor(self) -> int:
        if self._ina_min_bytes is None:
            self._ina_min_bytes = mpi_ops.switch_min_bytes(self.process_set)
        return self._ina_min_bytes

    def _ina_start(self, p: torch.Tensor) -> tuple[Any, Any, torch.Tensor | None]:
        if p.grad is None:  # unused on this rank: every rank must still submit it
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self._ina_sparse_as_dense:  # the exact sparse exchange (sparse.py)
                return (mpi_ops.sparse_allreduce_async(p.grad, self._ina_names[p],
                                                       self._ina_op, self.process_set),
                        None, None)
            # Reduced dense (through the switch, where it serves), handed back sparse:
            # an optimizer for sparse gradients (SparseAdam) takes no dense ones.
            self._ina_densified[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        compressed, ctx = self._ina_compression.compress(p.grad)
        with switch_values(self._ina_compression):
            handle = mpi_ops.allreduce_async_(compressed, name=self._ina_names[p],
                                              op=self._ina_op,
                                              prescale_factor=self._ina_prescale,
                                              postscale_factor=self._ina_postscale,
                                              process_set=self.process_set,
                                              priority=self._ina_priority[p])
        return handle, ctx, compressed

    def _ina_start_all(self) -> None:
        """Start what backward has not started: the gradients held back, and those of
        parameters whose hook did not fire (no gradient on this rank), so that all ranks
        submit the same names."""
        self._ina_release()  # (before the loop below, which would start them again)
        for p in self._ina_names:
            if p.requires_grad and p not in self._ina_handles:
                self._ina_handles[p] = self._ina_start(p)

    def _ina_take(self, p: torch.Tensor, started: tuple[Any, Any, torch.Tensor | None]
                  ) -> None:
        """Wait for ``p``'s allreduce and put its result in ``p.grad``."""
        compressed = started[2]
        whole = compressed is None or p in self._ina_densified  # (a new tensor, sparse)
        reduced = self._ina_reduced(p, started)
        if whole:
            p.grad = reduced
        elif compressed is not p.grad:
            with torch.no_grad():
                p.grad.copy_(reduced)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; parameters whose hook did not fire (no
        gradient on this rank) are reduced now, so that all ranks submit the same names.
        With ``overlap``, also apply every update step() left for the next forward (call
        it before reading the parameters outside a forward: to save or evaluate)."""
        if not self.process_set.included():
            self._ina_synchronized = True
            return
        if self._ina_updates is not None and self._ina_updates.pending:
            self._ina_updates.apply_all()
            if not self._ina_handles and not self._ina_held:
                return
        self._ina_start_all()
        for p, started in self._ina_handles.items():
            self._ina_take(p, started)
        self._ina_handles.clear()
        self._ina_seen_bytes = 0
        self._ina_synchronized = True

    # -- overlap: updates applied just before each module's next forward -----------------

    def in_flight(self) -> dict[torch.Tensor, Any]:
        """The handle of every gradient reduction started and not yet applied, by
        parameter (with overlap, those step() left for the next forward too)."""
        pending = self._ina_updates.pending if self._ina_updates is not None else {}
        return {p: started[0] for p, started in [*self._ina_handles.items(),
                                                 *pending.items()]}

    def _ina_reduced(self, p: torch.Tensor, started: tuple[Any, Any, torch.Tensor | None]
                     ) -> torch.Tensor:
        """Wait for ``p``'s reduction and return its gradient (overlap: the reduced
        values are in the tensor the allreduce was given, whatever zero_grad did to
        p.grad since)."""
        handle, ctx, compressed = started
        self._ina_delay[p] = self._ina_passes
        if compressed is None:  # a sparse gradient's exchange
            return handle()
        grad = self._ina_compression.decompress(mpi_ops.synchronize(handle), ctx)
        if p in self._ina_densified:
            grad = grad.to_sparse(self._ina_densified.pop(p))
        return grad

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For a step() after an explicit synchronize() (e.g. to clip gradients)."""
        self._ina_skip_sync = True
        try:
            yield
        finally:
            self._ina_skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if self._ina_updates is not None and self.process_set.included():
            if closure is not None:
                raise ValueError("with overlap, step() takes no closure: the updates are "
                                 "applied at each module's next forward")
            if self._ina_skip_sync:
                raise ValueError("with overlap, step() does not wait for the gradients: "
                                 "skip_synchronize() has nothing to skip")
            self._ina_updates.apply_all()  # a module no forward used since the last step
            self._ina_start_all()
            self._ina_updates.add(self._ina_handles)
            self._ina_handles = {}
            self._ina_seen_bytes = 0
            self._ina_synchronized = False
            return None
        if not self._ina_skip_sync and self.process_set.included():
            if self._ina_synchronized and not self._ina_handles:
                # Gradients are reduced already; Horovod warns here (and so do we),
                # since the step may have been meant to sit in skip_synchronize().
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients were reduced "
                              "already and are not reduced again; wrap step() in "
                              "skip_synchronize() to say so", stacklevel=2)
            else:
                self.synchronize()
        self._ina_synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ina_handles or self._ina_held:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize()")
        if self._ina_updates is not None and not set_to_none:
            # The pending allreduces still write into the old gradient tensors.
            for p in self._ina_updates.pending:
                p.grad = None
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         overlap: torch.nn.Module | None = None
                         ) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that step() applies gradients reduced over the ranks of
    ``process_set`` (all ranks by default).

    The returned optimizer shares the wrapped one's parameter groups and state and is an
    instance of its class. ``named_parameters`` (model.named_parameters()) names the
    gradients in errors and stall reports; ``op`` is Average (default) or Sum;
    ``gradient_predivide_factor`` f divides before the sum and multiplies after
    (Average: overall 1/size either way). ``groups`` (Horovod's hint of which gradients to
    fuse together) is checked and accepted: the runtime already fuses every gradient
    that is ready in a cycle, so results do not depend on it. Sparse gradients (an
    ``nn.Embedding(sparse=True)``'s) are reduced exactly by gathering every rank's
    indices and values (torch/sparse.py), or with ``sparse_as_dense`` as dense tensors
    (through the switch where it serves) and handed back sparse.

    ``overlap=model`` (not in Horovod; P3, ByteScheduler): step() returns without waiting,
    and each of the model's modules has its parameters updated just before its next
    forward, once their reduced gradients are in; the first layers' gradients go first
    (priority), so the next forward overlaps the transfers of the last ones. The results
    are those of the plain loop for optimizers that update each parameter on its own
    (SGD, Adam, AdamW, RMSprop; not those that look across parameters, such as LAMB or a
    global gradient clip). ``synchronize()`` applies what is pending (before saving or
    evaluating the parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    op = op_of(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer reduces with Average or Sum, not {op!r}")
    world.require()
    if groups is not None and not (isinstance(groups, int) and groups > 0 or
                                   isinstance(groups, (list, tuple))):
        raise ValueError(f"groups must be a positive int or a list of parameter lists, "
                         f"got {groups!r}")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    cls = type(optimizer.__class__.__name__, (DistributedOptimizerMixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._ina_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, process_set, sparse_as_dense, overlap)
    return wrapped
