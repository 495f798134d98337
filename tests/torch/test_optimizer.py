"""torch/optimizer.py's DistributedOptimizer at 2-3 ranks in one process (tests/torch/
hvd_threads.py: a thread a rank, each with its own world): a tiny model trained on each
rank's own batches ends, on every rank, with the same parameters as one process
stepping on the ranks' averaged (or summed) gradients, for SGD with momentum and Adam;
backward_passes_per_step accumulates locally before one reduction; a parameter one rank
does not use is still reduced; synchronize with skip_synchronize; the wrapper's checks
and refusals; and the Horovod start of training (broadcast_parameters and
broadcast_optimizer_state from rank 0, then steps) keeps the ranks identical.

Horovod's test/parallel/test_torch.py was the guide to which behaviours to check."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.torch.hvd_threads import on_hvd, per_thread_world  # noqa: F401

pytestmark = pytest.mark.usefixtures("per_thread_world")


def seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with parameters drawn from a generator of its own (the ranks are
    threads: torch's global generator would be shared by them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def tiny_model(seed: int = 0) -> torch.nn.Module:
    return seeded(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                      torch.nn.Linear(3, 2)), seed)


def batch(rank: int, step: int, rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return torch.nn.functional.mse_loss(model(x), y)


def reference(n: int, steps: int, make_optimizer, reduce: str = "mean", passes: int = 1
              ) -> list[torch.Tensor]:
    """One process: at every step each parameter's gradient is the mean (or sum) over
    the n ranks of each rank's gradient, that being the sum of its ``passes`` backward
    passes (batches step * passes + k); the parameters after ``steps`` steps."""
    model = tiny_model()
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        per_rank = []
        for r in range(n):
            model.zero_grad(set_to_none=True)
            for k in range(passes):
                loss_of(model, batch(r, step * passes + k)).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = sum(grads[i] for grads in per_rank)
            p.grad = total / n if reduce == "mean" else total
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train(hvd, r: int, steps: int, make_optimizer, passes: int = 1, **options
          ) -> list[torch.Tensor]:
    """This rank's loop: its own batches, a DistributedOptimizer step per ``passes``
    backward passes; its parameters after ``steps`` steps."""
    model = tiny_model()
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(passes):
            loss_of(model, batch(r, step * passes + k)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_same_everywhere(results: list[list[torch.Tensor]], want: list[torch.Tensor]
                           ) -> None:
    """Every rank's parameters are bit for bit rank 0's, and close to the reference
    (one process: the same arithmetic, possibly another order of the float sums)."""
    for r, params in enumerate(results):
        assert len(params) == len(want)
        for i, (got, ref) in enumerate(zip(params, want)):
            assert torch.equal(got, results[0][i]), (r, i)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # The steps moved the parameters: the comparison is not of the initial values.
    start = [p.detach() for p in tiny_model().parameters()]
    assert all(not torch.allclose(a, b) for a, b in zip(want, start))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize("n, make_optimizer", [(2, sgd), (3, adam)], ids=["2-sgd", "3-adam"])
def test_every_rank_ends_where_one_process_stepping_on_the_average_gradient_does(
        n, make_optimizer):
    steps = 4
    results = on_hvd(n, lambda hvd, r: train(hvd, r, steps, make_optimizer))
    assert_same_everywhere(results, reference(n, steps, make_optimizer))


def test_op_sum_steps_on_the_summed_gradient_and_predivide_changes_nothing_of_average():
    steps = 3
    plain = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    summed = on_hvd(2, lambda hvd, r: train(hvd, r, steps, plain, op=hvd.Sum))
    assert_same_everywhere(summed, reference(2, steps, plain, reduce="sum"))
    predivided = on_hvd(2, lambda hvd, r: train(hvd, r, steps, plain,
                                                gradient_predivide_factor=2.0))
    assert_same_everywhere(predivided, reference(2, steps, plain))


def test_backward_passes_per_step_accumulates_locally_then_reduces_once():
    steps, passes = 3, 2

    def body(hvd, r):
        before = hvd.stats()["calls"]
        params = train(hvd, r, steps, sgd, passes=passes)
        # One reduction per parameter and step at most (fusion may join them): never
        # one per backward pass.
        return params, hvd.stats()["calls"] - before

    results = on_hvd(2, body)
    assert_same_everywhere([params for params, _ in results],
                           reference(2, steps, sgd, passes=passes))
    for _, calls in results:
        assert 1 <= calls <= steps * 4, calls  # 4 parameters


def test_more_backward_passes_than_backward_passes_per_step_is_an_error():
    def body(hvd, r):
        model = tiny_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             backward_passes_per_step=2)
        loss_of(model, batch(r, 0)).backward()
        loss_of(model, batch(r, 1)).backward()  # the reductions start here
        try:
            loss_of(model, batch(r, 2)).backward()
        except AssertionError as exc:
            refused = str(exc)
        else:
            refused = "no error"
        optimizer.synchronize()  # (every rank started the same reductions)
        return refused

    for refused in on_hvd(2, body):
        assert "gradients were computed more than backward_passes_per_step times" in refused


def test_a_parameter_one_rank_does_not_use_is_still_reduced_with_zeros_there():
    """Rank 1 never uses the second head: its gradient is None there, and rank 0's
    allreduce of it must still meet one from rank 1 (zeros): the average is half
    rank 0's gradient, on both ranks."""
    def body(hvd, r):
        trunk, head_a, head_b = (seeded(torch.nn.Linear(4, 3), 1),
                                 seeded(torch.nn.Linear(3, 1), 2),
                                 seeded(torch.nn.Linear(3, 1), 3))
        modules = torch.nn.ModuleList([trunk, head_a, head_b])
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(modules.parameters(), lr=1.0),
                                             named_parameters=modules.named_parameters())
        x, _ = batch(r, 0)
        h = torch.tanh(trunk(x))
        loss = head_a(h).sum() + (head_b(h).sum() if r == 0 else 0.0)
        loss.backward()
        optimizer.synchronize()
        return [p.grad.clone() for p in head_b.parameters()]

    trunk, head_b = seeded(torch.nn.Linear(4, 3), 1), seeded(torch.nn.Linear(3, 1), 3)
    head_b(torch.tanh(trunk(batch(0, 0)[0]))).sum().backward()
    want = [p.grad / 2 for p in head_b.parameters()]
    for grads in on_hvd(2, body):
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_synchronize_then_a_step_in_skip_synchronize_steps_on_the_clipped_average():
    def body(hvd, r):
        model = tiny_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
        loss_of(model, batch(r, 0)).backward()
        optimizer.synchronize()
        averaged = [p.grad.clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        with optimizer.skip_synchronize():
            optimizer.step()
        # A step right after synchronize, outside skip_synchronize: a warning, no
        # reduction again.
        loss_of(model, batch(r, 1)).backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        return averaged, [p.detach().clone() for p in model.parameters()], [
            str(w.message) for w in caught]

    results = on_hvd(2, body)
    model = tiny_model()
    grads = []
    for r in range(2):
        model.zero_grad()
        loss_of(model, batch(r, 0)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    want = [(a + b) / 2 for a, b in zip(*grads)]
    for averaged, params, caught in results:
        for got, ref in zip(averaged, want):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        assert any("without optimizer.skip_synchronize()" in m for m in caught), caught
        for got, other in zip(params, results[0][1]):
            assert torch.equal(got, other)


def test_zero_grad_between_backward_and_step_is_an_error():
    def body(hvd, r):
        model = tiny_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loss_of(model, batch(r, 0)).backward()
        try:
            optimizer.zero_grad()
        except AssertionError as exc:
            refused = str(exc)
        else:
            refused = "no error"
        optimizer.step()
        return refused

    for refused in on_hvd(2, body):
        assert "zero_grad() was called after loss.backward() but before" in refused


def test_the_wrapper_keeps_the_optimizers_class_and_refuses_what_it_cannot_do():
    def body(hvd, r):
        model = tiny_model()
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        out = {"isinstance": isinstance(wrapped, torch.optim.SGD),
               "names": sorted(wrapped._parameter_names.values()),
               "groups shared": wrapped.param_groups is base.param_groups}
        params = list(model.named_parameters())

        def refused(**kwargs):
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         **kwargs)
            except (ValueError, TypeError) as exc:
                return type(exc).__name__, str(exc)
            return "nothing", ""

        out["repeated"] = refused(named_parameters=[("w", p) for _, p in params])
        out["unnamed"] = refused(named_parameters=params[:1])
        out["op"] = refused(op=hvd.Max)
        out["passes"] = refused(backward_passes_per_step=0)
        out["predivide"] = refused(op=hvd.Sum, gradient_predivide_factor=2.0)
        out["groups"] = refused(groups=0)
        try:
            hvd.DistributedOptimizer(model)
        except TypeError as exc:
            out["not an optimizer"] = str(exc)
        return out

    names = ["0.bias", "0.weight", "2.bias", "2.weight"]
    for out in on_hvd(2, body):
        assert out["isinstance"] and out["groups shared"] and out["names"] == names
        assert out["repeated"] == ("ValueError", "named_parameters has repeated names: ['w']")
        assert out["unnamed"][0] == "ValueError"
        assert "does not name 3 of the optimizer's 4 parameters" in out["unnamed"][1]
        assert out["op"][0] == "ValueError" and "Average or Sum" in out["op"][1]
        assert out["passes"] == ("ValueError", "backward_passes_per_step must be >= 1, got 0")
        assert out["predivide"] == ("ValueError",
                                    "gradient_predivide_factor needs op=Average")
        assert out["groups"][0] == "ValueError"
        assert out["not an optimizer"] == ("DistributedOptimizer wraps a "
                                           "torch.optim.Optimizer, got Sequential")


def test_broadcast_from_rank_0_then_training_keeps_every_rank_identical():
    """Horovod's start: each rank builds its model from its own seed and its optimizer
    with its own learning rate; broadcast_parameters and broadcast_optimizer_state from
    rank 0 make them rank 0's (rank 0 has taken a step, so there is momentum to give);
    training after is identical on every rank."""
    steps = 3

    def body(hvd, r):
        model = tiny_model(seed=r)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
        if r == 0:  # rank 0 alone has optimizer state (momentum buffers)
            loss_of(model, batch(0, 99)).backward()
            optimizer.step()
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        start = copy.deepcopy(model.state_dict())
        momentum = [optimizer.state[p]["momentum_buffer"].clone()
                    for p in model.parameters()]
        lr = optimizer.param_groups[0]["lr"]
        for step in range(steps):
            optimizer.zero_grad()
            loss_of(model, batch(r, step)).backward()
            optimizer.step()
        return start, momentum, lr, [p.detach().clone() for p in model.parameters()]

    results = on_hvd(2, body)
    start0, momentum0, _, final0 = results[0]
    assert any(m.abs().sum() > 0 for m in momentum0)
    for start, momentum, lr, final in results:
        assert lr == 0.1
        assert all(torch.equal(start[k], start0[k]) for k in start0)
        assert all(torch.equal(a, b) for a, b in zip(momentum, momentum0))
        assert all(torch.equal(a, b) for a, b in zip(final, final0))
    assert not torch.equal(final0[0], start0["0.weight"])
