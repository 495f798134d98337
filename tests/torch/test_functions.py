"""torch/functions.py at 2-3 ranks in one process (tests/torch/hvd_threads.py: a thread a
rank, each with its own world): broadcast_parameters in its three forms (a state_dict
with buffers, named_parameters, a list of pairs), in place; its refusals;
broadcast_optimizer_state with and without state on the root and on the others (a
DistributedOptimizer's too, with no reduction the root would not join); broadcast_object
and allgather_object, on the global set and on a process set.

Horovod's test/parallel/test_torch.py was the guide to which behaviours to check."""
from __future__ import annotations

import pytest
import torch

from tests.torch.hvd_threads import attempt, on_hvd, per_thread_world  # noqa: F401

pytestmark = pytest.mark.usefixtures("per_thread_world")


def model_of(rank: int) -> torch.nn.Module:
    """A model whose parameters and buffers differ by rank (a generator of its own: the
    ranks are threads, and torch's global generator is shared)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=g))
            else:  # (BatchNorm's num_batches_tracked)
                t.fill_(10 + rank)
    return model



@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "pairs"])
def test_broadcast_parameters_makes_every_rank_the_roots_in_place(form):
    root = 1

    def body(hvd, r):
        model = model_of(r)
        objects = [id(p) for p in model.parameters()]
        if form == "state_dict":
            hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        elif form == "named_parameters":
            hvd.broadcast_parameters(model.named_parameters(), root_rank=root)
        else:
            hvd.broadcast_parameters([(f"p{i}", p) for i, p in
                                      enumerate(model.parameters())] + [("none", None)],
                                     root_rank=root)
        same = objects == [id(p) for p in model.parameters()]
        return same, {k: v.clone() for k, v in model.state_dict().items()}

    want = model_of(root).state_dict()
    mine = [model_of(r).state_dict() for r in range(3)]
    for r, (same, state) in enumerate(on_hvd(3, body)):
        assert same
        for key, value in state.items():
            if form == "state_dict" or key.startswith(("0.", "2.")) or key in (
                    "1.weight", "1.bias"):
                assert torch.equal(value, want[key]), (r, key)
            else:  # buffers are not parameters: only the state_dict form carries them
                assert torch.equal(value, mine[r][key]), (r, key)
    assert not torch.equal(mine[0]["0.weight"], want["0.weight"])  # (there was work)


def test_broadcast_parameters_refuses_what_is_not_parameters():
    def body(hvd, r):
        return {"not iterable": attempt(lambda: hvd.broadcast_parameters(3, 0)),
                "not pairs": attempt(lambda: hvd.broadcast_parameters([torch.ones(2)], 0)),
                "not a tensor": attempt(lambda: hvd.broadcast_parameters([("w", 2.0)], 0))}

    for out in on_hvd(2, body):
        assert out["not iterable"] == ("TypeError", "broadcast_parameters takes a "
                                       "state_dict or (name, tensor) pairs, got int")
        assert out["not pairs"][0] == "TypeError"
        assert "expected (name, tensor) pairs" in out["not pairs"][1]
        assert out["not a tensor"] == ("TypeError",
                                       "broadcast_parameters: 'w' is a float, not a tensor")


def adam_state(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]]


def test_broadcast_optimizer_state_gives_the_roots_buffers_and_hyperparameters():
    """Rank 0 has stepped its Adam (lr 0.01, betas changed); rank 1 has no state and
    another lr; rank 2's optimizer is a DistributedOptimizer with no state (its state is
    made by a local step, no reduction). After, every rank has rank 0's state and
    hyperparameters, and its parameters are untouched by the local step."""
    def body(hvd, r):
        model = model_of(0)
        if r == 0:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
            model(torch.randn(5, 3, generator=torch.Generator().manual_seed(5))).sum().backward()
            optimizer.step()
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.5 + r)
            if r == 2:
                optimizer = hvd.DistributedOptimizer(optimizer)
        params = [p.detach().clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        group = optimizer.param_groups[0]
        return adam_state(optimizer), (group["lr"], group["betas"]), unchanged

    results = on_hvd(3, body)
    root_state = results[0][0]
    assert all(s["exp_avg"].abs().sum() > 0 for s in root_state)
    for r, (state, hyper, unchanged) in enumerate(results):
        assert hyper == (0.01, (0.8, 0.9)) and unchanged, r
        assert len(state) == len(root_state)
        for mine, theirs in zip(state, root_state):
            assert mine.keys() == theirs.keys()
            for key in theirs:
                assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key]))


def test_broadcast_optimizer_state_with_no_state_anywhere_makes_it_alike_everywhere():
    def body(hvd, r):
        model = model_of(r)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
        hvd.broadcast_optimizer_state(optimizer, root_rank=1)
        return adam_state(optimizer), optimizer.param_groups[0]["lr"], [
            p.grad for p in model.parameters()]

    for state, lr, grads in on_hvd(2, body):
        assert lr == pytest.approx(0.2)
        assert len(state) == 6  # (4 parameters of the Linears, 2 of the BatchNorm)
        for s in state:
            assert float(s["step"]) == 1.0 and s["exp_avg"].abs().sum() == 0
        assert all(g is not None and g.abs().sum() == 0 for g in grads)


def test_broadcast_optimizer_state_refuses_what_is_not_an_optimizer():
    def body(hvd, r):
        return attempt(lambda: hvd.broadcast_optimizer_state(model_of(0), root_rank=0))

    for got in on_hvd(2, body):
        assert got == ("TypeError", "broadcast_optimizer_state takes a "
                       "torch.optim.Optimizer, got Sequential")


def test_broadcast_object_gives_every_rank_the_roots_object():
    def body(hvd, r):
        mine = {"rank": r, "tensor": torch.arange(3) * (r + 1), "text": "x" * (r * 50)}
        got = hvd.broadcast_object(mine, root_rank=2)
        nothing = hvd.broadcast_object(None if r == 0 else "ignored", root_rank=0,
                                       name="none")
        return got, nothing

    for got, nothing in on_hvd(3, body):
        assert got["rank"] == 2 and got["text"] == "x" * 100
        assert torch.equal(got["tensor"], torch.tensor([0, 3, 6]))
        assert nothing is None


def test_allgather_object_lists_every_ranks_object_in_rank_order():
    def body(hvd, r):
        everyone = hvd.allgather_object({"rank": r, "rows": list(range(r * 3))})
        ps = hvd.add_process_set([1, 2])
        in_set = (hvd.allgather_object(f"rank {r}" * (r + 1), process_set=ps)
                  if r in (1, 2) else None)
        from_set = (hvd.broadcast_object(("from", r), root_rank=2, process_set=ps)
                    if r in (1, 2) else None)
        hvd.remove_process_set(ps)
        return everyone, in_set, from_set

    for r, (everyone, in_set, from_set) in enumerate(on_hvd(3, body)):
        assert everyone == [{"rank": q, "rows": list(range(q * 3))} for q in range(3)]
        if r == 0:
            assert in_set is None and from_set is None
        else:
            assert in_set == ["rank 1" * 2, "rank 2" * 3] and from_set == ("from", 2)
