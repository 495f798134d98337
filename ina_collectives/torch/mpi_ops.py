"""Horovod's tensor operations on PyTorch tensors, over the background runtime.

Tensors become NumPy views where they can (CPU, contiguous, a NumPy dtype); bfloat16,
non-contiguous and CUDA tensors are staged through a host copy (bfloat16 reduces as
float32, exactly widened, and is rounded back once). Every async call returns an int
handle for ``poll``/``synchronize``; the synchronous calls are autograd Functions.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import CollectiveTimeout, InaError, OperationError, OperationTimeout
from ..errors import OperationError as HorovodInternalError
from ..runtime.background import BackgroundRuntime, Handle
from ..runtime.negotiation import OpRequest
from ..settings import Settings
from .compression import SWITCH_BITS, Compression, Compressor, switch_values
from .process_sets import ProcessSet, SetMember, global_process_set

# Reduction ops, compared by value like Horovod's.
Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"
_OPS = (Average, Sum, Min, Max, Product)

# What each supported dtype moves as (bfloat16 has no NumPy dtype: it is staged).
_WIRE = {torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
         torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
         torch.float32: "float32", torch.float64: "float64"}
SUPPORTED_DTYPES = tuple(_WIRE) + (torch.bfloat16,)


@dataclass
class _State:
    runtime: BackgroundRuntime
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    settings: Settings
    control: Any                      # our copy of init's communicator: sets are made on it
    sets: dict[int, SetMember]        # by process set id; 0 is the global set
    set_ids: Any = None               # the next ids, alike on every rank


_state: _State | None = None
_init_lock = threading.Lock()
_handles: dict[int, "_Pending"] = {}
_handle_ids = itertools.count(1)


# -- start and stop ----------------------------------------------------------------------

def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None,
         **settings: Any) -> None:
    """Start the runtime on ``comm``: None (MPI.COMM_WORLD), a list of COMM_WORLD ranks,
    or an mpi4py communicator. Collective over that communicator (a list: over
    COMM_WORLD). ``process_sets``: ProcessSets to register now (every rank passes the
    same list), or "dynamic" (accepted: sets can always be added later). Idempotent: a
    second call while initialized does nothing. Keyword arguments are library settings
    (``ina_collectives.Settings``)."""
    global _state
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                raise TypeError(f"init(process_sets=...) takes ProcessSet objects, got "
                                f"{type(ps).__name__}")
    elif process_sets not in (None, "dynamic"):
        raise ValueError(f"init(process_sets={process_sets!r}): give a list of ProcessSet "
                         f"or 'dynamic'")
    with _init_lock:
        if _state is not None:
            return
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if comm is None:
            comm = world
        elif isinstance(comm, (list, tuple, range)):
            ranks = [int(r) for r in comm]
            if sorted(set(ranks)) != sorted(ranks) or any(
                    not 0 <= r < world.Get_size() for r in ranks):
                raise ValueError(f"init(comm={ranks}): ranks must be distinct and in "
                                 f"0..{world.Get_size() - 1}")
            group = world.Get_group().Incl(ranks)
            sub = world.Create(group)
            group.Free()
            if sub == MPI.COMM_NULL:
                raise ValueError(f"init(comm={ranks}): this process (COMM_WORLD rank "
                                 f"{world.Get_rank()}) is not one of those ranks")
            comm = sub
        elif not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"init(comm=...) takes None, a list of ranks or an mpi4py "
                            f"intracommunicator, got {type(comm).__name__}")
        loaded = Settings.load({**_horovod_environment(), **settings})
        runtime = BackgroundRuntime(comm, loaded)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross = comm.Split(local.Get_rank(), comm.Get_rank())
        homogeneous = len(set(comm.allgather(local.Get_size()))) == 1
        everyone = tuple(range(comm.Get_size()))
        # Unnamed operations are numbered per set and per runtime: from 0 again.
        _state = _State(runtime, comm.Get_rank(), comm.Get_size(), local.Get_rank(),
                        local.Get_size(), cross.Get_rank(), cross.Get_size(), homogeneous,
                        loaded, comm.Dup(),
                        {0: SetMember(everyone, comm.Get_rank(), runtime)},
                        itertools.count(1))
        global_process_set.ranks = list(everyone)
        local.Free()
        cross.Free()
    if isinstance(process_sets, list):
        try:
            _register_at_init(process_sets)
        except BaseException:
            shutdown()  # as Horovod: a refused init leaves nothing initialized
            raise


def _horovod_environment() -> dict[str, Any]:
    """Horovod's variables for the settings it shares, where no INA_* one is set."""
    env, found = os.environ, {}
    pairs = [("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", int),
             ("cycle_time", "HOROVOD_CYCLE_TIME", lambda v: float(v) / 1000.0),
             ("stall_warning_time", "HOROVOD_STALL_CHECK_TIME_SECONDS", float),
             ("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float)]
    for name, variable, parse in pairs:
        if f"INA_{name.upper()}" not in env and variable in env:
            try:
                found[name] = parse(env[variable])
            except ValueError:
                raise ValueError(f"{variable}: cannot read {env[variable]!r}") from None
    return found


def shutdown() -> None:
    """Stop the background thread (on every rank: the others' pending operations fail)
    and free the communicator. Idempotent; init() may be called again."""
    global _state
    with _init_lock:
        if _state is None:
            return
        state, _state = _state, None
    for member in reversed(state.sets.values()):
        if member.runtime is not None:
            member.runtime.shutdown(state.settings.timeout + 5)
        if member.comm is not None:
            member.comm.Free()
    state.control.Free()
    _handles.clear()


atexit.register(shutdown)  # registered after mpi4py's finalize, so it runs before it


def is_initialized() -> bool:
    return _state is not None


# -- process sets ------------------------------------------------------------------------

def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set of global ranks and return it. Collective: every rank
    calls it with the same ranks, members or not (ValueError on every rank if they
    differ or the set exists already)."""
    _require()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("adding a process set made from an MPI communicator after "
                                  "init: build it from the list of its ranks (or give it "
                                  "to init(process_sets=...))")
    ranks = _checked_ranks(process_set.ranks, "add_process_set")
    _agree("add_process_set", list(ranks))
    process_set.process_set_id = _register_set(ranks, process_set)
    return process_set


def _checked_ranks(ranks: Sequence[int], what: str) -> tuple[int, ...]:
    size = _require().size
    ranks = tuple(sorted(ranks))
    if not ranks or ranks[0] < 0 or ranks[-1] >= size or len(set(ranks)) < len(ranks):
        raise ValueError(f"{what}: ranks {list(ranks)} must be distinct and in "
                         f"0..{size - 1}")
    return ranks


def _register_set(ranks: tuple[int, ...], shown: Any) -> int:
    """Give ``ranks`` (agreed on every rank) an id, and its members a communicator and a
    runtime; returns the id."""
    state = _require()
    if any(member.ranks == ranks for member in state.sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {shown}")
    set_id = next(state.set_ids)
    runtime = comm = None
    if state.rank in ranks:
        # Only the members take part; all of them have agreed on the set already.
        group = state.control.Get_group().Incl(list(ranks))
        comm = state.control.Create_group(group, tag=set_id)
        group.Free()
        # Its own job at the aggregator: the one a controller installed is the global set's.
        runtime = BackgroundRuntime(comm, dataclasses.replace(state.settings, job=0,
                                                              worker_ports=""))
    state.sets[set_id] = SetMember(ranks, state.rank, runtime, comm)
    return set_id


def _register_at_init(process_sets: list[ProcessSet]) -> None:
    """The sets given to init: lists of ranks, alike on every rank, or communicators, one
    per rank (as Horovod: every distinct communicator among the ranks' becomes a set, and
    each rank's ProcessSet object names its own)."""
    from mpi4py import MPI

    state = _require()
    world = state.control.Get_group()
    mine = []
    for ps in process_sets:
        if ps.mpi_comm is None:
            mine.append(_checked_ranks(ps.ranks, "init(process_sets=...)"))
            continue
        group = ps.mpi_comm.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
        group.Free()
        if MPI.UNDEFINED in ranks:
            raise ValueError(f"init(process_sets=...): {ps} has processes outside the "
                             f"communicator init was given")
        mine.append(tuple(sorted(ranks)))
    world.Free()
    handle = state.runtime.submit(OpRequest(
        "allgather", _global().next_name("init.process_sets"), "uint8", "uint8",
        (len(pickle.dumps(mine)),)), send=np.frombuffer(pickle.dumps(mine), np.uint8))
    gathered, rows = handle.wait(state.runtime.wait_seconds(),
                                 "every rank's process sets given to init")
    offsets = np.cumsum([0, *rows]).tolist()
    every = [pickle.loads(gathered[offsets[r]:offsets[r + 1]].tobytes())
             for r in range(state.size)]
    if len({len(lists) for lists in every}) > 1:
        raise ValueError(f"init(process_sets=...): ranks gave different numbers of sets: "
                         f"{[len(lists) for lists in every]}")
    for i, ps in enumerate(process_sets):
        seen = [lists[i] for lists in every]
        if ps.mpi_comm is None and len(set(seen)) > 1:
            raise ValueError(f"init(process_sets=...): set {i} differs between ranks: "
                             f"{', '.join(f'rank {r}: {list(v)}' for r, v in enumerate(seen))}")
        for ranks in sorted(set(seen)):
            strays = [q for q in ranks if seen[q] != ranks]
            if strays:
                raise ValueError(f"init(process_sets=...): set {i} of rank(s) "
                                 f"{[q for q in range(state.size) if seen[q] == ranks]} is "
                                 f"{list(ranks)}, but rank(s) {strays} gave another")
            set_id = _register_set(ranks, ProcessSet(list(ranks)))
            if ranks == seen[state.rank]:
                ps.process_set_id, ps.ranks = set_id, list(ranks)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective, as add_process_set). Returns False for the
    global set or a set that is not registered; pending operations on it fail."""
    state = _require()
    set_id = process_set.process_set_id
    if not set_id or set_id not in state.sets:
        return False
    _agree("remove_process_set", [set_id])
    member = state.sets.pop(set_id)
    process_set._invalidate()
    if member.runtime is not None:
        member.runtime.shutdown(state.settings.timeout + 5)
    if member.comm is not None:
        member.comm.Free()
    return True


def _agree(what: str, values: list[int]) -> None:
    """Check, through the global runtime (bounded by its stall timeout), that every rank
    passed the same values; ValueError naming each rank's on every rank if not."""
    runtime = _require().runtime
    array = np.array(values, np.int64)
    request = OpRequest("allgather", _global().next_name(what), "int64", "int64",
                        (len(values),))
    handle = runtime.submit(request, send=array)
    gathered, rows = handle.wait(runtime.wait_seconds(), f"every rank to call {what}")
    offsets = np.cumsum([0, *rows]).tolist()
    each = [gathered[offsets[r]:offsets[r + 1]].tolist() for r in range(len(rows))]
    if any(v != each[0] for v in each):
        listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(each))
        raise ValueError(f"{what}: ranks disagree ({listed})")


def _global() -> SetMember:
    return _require().sets[0]


def _member(process_set: Any, what: str) -> SetMember:
    """The registered set this rank runs ``what`` on; a clear error if it cannot."""
    state = _require()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet (hvd.global_process_set "
                        f"or one from hvd.add_process_set), got {type(process_set).__name__}")
    member = (state.sets.get(process_set.process_set_id)
              if process_set.process_set_id is not None else None)
    if member is None:
        raise ValueError(f"{what}: {process_set} is not registered (hvd.add_process_set "
                         f"registers it; a removed set cannot be used)")
    if member.runtime is None:
        raise ValueError(f"{what}: rank {state.rank} is not in {process_set}")
    return member


def _require() -> _State:
    if _state is None:
        raise ValueError("ina_collectives.torch has not been initialized; use hvd.init()")
    return _state


def size() -> int:
    return _require().size


def rank() -> int:
    return _require().rank


def local_size() -> int:
    return _require().local_size


def local_rank() -> int:
    return _require().local_rank


def cross_size() -> int:
    return _require().cross_size


def cross_rank() -> int:
    return _require().cross_rank


def mpi_threads_supported() -> bool:
    """Whether MPI runs with THREAD_MULTIPLE. Like Horovod, only after init()."""
    _require()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return _require().homogeneous


# What this library is built with, under Horovod's names: MPI is its controller and
# transport; it has no Gloo controller and no GPU (NCCL, CUDA, ROCm), DDL or oneCCL code.

def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: Horovod returns the NCCL version code here, or 0 without NCCL."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def stats(process_set: ProcessSet = global_process_set) -> dict[str, Any]:
    """Calls, bytes and engines of the set's reductions so far, and fusion counters."""
    return _member(process_set, "stats").runtime.stats()


# -- handles -------------------------------------------------------------------------------

@dataclass
class _Pending:
    handles: list[Handle]
    complete: Callable[[list[Any]], Any]   # the runtime's results -> what synchronize returns
    what: str


def _register(handles: list[Handle], complete: Callable[[list[Any]], Any], what: str) -> int:
    handle_id = next(_handle_ids)
    _handles[handle_id] = _Pending(handles, complete, what)
    return handle_id


def poll(handle: int) -> bool:
    """True once the operation of ``handle`` has finished (synchronize will not wait)."""
    try:
        pending = _handles[handle]
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    return all(h.done() for h in pending.handles)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output. Raises the operation's
    error (RuntimeError: ranks disagreed, it stalled, a peer died) on every rank."""
    try:
        pending = _handles.pop(handle)
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    runtime = _require().runtime
    results, errors = [], []
    deadline = time.monotonic() + runtime.wait_seconds()
    for h in pending.handles:  # every one, so that each name is free again
        try:
            results.append(h.wait(max(deadline - time.monotonic(), 0.0), pending.what))
        except InaError as exc:
            errors.append(exc)
    if errors:
        if isinstance(errors[0], OperationError):
            raise errors[0]
        # Horovod raises HorovodInternalError for every failure of an operation.
        kind = OperationTimeout if isinstance(errors[0], CollectiveTimeout) else OperationError
        raise kind(f"{pending.what} failed: {errors[0]}") from errors[0]
    return pending.complete(results)


# -- argument checks and staging ----------------------------------------------------------------

def _op_of(op: Any, average: bool | None, default: str = Average) -> str:
    if average is not None:
        if op is not None:
            raise ValueError("give op or the deprecated average, not both")
        return Average if average else Sum
    if op is None:
        return default
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by ina_collectives; use "
                                  "Average or Sum")
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; expected one of hvd.Average, hvd.Sum, hvd.Min, "
                         f"hvd.Max, hvd.Product")
    return op


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; supported: "
                        f"{', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported")
    return tensor


def _name(kind: str, name: str | None, member: SetMember) -> str:
    if name is None:
        return member.next_name(kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _direct(tensor: torch.Tensor) -> bool:
    """Whether the tensor's own memory can be handed to the runtime as a NumPy array."""
    return (tensor.device.type == "cpu" and tensor.dtype in _WIRE
            and tensor.is_contiguous())


def _numpy(tensor: torch.Tensor, widen: bool = False) -> np.ndarray:
    """A flat NumPy array of the tensor's values: its own memory where _direct, else a
    host copy (bfloat16 as float32 if ``widen``, else as its raw 16 bits)."""
    t = tensor.detach()
    if _direct(t):
        return t.numpy().reshape(-1)
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return (t.float() if widen else t.view(torch.int16)).numpy().reshape(-1)
    return t.numpy().reshape(-1)


def _from_numpy(array: np.ndarray, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``like``'s dtype and device holding ``array``'s values."""
    t = torch.from_numpy(array)
    if like.dtype == torch.bfloat16:
        t = t.view(torch.bfloat16) if array.dtype == np.int16 else t.to(torch.bfloat16)
    return t.reshape(tuple(shape)).to(like.device)


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: str,
                     prescale: float, postscale: float, member: SetMember
                     ) -> tuple[Handle, Callable]:
    """Submit; returns the runtime handle and the step that finishes ``output``."""
    _check_tensor(tensor, "allreduce")
    runtime = member.runtime
    wire = "float32" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    request = OpRequest("allreduce", _name("allreduce", name, member), _dtype_name(tensor),
                        wire, tuple(tensor.shape), op, prescale=float(prescale),
                        postscale=float(postscale), switch_bits=SWITCH_BITS.get())
    if output is tensor and _direct(tensor):
        handle = runtime.submit(request, send=None, recv=_numpy(tensor))
        return handle, lambda _: output
    if _direct(output) and output.dtype == tensor.dtype:
        handle = runtime.submit(request, send=_numpy(tensor), recv=_numpy(output))
        return handle, lambda _: output
    staged = np.array(_numpy(tensor, widen=True), copy=True)
    handle = runtime.submit(request, send=None, recv=staged)

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(_from_numpy(staged, output, output.shape))
        return output
    return handle, copy_back


def _submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, name: str | None,
                      op: str, prescale: float, postscale: float,
                      process_set: ProcessSet) -> int:
    member = _member(process_set, "allreduce")
    handle, finish = _allreduce_async(tensor, output, name, op, prescale, postscale, member)
    return _register([handle], lambda results: finish(results[0]),
                     f"allreduce '{handle.request.name}' on all ranks")


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over the ranks of ``process_set`` into a new tensor;
    returns a handle. The default op is Average. The input is not modified."""
    _check_tensor(tensor, "allreduce")
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit_allreduce(tensor, output, name, _op_of(op, average), prescale_factor,
                             postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place allreduce_async: the result replaces ``tensor``'s values."""
    _check_tensor(tensor, "allreduce")
    return _submit_allreduce(tensor, tensor, name, _op_of(op, average), prescale_factor,
                             postscale_factor, process_set)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str,
                prescale: float, postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        ctx.process_set = process_set
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale,
                                           process_set=process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # As Horovod: the gradient of an allreduce is the same allreduce of the gradient.
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale,
                          postscale_factor=ctx.postscale, process_set=ctx.process_set),
                None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` (Average by default); returns a
    new tensor. Gradients flow: the gradient of an allreduce is the allreduce of the
    gradient."""
    op = _op_of(op, average)
    _check_tensor(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    with switch_values(compression):
        reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor,
                                           postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
             name: str | None, op: str, prescale: float, postscale: float,
             process_set: ProcessSet) -> int:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    member = _member(process_set, "grouped_allreduce")
    base = _name("allreduce", name, member)
    started = [_allreduce_async(t, o, f"{base}.{i}", op, prescale, postscale, member)
               for i, (t, o) in enumerate(zip(tensors, outputs))]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped allreduce '{base}' ({len(tensors)} tensors) on all ranks")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors together (fused into one reduction where they fit
    the fusion threshold); synchronize returns the list of new tensors."""
    tensors = [_check_tensor(t, "grouped_allreduce") for t in tensors]
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped(tensors, outputs, name, _op_of(op, average), prescale_factor,
                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    tensors = [_check_tensor(t, "grouped_allreduce") for t in tensors]
    return _grouped(tensors, tensors, name, _op_of(op, average), prescale_factor,
                    postscale_factor, process_set)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allreduce_async(
            tensors, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.prescale,
                                    postscale_factor=ctx.postscale,
                                    process_set=ctx.process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors together; returns new tensors. Gradients flow."""
    op = _op_of(op, average)
    pairs = [compression.compress(_check_tensor(t, "grouped_allreduce")) for t in tensors]
    with switch_values(compression):
        reduced = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor,
                                                  process_set, *[t for t, _ in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------------------

def _data_request(kind: str, tensor: torch.Tensor, name: str | None, member: SetMember,
                  **fields: Any) -> OpRequest:
    _check_tensor(tensor, kind)
    wire = "int16" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    return OpRequest(kind, _name(kind, name, member), _dtype_name(tensor), wire,
                     tuple(tensor.shape), **fields)


def _allgather_submit(tensor: torch.Tensor, name: str | None, member: SetMember
                      ) -> tuple[Handle, Callable]:
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it "
                         "concatenates along the first)")
    request = _data_request("allgather", tensor, name, member)
    handle = member.runtime.submit(request, send=_numpy(tensor))
    return handle, lambda result: _from_numpy(result[0], tensor, result[0].shape)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating the ranks' ``tensor`` (in rank order within ``process_set``)
    along the first dimension, which may differ per rank; returns a handle."""
    handle, finish = _allgather_submit(tensor, name, _member(process_set, "allgather"))
    return _register([handle], lambda results: finish(results[0]),
                     f"allgather '{handle.request.name}' on all ranks")


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list; synchronize returns the list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    member = _member(process_set, "grouped_allgather")
    base = _name("allgather", name, member)
    started = [_allgather_submit(t, f"{base}.{i}", member) for i, t in enumerate(tensors)]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped allgather '{base}' ({len(tensors)} tensors) on all ranks")


def _gathered_slice(grads: list[torch.Tensor], rows: list[int], process_set: ProcessSet
                    ) -> list[torch.Tensor]:
    """Horovod's allgather gradient: the average over the set of each output's gradient,
    then this rank's rows of it (every rank's row counts gathered again, as Horovod)."""
    reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                process_set=process_set)
    counts = grouped_allgather([torch.tensor([r], dtype=torch.int32) for r in rows],
                               process_set=process_set)
    index = process_set.rank()
    return [g.narrow(0, int(c[:index].sum()), r) for g, c, r in zip(reduced, counts, rows)]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
                ) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gathered_slice([grad], [ctx.rows], ctx.process_set)[0], None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The ranks' ``tensor`` concatenated along the first dimension. Gradients flow."""
    return _AllgatherFunction.apply(tensor, name, process_set)


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
                ) -> tuple:
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, *_gathered_slice(list(grads), ctx.rows, ctx.process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list; returns the list. Gradients flow."""
    return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_submit(tensor: torch.Tensor, output: torch.Tensor, root_rank: int,
                      name: str | None, process_set: ProcessSet) -> int:
    _check_tensor(tensor, "broadcast")
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    member = _member(process_set, "broadcast")
    # The runtime numbers ranks within the set; Horovod's root is a global rank.
    root = (member.set_rank(root_rank, "broadcast") if process_set.process_set_id
            else root_rank)
    request = _data_request("broadcast", tensor, name, member, root=root)
    if output is tensor and _direct(tensor):
        handle = member.runtime.submit(request, buf=_numpy(tensor))
        return _register([handle], lambda _: output, f"broadcast '{request.name}'")
    buf = np.array(_numpy(tensor), copy=True)
    handle = member.runtime.submit(request, buf=buf)

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(_from_numpy(buf, output, output.shape))
        return output
    return _register([handle], copy_back, f"broadcast '{request.name}' from rank {root_rank}")


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying root_rank's ``tensor`` into a new tensor on every rank."""
    _check_tensor(tensor, "broadcast")
    return _broadcast_submit(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` on every rank with root_rank's."""
    return _broadcast_submit(tensor, tensor, root_rank, name, process_set)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # As Horovod: the set's average gradient reaches the root, zeros the others.
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """root_rank's ``tensor`` on every rank, as a new tensor. Gradients flow."""
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------

def _alltoall_submit(tensor: torch.Tensor, splits: Any, name: str | None,
                     process_set: ProcessSet) -> int:
    """Submit; synchronize returns (output, received_splits)."""
    _check_tensor(tensor, "alltoall")
    member = _member(process_set, "alltoall")
    n = len(member.ranks)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall: the first dimension {tensor.shape[0]} does not "
                             f"divide into {n} equal parts; give splits")
        parts = [tensor.shape[0] // n] * n
    else:
        parts = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor)
                                  else splits)]
        if len(parts) != n or any(p < 0 for p in parts) or sum(parts) != tensor.shape[0]:
            raise ValueError(f"alltoall: splits {parts} must be {n} non-negative counts "
                             f"summing to the first dimension {tensor.shape[0]}")
    request = _data_request("alltoall", tensor, name, member, splits=tuple(parts))
    handle = member.runtime.submit(request, send=_numpy(tensor))

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        return (_from_numpy(out, tensor, out.shape),
                torch.tensor(received, dtype=torch.int32))
    return _register([handle], finish, f"alltoall '{request.name}' on all ranks")


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` first-dimension rows of ``tensor`` to the set's i-th
    rank (equal parts if None); synchronize returns (output, received_splits)."""
    return _alltoall_submit(tensor, splits, name, process_set)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> Any:
        output, received = synchronize(_alltoall_submit(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        # Rows travel back to where they came from.
        returned, _ = alltoall(grad.contiguous(), splits=ctx.received,
                               process_set=ctx.process_set)
        return returned, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows of ``tensor`` to the ranks and gather theirs. As Horovod: returns the
    output alone when ``splits`` is None (equal parts), else (output, received_splits).
    Gradients flow."""
    return _AlltoallFunction.apply(tensor, splits, name, process_set)


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_submit(tensor: torch.Tensor, name: str, op: str, prescale: float,
                          postscale: float, member: SetMember) -> tuple[Handle, Callable]:
    _check_tensor(tensor, "reducescatter")
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports hvd.Average and hvd.Sum, not {op!r}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    wire = "float32" if tensor.dtype == torch.bfloat16 else _WIRE[tensor.dtype]
    request = OpRequest("reducescatter", name, _dtype_name(tensor), wire,
                        tuple(tensor.shape), op, prescale=float(prescale),
                        postscale=float(postscale))
    handle = member.runtime.submit(request, send=_numpy(tensor, widen=True))
    return handle, lambda result: _from_numpy(result, tensor, result.shape)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set's ranks (Average by default) and keeping
    this rank's part of the first dimension (split as torch.tensor_split does)."""
    member = _member(process_set, "reducescatter")
    handle, finish = _reducescatter_submit(tensor, _name("reducescatter", name, member),
                                           _op_of(op, None), prescale_factor,
                                           postscale_factor, member)
    return _register([handle], lambda results: finish(results[0]),
                     f"reducescatter '{handle.request.name}' on all ranks")


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of a list; synchronize returns the list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_reducescatter needs at least one tensor")
    member = _member(process_set, "grouped_reducescatter")
    base, op = _name("reducescatter", name, member), _op_of(op, None)
    started = [_reducescatter_submit(t, f"{base}.{i}", op, prescale_factor,
                                     postscale_factor, member) for i, t in enumerate(tensors)]
    return _register([h for h, _ in started],
                     lambda results: [finish(r) for (_, finish), r in zip(started, results)],
                     f"grouped reducescatter '{base}' ({len(tensors)} tensors) on all ranks")


def _scattered_grads(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Horovod's reducescatter gradient: each output's gradient times the set's size for
    Sum and times the scale factors, gathered back along the first dimension."""
    factor = (len(ctx.process_set.ranks or []) if ctx.op == Sum else 1) * ctx.prescale * \
        ctx.postscale
    scaled = [g.contiguous() * factor if factor != 1 else g.contiguous() for g in grads]
    return grouped_allgather(scaled, process_set=ctx.process_set)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str,
                process_set: ProcessSet, prescale: float, postscale: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.prescale, ctx.postscale = (op, process_set, prescale,
                                                                postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _scattered_grads(ctx, [grad])[0], None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0
                  ) -> torch.Tensor:
    """Reduce over the set's ranks and keep this rank's rows. Gradients flow."""
    compressed, ctx = compression.compress(_check_tensor(tensor, "reducescatter"))
    reduced = _ReducescatterFunction.apply(compressed, name, _op_of(op, None), process_set,
                                           prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, process_set: ProcessSet,
                prescale: float, postscale: float, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.process_set, ctx.prescale, ctx.postscale = (op, process_set, prescale,
                                                                postscale)
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, *_scattered_grads(ctx, grads))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0
                          ) -> list[torch.Tensor]:
    """A reducescatter of each tensor of a list; returns the list. Gradients flow."""
    pairs = [compression.compress(_check_tensor(t, "grouped_reducescatter"))
             for t in tensors]
    reduced = _GroupedReducescatterFunction.apply(name, _op_of(op, None), process_set,
                                                  prescale_factor, postscale_factor,
                                                  *[t for t, _ in pairs])
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, pairs)]


# -- what is out of scope, named --------------------------------------------------------------

def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> int:
    """Not supported: sparse tensors have no path to the switch here."""
    raise NotImplementedError("sparse allreduce is not implemented by ina_collectives; "
                              "reduce tensor.to_dense() with allreduce_async instead")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not supported: ina_collectives writes no Horovod timeline (its counters are in
    stats())."""
    raise NotImplementedError("the Horovod timeline is not implemented by ina_collectives; "
                              "hvd.stats() reports the calls, engines and fusion")


def stop_timeline() -> None:
    raise NotImplementedError("the Horovod timeline is not implemented by ina_collectives")


# -- barrier and join ------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    member = _member(process_set, "barrier")
    request = OpRequest("barrier", _name("barrier", None, member), "none", "uint8")
    handle = member.runtime.submit(request)
    synchronize(_register([handle], lambda _: None, "every rank to reach the barrier"))


def set_quorum(k: int, process_set: ProcessSet = global_process_set) -> None:
    """Quorum mode for the allreduces submitted after this call (every rank calls it with
    the same k): the switch completes each chunk when k workers contributed, so a
    straggler does not set the pace; a worker left out of a chunk has its gradient
    dropped for that step, and Average divides by the workers counted. 0: sync.
    ``stats()["switch"]["quorum"]`` says which ranks the last call left out
    (docs/quorum.md)."""
    from ..collectives.quorum import Quorum

    Quorum.check(k)
    member = _member(process_set, "set_quorum")
    request = OpRequest("quorum", _name("set_quorum", None, member), "none", "uint8",
                        shape=(int(k),))
    handle = member.runtime.submit(request)
    synchronize(_register([handle], lambda _: None, "every rank to set the quorum"))


def join(device: int = -1) -> int:
    """This rank has no more batches: until every rank has joined, it takes part in the
    others' allreduces with zeros. Returns the rank that joined last."""
    runtime = _require().runtime
    handle = runtime.join()
    return handle.wait(runtime.wait_seconds(), "every rank to join")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "stats", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
    "set_quorum",
    "synchronize", "sparse_allreduce_async", "start_timeline", "stop_timeline",
]
