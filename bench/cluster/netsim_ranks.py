"""What each rank of a netsim job runs (in its own namespace, under mpiexec):

    python -m bench.cluster.netsim_ranks SYSTEM SIZES REPS OUT.json

SYSTEM: ina (the library through the software switch), ring (the library's ring over
MPI point-to-point), mpi (MPICH's MPI_Allreduce), gloo (torch.distributed), and
ddp-ina / ddp-gloo (one DDP training step on torch.distributed's backend "ina" or "gloo",
SIZES then being bytes of gradients; records add the step's compute alone). For each size
(bytes of float32): one warm-up call, then REPS timed calls, each started together after a
barrier; a call's time is the slowest rank's. Rank 0 writes one record per size to
OUT.json: the median, every repetition, and which engine served the calls.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np


def cpu_jiffies() -> tuple[float, float]:
    """(busy, total) jiffies of the machine's cores (/proc/stat is host-wide)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def tcp_retransmits() -> int:
    """Segments TCP resent in this rank's network namespace so far (/proc/net/snmp is
    per namespace): MPI's and gloo's messages cross the same lossy links, and a lost
    segment waits for TCP's timeout (200 ms at least on Linux)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def straggling(run: Callable[[], None]) -> Callable[[], None]:
    """``run``, started INA_BENCH_STRAGGLER_MS late on the last rank (bench.cluster.netsim
    --straggler-ms: a straggler); ``run`` itself elsewhere."""
    delay = float(os.environ.get("INA_BENCH_STRAGGLER_MS", "0")) / 1e3
    last = int(os.environ.get("PMI_RANK", "0")) == int(os.environ.get("PMI_SIZE", "1")) - 1
    if delay <= 0 or not last:
        return run

    def late() -> None:
        time.sleep(delay)
        run()
    return late


def timed(run: Callable[[], None], barrier: Callable[[], None],
          slowest: Callable[[float], float], reps: int,
          resent: list[int] | None = None, streamed: Callable[[], float] | None = None,
          streams: list[float] | None = None) -> tuple[list[float], float]:
    """Each repetition's time (the slowest rank's) and the machine's CPU utilisation
    while they ran (near 1: the CPU, not the links, limits the figure). ``resent``, if
    given, gets this rank's TCP retransmissions during each repetition; ``streams`` the
    seconds ``streamed()`` grew by (INA: the time inside the packet stream). With a
    straggler (INA_BENCH_STRAGGLER_MS), the last rank starts each call that much late."""
    run = straggling(run)
    run()  # warm-up: connections, buffers, the switch's job state
    times = []
    busy0, total0 = cpu_jiffies()
    for _ in range(reps):
        barrier()
        before = tcp_retransmits()
        stream0 = streamed() if streamed else 0.0
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        if resent is not None:
            resent.append(tcp_retransmits() - before)
        if streams is not None and streamed is not None:
            streams.append(streamed() - stream0)
        times.append(slowest(elapsed))
    busy1, total1 = cpu_jiffies()
    return times, (busy1 - busy0) / max(total1 - total0, 1.0)


# The worker link's counters that say how loss was recovered (_fast/transport.pyx).
LINK_COUNTERS = ("sent", "retransmitted", "nacks", "nack_resent", "result_requests", "stale")


def mpi_systems(system: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    from mpi4py import MPI

    from ina_collectives.collectives import Collectives
    from ina_collectives.ina.engine import InaEngine
    from ina_collectives.settings import Settings

    comm = MPI.COMM_WORLD
    collectives = None
    # ina16: INA_SWITCH_VALUE_BITS=16; ina-quorum: INA_QUORUM=n-1; ina-gate:
    # INA_INTERNAL_SWITCH_OPENING=0
    through_switch = system in ("ina", "ina16", "ina-quorum", "ina-gate", "ina-tree")
    if through_switch:
        collectives = Collectives(comm, Settings.load({"switch_min_bytes": 0}),
                                  InaEngine)
    elif system == "hier":
        return hierarchical(sizes, reps)
    elif system == "ring":
        collectives = Collectives(comm, Settings.load({"ring_min_bytes": 0, "switch": ""}))
    records = []
    for nbytes in sizes:
        send = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(send)
        if collectives is None:
            run = lambda: comm.Allreduce(send, recv)  # noqa: E731
        else:
            run = lambda: collectives.allreduce(send, out=recv)  # noqa: E731
        before = dict(collectives.stats.by_engine) if collectives else {}
        # (the offload's report: the ring's chooser has none)
        link_before = (dict(collectives.stats.snapshot()["transport"]) if through_switch
                       else {})
        resent: list[int] = []
        streams: list[float] = []
        streamed = ((lambda: float(
            collectives.offload.aggregators.counts().get("seconds", 0.0)))
            if through_switch else None)
        times, cpu = timed(run, comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), reps,
                           resent, streamed, streams)
        # (In quorum mode a chunk may leave one rank out: its sum is n - 1.)
        lowest = comm.Get_size() - (system == "ina-quorum")
        if not ((recv >= lowest) & (recv <= comm.Get_size())).all():
            raise SystemExit(f"{system}: wrong allreduce result for {nbytes} bytes")
        engines = ({e: c - before.get(e, 0) for e, c in collectives.stats.by_engine.items()
                    if c - before.get(e, 0)} if collectives else {"mpi": reps + 1})
        record = {"bytes": nbytes, "times": times, "engines": engines, "cpu": cpu,
                  **({"fallback_reasons": dict(collectives.stats.fallback_reasons)}
                     if collectives and collectives.stats.fallback_reasons else {}),
                  "tcp_retransmits": [int(v) for v in np.sum(comm.allgather(resent), 0)]}
        if streams:  # the slowest rank's seconds in the packet stream, per repetition
            record["stream_seconds"] = [float(v) for v in np.max(comm.allgather(streams), 0)]
        if through_switch:  # the packet counters of the timed and warm-up calls, all ranks
            after = collectives.stats.snapshot()["transport"]
            mine = {key: after.get(key, 0) - link_before.get(key, 0) for key in LINK_COUNTERS}
            record["packets"] = {key: sum(c[key] for c in comm.allgather(mine))
                                 for key in LINK_COUNTERS}
        records.append(record)
    if collectives is not None:
        collectives.free()
    return records


def torch_slowest(seconds: float) -> float:
    """The largest of the ranks' ``seconds``, over torch.distributed's default group."""
    import torch
    import torch.distributed as dist
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def gloo(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29517",
                            rank=rank, world_size=size)

    records = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)

        def run() -> None:
            tensor.fill_(1.0)
            dist.all_reduce(tensor)
        times, cpu = timed(run, dist.barrier, torch_slowest, reps)
        if not bool((tensor == size).all()):
            raise SystemExit(f"gloo: wrong allreduce result for {nbytes} bytes")
        records.append({"bytes": nbytes, "times": times, "engines": {"gloo": reps + 1},
                        "cpu": cpu})
    dist.destroy_process_group()
    return records


def step_record(backend: str, step: Callable[[], None], local_step: Callable[[], None],
                reps: int, grad_bytes: int) -> dict[str, Any]:
    """A training step timed ``reps`` times on backend ``backend`` (the slowest rank's
    times), the engines its calls took, and ``local_step`` (the compute alone) timed
    the same way."""
    import torch.distributed as dist
    engines_of = None
    if backend == "ina":
        import ina_collectives.torch.distributed as ina_dist
        engines_of = lambda: ina_dist.stats()["engines"]  # noqa: E731
    before = dict(engines_of()) if engines_of else {}
    times, cpu = timed(step, dist.barrier, torch_slowest, reps)
    engines = ({e: c - before.get(e, 0) for e, c in engines_of().items()
                if c - before.get(e, 0)} if engines_of else {backend: reps + 1})
    compute, _ = timed(local_step, dist.barrier, torch_slowest, reps)
    return {"bytes": grad_bytes, "times": times, "engines": engines, "cpu": cpu,
            "compute_seconds": float(np.median(compute))}


def linear_stack(nbytes: int) -> Any:
    """The training benchmarks' model: 1024 x 1024 linear layers holding about
    ``nbytes`` of float32 parameters (at least one), the same on every rank."""
    import torch
    torch.manual_seed(0)
    layers = max(1, round(nbytes / (4 * (1024 * 1024 + 1024))))
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])


def training_step(model: Any, optimizer: Any, x: Any) -> Callable[[], None]:
    """One step of ``model`` on ``x``: gradients of the output's sum, then the update."""
    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    return step


