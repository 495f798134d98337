"""torch/hooks.py's DDP communication hook at 2-3 ranks in one process (a thread a rank,
tests/torch/ina_groups.py): given a bucket (torch's GradBucket has no Python
constructor: the hook reads ``buffer()`` alone, so a stand-in with that method, and
DDP's own buckets in a real DistributedDataParallel over each thread's group), it
returns a future whose value is the bucket averaged over the ranks, on every rank. On a
default group of another backend (gloo, one rank: one process has one default group) it
makes a group of backend "ina" over its ranks once and keeps it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ina_collectives.torch import distributed as ina_dist
from ina_collectives.torch.hooks import allreduce_hook
from tests.torch.ina_groups import on_groups, settled, thread_peers


@pytest.fixture(autouse=True)
def _peers(monkeypatch):
    thread_peers(monkeypatch)


class Bucket:
    """What the hook reads of torch's GradBucket: its flat buffer."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_gradbucket_cannot_be_made_in_python_so_a_stand_in_is_used():
    with pytest.raises(TypeError, match="No constructor defined"):
        dist.GradBucket()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_hooks_future_holds_the_bucket_averaged_over_the_ranks(dtype):
    def body(pg, r):
        buffer = (torch.arange(8, dtype=torch.float32) * (r + 1) - 4 * r).to(dtype)
        future = allreduce_hook(pg, Bucket(buffer))
        assert isinstance(future, torch._C.Future)  # (what Future.then gives, as DDP takes)
        value = settled(future)
        return value, value.data_ptr() == buffer.data_ptr(), buffer

    n = 3
    expected = sum(torch.arange(8.0) * (r + 1) - 4 * r for r in range(n)) / n
    for value, same, buffer in on_groups(n, body):
        assert value.dtype == dtype and value.shape == (8,)
        assert value.float().tolist() == expected.tolist()
        assert same and torch.equal(buffer, value)  # the bucket's buffer, in place


def test_buckets_in_flight_together_each_get_their_own_average():
    def body(pg, r):
        buffers = [torch.full((5,), float(10 * i + r)) for i in range(4)]
        futures = [allreduce_hook(pg, Bucket(b)) for b in buffers]
        return [settled(f).tolist() for f in futures]

    expected = [[10 * i + 0.5] * 5 for i in range(4)]
    assert on_groups(2, body) == [expected, expected]


def test_ddp_with_the_hook_averages_every_gradient_over_the_ranks():
    """DistributedDataParallel over each thread's group, its buckets through the hook:
    every rank's gradients are the mean of each rank's own (computed here alone), on
    the parameters DDP broadcast from rank 0."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 2))

    def batch(r: int) -> torch.Tensor:
        return torch.arange(20.0).reshape(5, 4) / 10 * (r + 1) - r

    def body(pg, r):
        model = copy.deepcopy(reference)
        if r:  # DDP starts every rank from rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(r)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                        bucket_cap_mb=1e-5)
        ddp.register_comm_hook(pg, allreduce_hook)
        ddp(batch(r)).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    n = 2
    own = []
    for r in range(n):
        model = copy.deepcopy(reference)
        model(batch(r)).pow(2).sum().backward()
        own.append([p.grad for p in model.parameters()])
    expected = [sum(g[i] for g in own) / n for i in range(len(own[0]))]
    for grads in on_groups(n, body):
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_hooks_state_must_be_none_or_a_process_group():
    with pytest.raises(TypeError, match="allreduce_hook's state must be None .* or a "
                                        "torch.distributed ProcessGroup, got str"):
        allreduce_hook("group", Bucket(torch.ones(2)))
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="allreduce_hook needs torch.distributed "
                                           "initialized"):
        allreduce_hook(None, Bucket(torch.ones(2)))


@pytest.fixture
def gloo_world(monkeypatch):
    """torch.distributed's default group: gloo, one rank, over a HashStore; no
    companion groups left from before (distributed._companions: the test's own)."""
    monkeypatch.setattr(ina_dist, "_companions", {})
    assert not dist.is_initialized()

    def start():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield start
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_on_a_gloo_default_group_the_hook_makes_an_ina_group_once(gloo_world):
    gloo_world()
    first, second = torch.arange(4.0), torch.full((3,), 2.5)
    assert settled(allreduce_hook(None, Bucket(first))).tolist() == [0.0, 1.0, 2.0, 3.0]
    ((_, made),) = ina_dist._companions.values()  # (by name: the group's id, ours)
    assert isinstance(made, ina_dist.ProcessGroupIna) and made.size() == 1
    assert settled(allreduce_hook(None, Bucket(second))).tolist() == [2.5] * 3
    assert [ours for _, ours in ina_dist._companions.values()] == [made]  # kept
    assert ina_dist.default_group() is made
    assert made.stats()["calls"] == 2


def test_the_hook_works_after_the_default_group_is_destroyed_and_made_again(gloo_world):
    gloo_world()
    assert settled(allreduce_hook(None, Bucket(torch.ones(2)))).tolist() == [1.0, 1.0]
    dist.destroy_process_group()
    gloo_world()
    assert settled(allreduce_hook(None, Bucket(torch.full((2,), 3.0)))).tolist() == \
        [3.0, 3.0]
