"""The job's world: its ranks, their topology and the registered process sets.

Framework-neutral: what ``hvd.init()`` starts and ``hvd.shutdown()`` stops, with no tensor
in sight, so that any binding (the Horovod API for PyTorch today) stays a thin layer of
tensor staging over it. One ``World`` per process at most (``start``/``stop``/``require``).

A ``ProcessSet`` names global ranks; once registered (``start(process_sets=[...])`` or
``World.add``, both collective over every rank) it has an id, and every collective takes
it. Each set is its own communicator with its own background runtime, so its reductions
are negotiated, fused and sent to the switch as a job of their own (or take the ring),
independently of the other sets. Roots stay global ranks, as in Horovod; results of
allgather are ordered by rank within the set.

The module also keeps the process's *default group*: each API that starts the library
without ``ina_collectives.init()`` registers a source of it (``provide_default_group``:
the Horovod API's global set, torch.distributed's group of backend "ina" or a DDP hook's,
the first mpi4py ``Intracomm``), so that the array API's ``stats()``, ``summary()`` and
``set_quorum()`` reach that group without knowing the binding.
"""
from __future__ import annotations

import itertools
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ..settings import Settings
from .background import BackgroundRuntime
from .negotiation import OpRequest


class ProcessSet:
    """A set of global ranks that run collectives together.

    Built from a list of ranks or an mpi4py communicator; ``process_set_id`` is set once
    the set is registered and cleared again when it is removed."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any):
        if isinstance(ranks_or_comm, (list, tuple, range, set, frozenset)):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
                raise ValueError(f"ProcessSet takes a list of int ranks or an mpi4py "
                                 f"communicator, got {ranks_or_comm!r}")
            self.ranks = ranks
        else:
            from mpi4py import MPI
            if not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError(f"ProcessSet takes a list of int ranks or an mpi4py "
                                 f"communicator, got {type(ranks_or_comm).__name__}")
            self.mpi_comm = ranks_or_comm

    def size(self) -> int | None:
        """The number of ranks in the set; None while it is not registered."""
        member = _registered(self)
        return None if member is None else len(member.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (-1 if it is not in it); None while the
        set is not registered. Roots of collectives stay global ranks (hvd.rank())."""
        member = _registered(self)
        if member is None:
            return None
        return member.ranks.index(member.own) if member.own in member.ranks else -1

    def included(self) -> bool | None:
        """Whether this process is in the set; None while its ranks are unknown."""
        if self.ranks is None:
            return None
        return require().rank in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class SetMember:
    """One registered set (or a torch.distributed group) as this process sees it."""

    ranks: tuple[int, ...]                 # global ranks, ascending
    own: int                               # this process's global rank
    runtime: BackgroundRuntime | None      # None: this process is not in the set
    comm: Any = None                       # the set's communicator, freed on removal
    names: dict[str, Iterator[int]] = field(default_factory=dict)

    def next_name(self, kind: str) -> str:
        """Horovod's name for an unnamed operation: numbered per kind and per set, so
        that every rank of the set numbers alike."""
        counter = self.names.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def set_rank(self, global_rank: int, what: str) -> int:
        if global_rank not in self.ranks:
            raise ValueError(f"{what}: rank {global_rank} is not in the process set "
                             f"(ranks {list(self.ranks)})")
        return self.ranks.index(global_rank)