def ddp(backend: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """One DistributedDataParallel training step per repetition, on torch.distributed's
    backend ``backend`` ("ina" or "gloo"), of a model of about SIZE bytes of float32
    gradients (1024 x 1024 linear layers, DDP's default 25 MB buckets), beside the same
    step without communication (DDP's no_sync): the step time's breakdown."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    if backend == "ina":
        import ina_collectives.torch.distributed  # noqa: F401 - registers "ina"
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:29518",
                            rank=rank, world_size=size)

    records = []
    for nbytes in sizes:
        model = DistributedDataParallel(linear_stack(nbytes))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
        step = training_step(model, optimizer, x)

        def local_step() -> None:
            optimizer.zero_grad()
            with model.no_sync():
                model(x).sum().backward()
            optimizer.step()
        records.append(step_record(backend, step, local_step, reps,
                                   sum(p.numel() * 4 for p in model.parameters())))
    dist.destroy_process_group()
    return records


def fsdp2(backend: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """One FSDP2 training step per repetition (fully_shard per layer over a 1-D
    DeviceMesh), on backend ``backend`` ("ina" or "gloo"), of the same model as ``ddp``:
    each layer's parameters all-gathered for forward and again for backward, its
    gradients reduce-scattered (backend "ina": an allreduce, the switch's above
    switch_min_bytes, of which each rank keeps its rows; the all-gathers MPI's
    allgather). Beside it, the step's compute alone: the same model unsharded, on one
    rank's data, with no communication."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    if backend == "ina":
        import ina_collectives.torch.distributed  # noqa: F401 - registers "ina"
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:29519",
                            rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))

    records = []
    for nbytes in sizes:
        plain, model = linear_stack(nbytes), linear_stack(nbytes)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
        step = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-6), x)
        local_step = training_step(plain, torch.optim.SGD(plain.parameters(), lr=1e-6), x)
        records.append(step_record(backend, step, local_step, reps,
                                   sum(p.numel() * 4 for p in plain.parameters())))
    dist.destroy_process_group()
    return records


