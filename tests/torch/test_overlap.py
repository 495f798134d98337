"""torch/overlap.py: the updates a step leaves for each module's next forward
(PendingUpdates, alone), the priority block, and torch.distributed's
DistributedOptimizer at 2 ranks in one process (a thread a rank, each with its group of
backend "ina" over tests/threadcomm.py's ThreadPeers: tests/torch/ina_groups.py), with
and without overlap, against the plain loop on the averaged gradients."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ina_collectives.torch.overlap import DistributedOptimizer, PendingUpdates, priority
from ina_collectives.torch.staging import PRIORITY
from tests.torch.ina_groups import on_groups, thread_peers


@pytest.fixture(autouse=True)
def _peers(monkeypatch):
    thread_peers(monkeypatch)


def two_layers() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


# -- priority -------------------------------------------------------------------------------------

def test_priority_sets_the_allreduce_priority_inside_its_block_alone():
    assert PRIORITY.get() == 0
    with priority(5):
        assert PRIORITY.get() == 5
        with priority(-2):
            assert PRIORITY.get() == -2
        assert PRIORITY.get() == 5
    assert PRIORITY.get() == 0
    with pytest.raises(KeyError):
        with priority(3):
            raise KeyError("inside")
    assert PRIORITY.get() == 0
    for wrong in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="priority must be an int"):
            with priority(wrong):
                pass


# -- PendingUpdates ------------------------------------------------------------------------------

def pending(model: torch.nn.Module, lr: float = 1.0):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    taken: list[torch.Tensor] = []

    def take(p, started):
        taken.append(p)
        return started  # (here: the reduced gradient itself)
    updates = PendingUpdates(model, list(model.parameters()), optimizer.param_groups, take,
                             optimizer.step)
    return updates, optimizer, taken


def test_each_modules_update_is_applied_at_its_own_next_forward():
    model = two_layers()
    before = [p.detach().clone() for p in model.parameters()]
    updates, optimizer, taken = pending(model)
    grads = {p: torch.full_like(p, 0.5) for p in model.parameters()}
    first, second = model[0], model[1]
    first.weight.grad = torch.full_like(first.weight, 9.0)  # what the caller left there
    updates.add(grads)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # none yet
    first(torch.ones(1, 3))  # the first layer's forward: its updates alone
    assert taken == [first.weight, first.bias]
    assert torch.equal(first.weight, before[0] - 0.5)
    assert torch.equal(first.bias, before[1] - 0.5)
    assert torch.equal(second.weight, before[2]) and torch.equal(second.bias, before[3])
    assert first.weight.grad.tolist() == torch.full_like(first.weight, 9.0).tolist()
    assert first.bias.grad is None  # each grad as the caller left it
    assert [len(g["params"]) for g in optimizer.param_groups] == [4]  # restored
    model(torch.ones(1, 3))  # the second layer's now; the first's has none left
    assert taken == [first.weight, first.bias, second.weight, second.bias]
    assert torch.equal(second.weight, before[2] - 0.5)
    assert torch.equal(first.weight, before[0] - 0.5)  # not applied twice
    assert updates.pending == {}


def test_updates_no_forward_took_are_applied_at_the_next_step_or_apply_all():
    model = two_layers()
    before = [p.detach().clone() for p in model.parameters()]
    updates, _, _ = pending(model, lr=0.5)
    updates.add({p: torch.ones_like(p) for p in model.parameters()})
    model[0](torch.ones(1, 3))
    updates.add({p: torch.ones_like(p) for p in model[0].parameters()})  # the next step
    # The second layer's first update was applied as the second step came in.
    assert torch.equal(model[1].weight, before[2] - 0.5)
    assert torch.equal(model[0].weight, before[0] - 0.5)  # its second is pending
    updates.apply_all()
    assert torch.equal(model[0].weight, before[0] - 1.0)
    updates.apply_all()  # nothing left: a no-op
    assert torch.equal(model[0].weight, before[0] - 1.0)


def test_pending_updates_need_the_model_that_holds_the_parameters():
    model = two_layers()
    stray = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([*model.parameters(), stray], lr=1.0)
    with pytest.raises(ValueError, match=r"the model does not hold 1 of the optimizer's "
                                         r"parameters \(indices \[4\]\)"):
        PendingUpdates(model, [*model.parameters(), stray], optimizer.param_groups,
                       lambda p, s: s, optimizer.step)
    with pytest.raises(TypeError, match="overlap needs the model .*, got list"):
        PendingUpdates([model], list(model.parameters()), optimizer.param_groups,
                       lambda p, s: s, optimizer.step)


# -- DistributedOptimizer at two ranks -------------------------------------------------------------

def batch(r: int, step: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(4, 3) / 6 * (r + 1) - step


def plain_loop(n: int, steps: int) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of SGD with momentum on gradients averaged
    over n ranks, computed here alone."""
    model = two_layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(n):
            model.zero_grad()
            model(batch(r, step)).pow(2).sum().backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / n
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def initialized():
    """DistributedOptimizer asks for torch.distributed initialized: a gloo default
    group of one rank (each thread's group is its own "ina" group)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_distributed_optimizer_matches_the_plain_loop_on_averaged_gradients(initialized,
                                                                          overlap):
    n, steps = 2, 3
    start = two_layers()

    def body(pg, r):
        model = copy.deepcopy(start)
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                         momentum=0.9),
                                         model, group=pg, overlap=overlap)
        assert isinstance(optimizer, torch.optim.SGD)
        losses = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(batch(r, step)).pow(2).sum()  # (overlap: last step's updates)
            loss.backward()
            losses.append(loss.item())
            assert optimizer.step() is None
        optimizer.synchronize()
        return [p.detach().clone() for p in model.parameters()], losses

    expected = plain_loop(n, steps)
    results = on_groups(n, body)
    for params, _ in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results[0][1] != results[1][1]  # each rank's own batches


def test_distributed_optimizer_refuses_what_it_cannot_wrap():
    model = two_layers()
    with pytest.raises(TypeError, match="DistributedOptimizer wraps a torch.optim.Optimizer"
                                        ", got Sequential"):
        DistributedOptimizer(model, model)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="DistributedOptimizer needs torch.distributed: "
                                           "call init_process_group first"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_with_overlap_step_takes_no_closure(initialized):
    def body(pg, r):
        model = two_layers()
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model, group=pg)
        model(batch(r, 0)).sum().backward()
        with pytest.raises(ValueError, match="with overlap, step\\(\\) takes no closure"):
            optimizer.step(lambda: 0.0)
        return True

    assert on_groups(2, body) == [True, True]