@dataclass
class World:
    """The job as ``init`` made it: the global set's runtime, this rank's place in the
    topology, and the registered process sets."""

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
    set_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def open(cls, comm: Any, settings: Settings) -> "World":
        """Collective over ``comm`` (an mpi4py intracommunicator)."""
        from mpi4py import MPI

        runtime = BackgroundRuntime(comm, settings)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross = comm.Split(local.Get_rank(), comm.Get_rank())
        try:
            homogeneous = len(set(comm.allgather(local.Get_size()))) == 1
            everyone = tuple(range(comm.Get_size()))
            # Unnamed operations are numbered per set and per runtime: from 0 again.
            return cls(runtime, comm.Get_rank(), comm.Get_size(), local.Get_rank(),
                       local.Get_size(), cross.Get_rank(), cross.Get_size(), homogeneous,
                       settings, comm.Dup(),
                       {0: SetMember(everyone, comm.Get_rank(), runtime)})
        finally:
            local.Free()
            cross.Free()

    def close(self) -> None:
        """Stop every set's runtime (the others' pending operations fail) and free the
        communicators."""
        for member in reversed(self.sets.values()):
            if member.runtime is not None:
                member.runtime.shutdown(self.settings.timeout + 5)
            if member.comm is not None:
                member.comm.Free()
        self.control.Free()

    # -- the sets ------------------------------------------------------------------------

    @property
    def global_member(self) -> SetMember:
        return self.sets[0]

    def member(self, process_set: Any, what: str) -> SetMember:
        """The registered set this rank runs ``what`` on; a clear error if it cannot."""
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"{what}: process_set must be a ProcessSet (hvd.global_process_set "
                            f"or one from hvd.add_process_set), got "
                            f"{type(process_set).__name__}")
        member = (self.sets.get(process_set.process_set_id)
                  if process_set.process_set_id is not None else None)
        if member is None:
            raise ValueError(f"{what}: {process_set} is not registered (hvd.add_process_set "
                             f"registers it; a removed set cannot be used)")
        if member.runtime is None:
            raise ValueError(f"{what}: rank {self.rank} is not in {process_set}")
        return member

    def add(self, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
        """Register a process set of global ranks and return it. Collective: every rank
        calls it with the same ranks, members or not (ValueError on every rank if they
        differ or the set exists already)."""
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.ranks is None:
            raise NotImplementedError("adding a process set made from an MPI communicator "
                                      "after init: build it from the list of its ranks (or "
                                      "give it to init(process_sets=...))")
        ranks = self._checked_ranks(process_set.ranks, "add_process_set")
        self.agree("add_process_set", list(ranks))
        process_set.process_set_id = self._register(ranks, process_set)
        return process_set

    def remove(self, process_set: ProcessSet) -> bool:
        """Unregister a process set (collective, as add). Returns False for the global set
        or a set that is not registered; pending operations on it fail."""
        set_id = process_set.process_set_id
        if not set_id or set_id not in self.sets:
            return False
        self.agree("remove_process_set", [set_id])
        member = self.sets.pop(set_id)
        process_set.process_set_id = None
        if member.runtime is not None:
            member.runtime.shutdown(self.settings.timeout + 5)
        if member.comm is not None:
            member.comm.Free()
        return True

    def register_at_init(self, process_sets: list[ProcessSet]) -> None:
        """The sets given to init: lists of ranks, alike on every rank, or communicators,
        one per rank (as Horovod: every distinct communicator among the ranks' becomes a
        set, and each rank's ProcessSet object names its own)."""
        from mpi4py import MPI

        world = self.control.Get_group()
        mine = []
        for ps in process_sets:
            if ps.mpi_comm is None:
                mine.append(self._checked_ranks(ps.ranks, "init(process_sets=...)"))
                continue
            group = ps.mpi_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            group.Free()
            if MPI.UNDEFINED in ranks:
                raise ValueError(f"init(process_sets=...): {ps} has processes outside the "
                                 f"communicator init was given")
            mine.append(tuple(sorted(ranks)))
        world.Free()
        every = self._allgather_objects("init.process_sets", mine,
                                        "every rank's process sets given to init")
        if len({len(lists) for lists in every}) > 1:
            raise ValueError(f"init(process_sets=...): ranks gave different numbers of "
                             f"sets: {[len(lists) for lists in every]}")
        for i, ps in enumerate(process_sets):
            seen = [lists[i] for lists in every]
            if ps.mpi_comm is None and len(set(seen)) > 1:
                listed = ", ".join(f"rank {r}: {list(v)}" for r, v in enumerate(seen))
                raise ValueError(f"init(process_sets=...): set {i} differs between ranks: "
                                 f"{listed}")
            for ranks in sorted(set(seen)):
                strays = [q for q in ranks if seen[q] != ranks]
                if strays:
                    raise ValueError(
                        f"init(process_sets=...): set {i} of rank(s) "
                        f"{[q for q in range(self.size) if seen[q] == ranks]} is "
                        f"{list(ranks)}, but rank(s) {strays} gave another")
                set_id = self._register(ranks, ProcessSet(list(ranks)))
                if ranks == seen[self.rank]:
                    ps.process_set_id, ps.ranks = set_id, list(ranks)

    def agree(self, what: str, values: list[int]) -> None:
        """Check, through the global runtime (bounded by its stall timeout), that every
        rank passed the same values; ValueError naming each rank's on every rank if not."""
        request = OpRequest("allgather", self.global_member.next_name(what), "int64",
                            "int64", (len(values),))
        handle = self.runtime.submit(request, send=np.array(values, np.int64))
        gathered, rows = handle.wait(self.runtime.wait_seconds(),
                                     f"every rank to call {what}")
        offsets = np.cumsum([0, *rows]).tolist()
        each = [gathered[offsets[r]:offsets[r + 1]].tolist() for r in range(len(rows))]
        if any(v != each[0] for v in each):
            listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(each))
            raise ValueError(f"{what}: ranks disagree ({listed})")

    def _allgather_objects(self, what: str, obj: Any, waiting_for: str) -> list[Any]:
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        request = OpRequest("allgather", self.global_member.next_name(what), "uint8",
                            "uint8", (payload.size,))
        handle = self.runtime.submit(request, send=payload)
        gathered, rows = handle.wait(self.runtime.wait_seconds(), waiting_for)
        offsets = np.cumsum([0, *rows]).tolist()
        return [pickle.loads(gathered[offsets[r]:offsets[r + 1]].tobytes())
                for r in range(self.size)]

    def _checked_ranks(self, ranks: Sequence[int], what: str) -> tuple[int, ...]:
        ranks = tuple(sorted(ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.size or len(set(ranks)) < len(ranks):
            raise ValueError(f"{what}: ranks {list(ranks)} must be distinct and in "
                             f"0..{self.size - 1}")
        return ranks

    def _register(self, ranks: tuple[int, ...], shown: Any) -> int:
        """Give ``ranks`` (agreed on every rank) an id, and its members a communicator and
        a runtime; returns the id."""
        if any(member.ranks == ranks for member in self.sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {shown}")
        set_id = next(self.set_ids)
        runtime = comm = None
        if self.rank in ranks:
            # Only the members take part; all of them have agreed on the set already.
            group = self.control.Get_group().Incl(list(ranks))
            comm = self.control.Create_group(group, tag=set_id)
            group.Free()
            # (Its own job at the aggregator: the one a controller installed is the
            # global set's; ina/aggregators.py decides.)
            runtime = BackgroundRuntime(comm, self.settings)
        self.sets[set_id] = SetMember(ranks, self.rank, runtime, comm)
        return set_id


# -- the process's world -------------------------------------------------------------------

_world: World | None = None
_lock = threading.Lock()


def start(comm: Any = None, process_sets: list[ProcessSet] | None = None,
          settings: Settings | None = None) -> None:
    """Open the world on ``comm``: None (MPI.COMM_WORLD), a list of COMM_WORLD ranks or an
    mpi4py intracommunicator; then register ``process_sets``. Collective; does nothing if
    the world is open already. A refused set list leaves nothing open."""
    global _world
    with _lock:
        if _world is not None:
            return
        _world = World.open(_communicator(comm), settings or Settings.load())
        global_process_set.ranks = list(range(_world.size))
    if process_sets:
        try:
            _world.register_at_init(process_sets)
        except BaseException:
            stop()
            raise


def stop() -> None:
    """Close the world (idempotent); start may be called again."""
    global _world
    with _lock:
        if _world is None:
            return
        world, _world = _world, None
    world.close()


def current() -> World | None:
    return _world


def require() -> World:
    if _world is None:
        raise ValueError("ina_collectives.torch has not been initialized; use hvd.init()")
    return _world


def _communicator(comm: Any) -> Any:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if comm is None:
        return world
    if isinstance(comm, (list, tuple, range)):
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
        return sub
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"init(comm=...) takes None, a list of ranks or an mpi4py "
                        f"intracommunicator, got {type(comm).__name__}")
    return comm


def _registered(process_set: ProcessSet) -> SetMember | None:
    if _world is None or process_set.process_set_id is None:
        return None
    return _world.sets.get(process_set.process_set_id)


# -- the default group ------------------------------------------------------------------------

class DefaultGroup(Protocol):
    """What the array API asks of a binding's default group."""

    def stats(self) -> dict[str, Any]: ...

    def set_quorum(self, k: int) -> None: ...


_default_sources: list[Callable[[], DefaultGroup | None]] = []


def provide_default_group(source: Callable[[], DefaultGroup | None]) -> None:
    """Register a function that returns a binding's default group, or None while it has
    none (the Horovod API, torch.distributed's backend "ina" and ina_collectives.mpi
    register one when imported; the first source that has a group answers)."""
    if source not in _default_sources:
        _default_sources.append(source)


def default_group() -> DefaultGroup | None:
    """The first default group a registered source returns, or None."""
    for source in _default_sources:
        group = source()
        if group is not None:
            return group
    return None
