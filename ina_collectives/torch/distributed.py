"""The ``torch.distributed`` backend "ina": DistributedDataParallel through the switch.

    import torch.distributed as dist
    import ina_collectives.torch.distributed   # registers the backend "ina"
    dist.init_process_group("ina")              # ranks started by ina-run or mpiexec
    model = torch.nn.parallel.DistributedDataParallel(model)

Each process group is one communicator of the job's MPI ranks with its own background
runtime (ina_collectives.runtime) that runs the group's collectives in the order the
program issues them, as NCCL and gloo do, with no negotiation: each call is compared
with the others' at its own gate before its data moves (an allreduce the switch serves:
by its identity in the switch; a different shape, dtype or op fails on every rank,
naming each rank's), reduced through the switch where it serves (floats, SUM and AVG)
and exactly elsewhere, and bounded by the group's timeout. Every call returns a Work whose future
completes from the runtime's thread, as DDP's communication hooks need.

The ranks' peer communicator (agreements, exponent exchange, outcome votes, the exact
ring) is MPI's when an MPI launcher started them (ina-run, mpiexec: torch's rank must be
MPI's) and otherwise (torchrun) gloo groups made from the group's own store: no MPI job
is needed. Point-to-point send/recv goes straight over the group's peers (MPI, or gloo
under torchrun), bounded by the group's timeout.

DeviceMesh, DTensor and FSDP2 (``fully_shard``) find their groups by name: torch keeps
that name in a group's per-device C++ backends, which a process group written in Python
cannot have on this torch (its ``Backend`` has no Python constructor), so the group
keeps its own (``group_name``).
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..collectives.ops import Op, as_op, check_quorum
from ..collectives.peers import TorchPeers, started_by_mpi
from ..runtime import world
from ..runtime.background import BackgroundRuntime, Handle
from ..runtime.handle_group import HandleGroup
from ..runtime.negotiation import OpRequest
from ..runtime.p2p import PointToPoint
from ..settings import Settings
from .sparse import check_sparse, submit_sparse
from .staging import (
    check_count,
    check_like,
    check_tensor,
    copy_from,
    data_request,
    direct,
    moved_as,
    reduction_request,
    submit_allreduce,
    to_numpy,
)
from .work import PeerWork, Work, torch_error

BACKEND = "ina"
log = logging.getLogger("ina_collectives")

# torch's reduction ops the runtime computes (by ops.as_op's names; AVG divides exactly,
# as the runtime's Average).
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
_BITWISE = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}

class ProcessGroupIna(dist.ProcessGroup):
    """One torch process group of backend "ina" (its ranks MPI's or torchrun's); see the
    module's docstring."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Sequence[int] | None = None, subgroup: bool = False):
        super().__init__(rank, size)
        comm = _communicator(store, rank, size, timeout, global_ranks)
        seconds = timeout.total_seconds()
        settings = Settings.load()
        # The group's timeout bounds every wait: a peer gone, and a call some ranks
        # never make (reported as a stall naming them).
        settings = dataclasses.replace(
            settings, timeout=min(settings.timeout, seconds),
            stall_shutdown_time=min(settings.stall_shutdown_time, seconds),
            stall_warning_time=min(settings.stall_warning_time, seconds / 2))
        # (A subgroup is a job of its own at the aggregator: an installed job, ina-run's,
        # is the default group's; ina/aggregators.py decides.)
        if not settings.switch and rank == 0 and not subgroup:
            log.warning("backend 'ina': INA_SWITCH names no aggregator: every call takes "
                        "the exact path")
        # torch.distributed's callers make every collective in the same order on every
        # rank: the runtime keeps that order and negotiates nothing (each call is checked
        # at its own gate; runtime/ordered.py).
        self._runtime = BackgroundRuntime(comm, settings, ordered=True)
        self._comm = comm
        self._calls = itertools.count()
        # Point-to-point goes straight over the group's own communicator (the runtime
        # works on a copy of it), completed by threads of its own (runtime/p2p.py).
        self._p2p = PointToPoint(comm, seconds)
        _live_groups.add(self)

    # -- identity ------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # torch keeps a group's name in its per-device backends, and a Python process group
    # has none (torch cannot subclass its Backend in Python): the name lives here, so
    # that DeviceMesh, DTensor and FSDP2, which find groups by name, find this one.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    def stats(self) -> dict[str, Any]:
        """This group's counters: calls, bytes, engines and why, fusion."""
        return self._runtime.stats()

    def shutdown(self) -> None:
        self._close(None)

    def _close(self, grace: float | None) -> None:
        """Stop the group's runtime, waiting for its thread ``grace`` seconds (None: the
        group's timeout and 5), and free its peers."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            self._p2p.close()
            runtime.shutdown(runtime.settings.timeout + 5 if grace is None else grace)
            self._comm.Free()

    # -- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        if op in _BITWISE:
            return self._bitwise_allreduce(tensors, op)
        started = [submit_allreduce(self._live(), check_tensor(t, "all_reduce"), t,
                                    self._name(), op) for t in tensors]
        # A CUDA tensor's future carries its device: whoever waits on it waits on the
        # stream its results were copied back on (torch/windows.py), with no synchronize.
        devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        return self._work([h for h, _ in started], lambda results: [
            finish(r) for (_, finish), r in zip(started, results)], "allreduce", devices)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # One name each; the runtime fuses the ones ready together into one reduction.
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        handles, finishes = [], []
        for t in tensors:
            request = data_request("broadcast", check_tensor(t, "broadcast"), self._name(),
                                   root=root)
            buf = np.array(to_numpy(t), copy=True)
            handles.append(self._live().submit(request, buf=buf))
            finishes.append(_copy_into(t, buf))
        return self._work(handles, lambda results: [f() for f in finishes], "broadcast")

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for outputs in output_tensors:
            check_count(outputs, self.size(), "allgather")
        handles = [self._gather(t) for t in input_tensors]

        def finish(results: list[Any]) -> list[list[torch.Tensor]]:
            for outputs, t, (gathered, _) in zip(output_tensors, input_tensors, results):
                for out, row in zip(outputs, gathered.reshape((len(outputs),) +
                                                              tuple(t.shape))):
                    copy_from(out, row)
            return output_tensors
        return self._work(handles, finish, "allgather")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Any:
        # output_lists[rank][i] takes that rank's input_list[i]: one allgather each.
        check_count(output_lists, self.size(), "all_gather_coalesced")
        for outputs in output_lists:
            check_count(outputs, len(input_list), "all_gather_coalesced (per rank)")
            for out, t in zip(outputs, input_list):
                check_like([out], t, "all_gather_coalesced")
        handles = [self._gather(t) for t in input_list]

        def finish(results: list[Any]) -> list[list[torch.Tensor]]:
            for i, (t, (gathered, _)) in enumerate(zip(input_list, results)):
                rows = gathered.reshape((self.size(),) + tuple(t.shape))
                for outputs, row in zip(output_lists, rows):
                    copy_from(outputs[i], row)
            return output_lists
        return self._work(handles, finish, "all_gather_coalesced")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Any:
        return self.allgather([list(output.view(self.size(), *input.shape).unbind(0))],
                              [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather([list(o.view(self.size(), *i.shape).unbind(0))
                               for o, i in zip(outputs, inputs)], inputs, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # An allgather whose rows the root keeps (the others' outputs are empty lists).
        root = opts.rootRank if opts is not None else 0
        mine = self.rank() == root
        if mine:
            for outputs, t in zip(output_tensors, input_tensors):
                check_count(outputs, self.size(), "gather")
                check_like(outputs, t, "gather")
        handles = [self._gather(t) for t in input_tensors]

        def finish(results: list[Any]) -> list[list[torch.Tensor]]:
            if mine:
                for outputs, t, (gathered, _) in zip(output_tensors, input_tensors, results):
                    rows = gathered.reshape((len(outputs),) + tuple(t.shape))
                    for out, row in zip(outputs, rows):
                        copy_from(out, row)
            return output_tensors
        return self._work(handles, finish, "gather")

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        # The root's rows broadcast, each rank keeping its own: n times the bytes of a
        # point-to-point scatter, for a call DTensor makes once per tensor it shards.
        root = opts.rootRank if opts is not None else 0
        n, me = self.size(), self.rank()
        handles, finishes = [], []
        for j, out in enumerate(output_tensors):
            if me == root:
                check_count(input_tensors[j], n, "scatter")
                check_like(input_tensors[j], out, "scatter")
                stacked = torch.stack([t.detach() for t in input_tensors[j]])
            else:
                stacked = torch.empty((n,) + tuple(check_tensor(out, "scatter").shape),
                                      dtype=out.dtype)
            request = data_request("broadcast", stacked, self._name(), root=root)
            buf = np.array(to_numpy(stacked), copy=True)
            handles.append(self._live().submit(request, buf=buf))
            finishes.append(lambda o=out, b=buf: copy_from(
                o, b.reshape((n,) + tuple(o.shape))[me]))
        return self._work(handles, lambda results: [f() for f in finishes], "scatter")

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = _op_name(opts)
        if op in _BITWISE:
            raise ValueError(f"reduce_scatter with {op} is not supported by backend 'ina'")
        handles, finishes = [], []
        for out, inputs in zip(output_tensors, input_tensors):
            check_count(inputs, self.size(), "reduce_scatter")
            stacked = torch.stack([check_tensor(i, "reduce_scatter").detach() for i in inputs])
            request = reduction_request("reducescatter", stacked, self._name(), op)
            handles.append(self._live().submit(request, send=np.ascontiguousarray(
                to_numpy(stacked, widen=True))))
            finishes.append(lambda result, o=out: copy_from(o, result))
        return self._work(handles, lambda results: [f(r) for f, r in zip(finishes, results)],
                          "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        return self.reduce_scatter([output], [list(input.view(self.size(), *output.shape)
                                                   .unbind(0))], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.reduce_scatter(outputs, [list(i.view(self.size(), *o.shape).unbind(0))
                                             for o, i in zip(outputs, inputs)], opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Any:
        n = self.size()
        splits = list(input_split_sizes) or [input.shape[0] // n] * n
        if sum(splits) != input.shape[0] or len(splits) != n:
            raise ValueError(f"all_to_all_single: input split sizes {splits} must be {n} "
                             f"counts summing to the first dimension {input.shape[0]}")
        request = data_request("alltoall", check_tensor(input, "all_to_all_single"),
                               self._name(), splits=tuple(splits))
        handle = self._live().submit(request, send=np.ascontiguousarray(to_numpy(input)))

        def finish(results: list[Any]) -> list[torch.Tensor]:
            received, counts = results[0]
            expected = list(output_split_sizes) or [output.shape[0] // n] * n
            if counts != expected:
                raise ValueError(f"all_to_all_single: received {counts} rows from the "
                                 f"ranks, the output's split sizes say {expected}")
            copy_from(output, received)
            return [output]
        return self._work([handle], finish, "all_to_all_single")

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        n = self.size()
        check_count(input_tensors, n, "all_to_all")
        check_count(output_tensors, n, "all_to_all")
        if len({tuple(t.shape) for t in [*input_tensors, *output_tensors]}) > 1:
            raise ValueError("all_to_all: backend 'ina' needs tensors of one shape for "
                             "every rank (all_to_all_single takes uneven splits)")
        stacked = torch.stack([check_tensor(t, "all_to_all").detach() for t in input_tensors])
        request = data_request("alltoall", stacked, self._name(), splits=(1,) * n)
        handle = self._live().submit(request, send=np.ascontiguousarray(to_numpy(stacked)))

        def finish(results: list[Any]) -> list[torch.Tensor]:
            received, _ = results[0]
            for out, row in zip(output_tensors, received):
                copy_from(out, row)
            return output_tensors
        return self._work([handle], finish, "all_to_all")

    def barrier(self, opts: Any = None) -> Any:
        request = OpRequest("barrier", self._name(), "none", "uint8")
        return self._work([self._live().submit(request)], lambda results: [], "barrier")

    def set_quorum(self, k: int) -> None:
        """Quorum mode for this group's switch-served calls after this one (every rank
        calls it with the same k; ina_collectives.set_quorum)."""
        check_quorum(k)
        request = OpRequest("quorum", self._name(), "none", "uint8", shape=(int(k),))
        self._work([self._live().submit(request)], lambda results: [], "set_quorum").wait()

    # -- point-to-point ---------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:  # noqa: N803
        (tensor,) = tensors
        self._live()
        data = to_numpy(check_tensor(tensor, "send"))
        return PeerWork(self._p2p.send(data, dstRank, tag), lambda: [tensor])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:  # noqa: N803
        (tensor,) = tensors
        self._live()
        return self._recv(tensor, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        (tensor,) = tensors
        self._live()
        return self._recv(tensor, None, tag)

    def _recv(self, tensor: torch.Tensor, source: int | None, tag: int) -> Any:
        """A receive into ``tensor``: into its own memory where it can, else into a host
        array copied into it once what came is in (``source`` None: from any rank)."""
        check_tensor(tensor, "recv")
        if direct(tensor):
            return PeerWork(self._p2p.recv(to_numpy(tensor), source, tag), lambda: [tensor])
        values = np.empty(tensor.numel(), moved_as(tensor))
        return PeerWork(self._p2p.recv(values, source, tag), lambda: [
            copy_from(tensor, values.reshape(tuple(tensor.shape)))])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # Every rank gets the result, as an allreduce: only the root is required to.
        options = dist.AllreduceOptions()
        options.reduceOp = opts.reduceOp
        return self.allreduce(tensors, options)

    # -- helpers ------------------------------------------------------------------------------

    def _live(self) -> BackgroundRuntime:
        if self._runtime is None:
            raise RuntimeError("the process group of backend 'ina' has been shut down")
        return self._runtime

    def _name(self) -> str:
        # torch issues a group's collectives in one order on every rank: number them,
        # whatever their kind, so that a rank calling another collective is reported
        # as a mismatch rather than waited for.
        return f"c10d.{next(self._calls)}"

    def _gather(self, tensor: torch.Tensor) -> Handle:
        row = check_tensor(tensor, "all_gather").detach().reshape((1,) + tuple(tensor.shape))
        request = data_request("allgather", row, self._name())
        return self._live().submit(request, send=np.ascontiguousarray(to_numpy(row)))

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str) -> Any:
        """Sparse COO tensors, each reduced exactly and replaced by its coalesced result
        (as gloo does): DDP with sparse gradients (torch/sparse.py)."""
        started = [submit_sparse(self._live(), check_sparse(t, op, "all_reduce"),
                                 f"{self._name()}.{i}", op) for i, t in enumerate(tensors)]
        handles = [h for hs, _ in started for h in hs]

        def finish(results: list[Any]) -> list[torch.Tensor]:
            at = 0
            for t, (hs, make) in zip(tensors, started):
                with torch.no_grad():
                    t.copy_(make(results[at:at + len(hs)]))
                at += len(hs)
            return tensors
        return self._work(handles, finish, "sparse allreduce")

    def _bitwise_allreduce(self, tensors: list[torch.Tensor], op: str) -> Any:
        if any(t.is_floating_point() for t in tensors):
            raise ValueError(f"all_reduce with {op} needs integer or bool tensors")
        # (bool tensors go as uint8 0/1, which the bitwise ops keep 0/1)
        handles = [self._gather(t.to(torch.uint8) if t.dtype == torch.bool else t)
                   for t in tensors]

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for t, (gathered, _) in zip(tensors, results):
                copy_from(t, _BITWISE[op].reduce(gathered, axis=0))
            return tensors
        return self._work(handles, finish, f"allreduce {op}")

    def _work(self, handles: list[Handle], complete: Callable[[list[Any]], Any],
              what: str, devices: list[torch.device] | None = None) -> Any:
        """A Work whose future completes (or fails) when every handle has finished
        (``devices``: the CUDA devices its result lives on, for the future's streams)."""
        future: torch.futures.Future = (torch.futures.Future(devices=devices) if devices
                                        else torch.futures.Future())

        def finished(group: HandleGroup) -> None:
            error = group.error()
            if error is not None:
                future.set_exception(torch_error(error, what))
                return
            try:
                future.set_result(complete(group.results()))
            except Exception as exc:  # noqa: BLE001 - reaches the waiter
                future.set_exception(exc)
        group = HandleGroup(handles, what)
        group.add_done_callback(finished)  # (each handle claimed first: names free again)
        return Work(future, group, self._runtime.wait_seconds())


def _communicator(store: Any, rank: int, size: int, timeout: datetime.timedelta,
                  global_ranks: Sequence[int] | None) -> Any:
    """The group's peers: under MPI (ina-run, mpiexec) the MPI communicator of its ranks,
    torch's global rank being MPI's; otherwise (torchrun) gloo groups over its store."""
    if not started_by_mpi():
        return TorchPeers(store, rank, size, timeout)

    world = MPI.COMM_WORLD
    members = list(global_ranks) if global_ranks else list(range(size))
    if world.Get_size() < len(members) or (not global_ranks and (
            world.Get_size(), world.Get_rank()) != (size, rank)):
        raise RuntimeError(
            f"backend 'ina' runs over the job's MPI ranks, but this process is MPI rank "
            f"{world.Get_rank()} of {world.Get_size()} and torch rank {rank} of {size}: "
            f"start the job with ina-run or mpiexec (under torchrun alone there is no MPI "
            f"job yet)")
    if len(members) == world.Get_size():
        return world.Dup()
    group = world.Get_group().Incl(members)
    comm = world.Create_group(group)
    group.Free()
    return comm


def _op_name(opts: Any) -> Op | str:
    """torch's reduce op as the runtime's Op, or the name of a bitwise one."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    if name in _BITWISE:
        return name
    if name not in _OPS:
        raise ValueError(f"backend 'ina' does not support reduce op {name}")
    return as_op(name)


def _copy_into(target: torch.Tensor, buf: np.ndarray) -> Callable[[], torch.Tensor]:
    return lambda: copy_from(target, buf)


def _create(options: Any, backend_options: Any = None) -> ProcessGroupIna:
    # The default group is made while torch.distributed is not initialized yet; any
    # later group is a job of its own at the aggregator.
    return ProcessGroupIna(options.store, options.group_rank, options.group_size,
                           options.timeout, list(options.global_ranks_in_group or []),
                           subgroup=dist.is_initialized())


def default_group() -> ProcessGroupIna | None:
    """torch.distributed's default group if it is of backend "ina", else the group of
    backend "ina" made over its ranks for a communication hook (``companion``), if any."""
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    return _as_ina(pg) or _live_companion(pg)


# Groups of backend "ina" made over another group's ranks (a DDP communication hook's,
# torch/hooks.py), by that group's name: one each, made on first use.
_companions: dict[str, tuple[int, ProcessGroupIna]] = {}  # by name: (id of the group, ours)


def _live_companion(pg: Any) -> ProcessGroupIna | None:
    """The companion made for ``pg`` itself, and not shut down: torch gives a group made
    after a destroyed one the same name."""
    made = _companions.get(_key(pg))
    if made is None or made[0] != id(pg) or made[1]._runtime is None:
        return None
    return made[1]
_companions_lock = threading.Lock()


def _key(pg: Any) -> str:
    return str(getattr(pg, "group_name", None) or id(pg))


def companion(pg: Any) -> tuple[Any, ProcessGroupIna]:
    """A process group of backend "ina" over the ranks of ``pg`` (a group of any backend:
    nccl, gloo, ina): ``pg`` itself if it is one, else one made over its ranks on first
    use (collective over those ranks: each must call this in the same order, as a DDP
    hook's first bucket does) and kept. Returns (the group to pass torch, ours)."""
    ours = _as_ina(pg)
    if ours is not None:
        return pg, ours
    with _companions_lock:
        made = _live_companion(pg)
        if made is None:
            try:
                ranks = dist.get_process_group_ranks(pg)
                group = dist.new_group(ranks=ranks, backend=BACKEND,
                                       use_local_synchronization=True)
            except (RuntimeError, ValueError) as exc:
                raise RuntimeError(f"backend 'ina' cannot serve the ranks of process group "
                                   f"{_key(pg)}: {exc}") from exc
            made = _as_ina(group)
            if made is None:
                raise RuntimeError(f"the group made over process group {_key(pg)}'s ranks "
                                   f"is not of backend 'ina' ({group!r})")
            made._torch_group = group
            _companions[_key(pg)] = (id(pg), made)
    return made._torch_group, made


def _as_ina(pg: Any) -> ProcessGroupIna | None:
    if not isinstance(pg, ProcessGroupIna) and hasattr(pg, "_get_backend"):
        try:
            pg = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
    return pg if isinstance(pg, ProcessGroupIna) else None


def stats(group: Any = None) -> dict[str, Any]:
    """The counters of ``group`` (default: the default process group) of backend ina:
    calls, bytes, engines and why, fusion."""
    pg = _as_ina(group) if group is not None else default_group()
    if pg is None:
        raise ValueError(f"{group or 'the default group'!r} is not a process group of "
                         f"backend 'ina'")
    return pg.stats()


# Groups not yet shut down. A script that ends without destroy_process_group (a rank
# that exits early, a test that skips) otherwise leaves the runtime's and the peers'
# threads running while the interpreter tears down, and gloo's aborted the process.
_live_groups: weakref.WeakSet[ProcessGroupIna] = weakref.WeakSet()
EXIT_GRACE = 5.0  # seconds a group's thread may take to stop at exit (peers may be gone)


def _shutdown_at_exit() -> None:
    for group in list(_live_groups):
        try:
            group._close(EXIT_GRACE)
        except Exception as exc:  # noqa: BLE001 - exiting: say it, go on with the rest
            log.warning("backend 'ina': a group did not shut down at exit: %s", exc)


atexit.register(_shutdown_at_exit)
dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
# The array API's stats() and set_quorum() reach the default group through the runtime.
world.provide_default_group(default_group)

__all__ = ["BACKEND", "ProcessGroupIna", "companion", "default_group", "stats"]
