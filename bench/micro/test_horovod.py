"""The Horovod API's own costs, under 4 ranks: ``python -m bench.micro
bench/micro/test_horovod.py`` (which starts the switch).

* latency: one 4-byte allreduce (negotiation round trips at the cycle time);
* fusion: 128 gradients of 32 KiB submitted together, fused into one buffer or reduced
  one by one (fusion_threshold 0);
* overhead: a 64 MiB in-place allreduce through hvd against the same call on the
  library's communicator directly, with no background thread (both through the switch).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import ina_collectives.torch as hvd  # noqa: E402
from ina_collectives.collectives import Collectives  # noqa: E402
from ina_collectives.ina.engine import InaEngine  # noqa: E402
from ina_collectives.settings import Settings  # noqa: E402

RANKS = (4,)  # the rank counts python -m bench.micro runs it at

COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2,
                                reason="needs several ranks: python -m bench.micro "
                                       "bench/micro/test_horovod.py")


@pytest.fixture
def runtime(request):
    hvd.init(switch_min_bytes=0, **getattr(request, "param", {}))
    yield
    hvd.shutdown()


def test_latency_tiny_allreduce(benchmark, runtime):
    x = torch.ones(1)
    benchmark.group = "horovod-latency"
    COMM.Barrier()
    benchmark.pedantic(lambda: hvd.allreduce(x, op=hvd.Sum, name="tiny"), rounds=200,
                       iterations=1, warmup_rounds=5)
    benchmark.extra_info.update(ranks=COMM.Get_size(), cycle_time_s=Settings().cycle_time)


@pytest.mark.parametrize("runtime", [{}, {"fusion_threshold": 0}], indirect=True,
                         ids=["fused", "unfused"])
def test_many_small_gradients(benchmark, runtime):
    grads = [torch.full((8192,), 1.0) for _ in range(128)]   # 128 x 32 KiB

    def step():
        handles = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum)
                   for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
    benchmark.group = "horovod-fusion"
    COMM.Barrier()
    before = hvd.stats()
    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=1)
    after = hvd.stats()
    benchmark.extra_info.update(reductions_per_step=(after["calls"] - before["calls"]) / 11,
                                engines=after["engines"])


def test_overhead_64mib_hvd(benchmark, runtime):
    x = torch.ones(16 << 20)
    benchmark.group = "horovod-overhead-64MiB"
    COMM.Barrier()
    benchmark.pedantic(lambda: hvd.allreduce_(x, op=hvd.Sum, name="big"), rounds=5,
                       iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(engines=hvd.stats()["engines"])


def test_overhead_64mib_direct(benchmark):
    """The same call without the Horovod runtime (no background thread running)."""
    x = np.ones(16 << 20, np.float32)
    direct = Collectives(COMM, Settings.load({"switch_min_bytes": 0}), InaEngine)
    benchmark.group = "horovod-overhead-64MiB"
    COMM.Barrier()
    benchmark.pedantic(lambda: direct.allreduce(x, out=x), rounds=5, iterations=1,
                       warmup_rounds=1)
    benchmark.extra_info.update(engines=dict(direct.stats.by_engine))
    direct.free()