def zipf_rows(rows: int, s: float, lookups: int, seed: int) -> np.ndarray:
    """``lookups`` row ids of a table of ``rows``, drawn with P(k-th most popular) ~
    k^-s; the popularity order is one fixed permutation, the same on every rank."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    order = np.random.default_rng(0).permutation(rows)
    draws = np.random.default_rng(seed).random(lookups)
    return order[np.minimum(np.searchsorted(cdf, draws), rows - 1)]


# sparse-ina's periods (sparse_reelect_calls): the warm-up and 2 calls exact, then 3 with
# the hot rows, then the library's choice from the times of both, every 3 calls.
SPARSE_PERIOD = 3


def sparse(system: str, reps: int) -> list[dict[str, Any]]:
    """One embedding gradient exchange per repetition (INA_BENCH_SPARSE: "zipf, lookups,
    rows, dim, hot rows"): each rank's gradient is ``lookups`` rows of a rows x dim
    float32 table drawn from a Zipf law (the ranks' draws differ, each repetition's too).
    sparse-ina: the Horovod API's sparse allreduce with hot rows (SPARSE_PERIOD: tried
    through the switch from the fourth call, then kept or set aside by their times);
    sparse-exact: the same, every row gathered (sparse_hot_rows 0); sparse-gloo:
    torch.distributed gloo's all_reduce of the sparse tensor; sparse-dense: the whole
    table as a dense allreduce through the switch (sparse_as_dense)."""
    import torch
    from mpi4py import MPI
    zipf, lookups, rows, dim, hot_rows = os.environ["INA_BENCH_SPARSE"].split(",")
    zipf, lookups, rows, dim = float(zipf), int(lookups), int(rows), int(dim)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    grads = []
    for step in range(reps + 1):
        index = torch.from_numpy(zipf_rows(rows, zipf, lookups, 1000 * step + rank))
        values = torch.randn(lookups, dim, generator=torch.Generator().manual_seed(step))
        grads.append(torch.sparse_coo_tensor(index.reshape(1, -1), values, (rows, dim),
                                             check_invariants=False))
    steps = iter(range(1 << 30))
    record: dict[str, Any] = {"bytes": rows * dim * 4, "zipf": zipf, "lookups": lookups,
                              "rows": rows, "dim": dim}
    if system == "sparse-gloo":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29520",
                                rank=rank, world_size=comm.Get_size())

        def run() -> None:
            dist.all_reduce(grads[next(steps) % len(grads)].clone())
        times, cpu = timed(run, dist.barrier, torch_slowest, reps)
        dist.destroy_process_group()
        return [{**record, "times": times, "cpu": cpu, "engines": {"gloo": reps + 1}}]
    import ina_collectives.torch as hvd
    hvd.init(comm, switch_min_bytes=0,
             sparse_hot_rows=int(hot_rows) if system == "sparse-ina" else 0,
             sparse_reelect_calls=SPARSE_PERIOD)

    def run() -> None:
        grad = grads[next(steps) % len(grads)]
        if system == "sparse-dense":
            hvd.allreduce(grad.to_dense(), op=hvd.Sum, name="table")
        else:
            hvd.sparse_allreduce_async(grad, name="table", op=hvd.Sum)()
    times, cpu = timed(run, comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), reps)
    stats = hvd.stats()
    hvd.shutdown()
    table = next(iter(stats["sparse"].values()), {})
    return [{**record, "times": times, "cpu": cpu, "engines": stats["engines"],
             **({"hot_share": table["hot_share_of_touched_rows"],
                 "hot_ms": table["median_ms"]["hot"], "exact_ms": table["median_ms"]["exact"],
                 "trials_declined": table["trials_declined"],
                 "bytes_through_allreduce": table["bytes_through_allreduce"] // max(
                     table["calls"], 1),
                 "bytes_gathered": table["bytes_gathered"] // max(table["calls"], 1)}
                if table else {})}]


def hierarchical(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """The hierarchical host allreduce, without pipelining: MPI's reduce-scatter among the
    w ranks of a rack (INA_BENCH_RACK_SIZE, consecutive ranks), MPI's allreduce of each
    1/w share across the racks (one communicator per place in the rack), MPI's allgather
    in the rack. Each phase waits for the one before."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    w = int(os.environ["INA_BENCH_RACK_SIZE"])
    rack = comm.Split(comm.Get_rank() // w, comm.Get_rank())
    across = comm.Split(comm.Get_rank() % w, comm.Get_rank())
    records = []
    for nbytes in sizes:
        count = nbytes // 4
        if count % w:
            raise SystemExit(f"hier: {count} values do not split into {w} shares")
        send = np.ones(count, np.float32)
        recv = np.empty_like(send)
        share = np.empty(count // w, np.float32)

        def run() -> None:
            rack.Reduce_scatter_block(send, share, op=MPI.SUM)
            across.Allreduce(MPI.IN_PLACE, share, op=MPI.SUM)
            rack.Allgather(share, recv)

        resent: list[int] = []
        times, cpu = timed(run, comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), reps,
                           resent, None, [])
        if not (recv == comm.Get_size()).all():
            raise SystemExit(f"hier: wrong allreduce result for {nbytes} bytes")
        records.append({"bytes": nbytes, "times": times, "engines": {"hier": reps + 1},
                        "cpu": cpu,
                        "tcp_retransmits": [int(v) for v in
                                            np.sum(comm.allgather(resent), 0)]})
    rack.Free()
    across.Free()
    return records


def main() -> int:
    system, sizes, reps, out = (sys.argv[1], [int(s) for s in sys.argv[2].split(",")],
                                int(sys.argv[3]), sys.argv[4])
    if system.startswith("ddp-"):
        records = ddp(system.removeprefix("ddp-"), sizes, reps)
        rank = int(os.environ["PMI_RANK"])
    elif system.startswith("fsdp2-"):
        records = fsdp2(system.removeprefix("fsdp2-"), sizes, reps)
        rank = int(os.environ["PMI_RANK"])
    elif system == "gloo":
        records = gloo(sizes, reps)
        rank = int(os.environ["PMI_RANK"])
    elif system.startswith("sparse-"):
        records = sparse(system, reps)
        rank = int(os.environ["PMI_RANK"])
    else:
        records = mpi_systems(system, sizes, reps)
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        for r in records:
            r["seconds"] = float(np.median(r["times"]))
        with open(out, "w") as f:
            json.dump(records, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
