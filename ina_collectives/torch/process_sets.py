"""Horovod's process sets: collectives restricted to a subset of the ranks.

A ``ProcessSet`` names global ranks; once registered (``hvd.init(process_sets=[...])`` or
``hvd.add_process_set``, both collective over every rank) it has an id, and every
collective takes it as ``process_set=``. Each set is its own communicator with its own
background runtime, so its reductions are negotiated, fused and sent to the switch as a
job of their own (or take the ring), independently of the other sets. Roots stay global
ranks, as in Horovod; results of allgather are ordered by rank within the set.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ..runtime.background import BackgroundRuntime


class ProcessSet:
    """A set of global ranks that run collectives together.

    Built from a list of ranks; ``process_set_id`` is set once the set is registered and
    cleared again when it is removed."""

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

    def _invalidate(self) -> None:
        self.process_set_id = None

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
        from .mpi_ops import rank
        return rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class SetMember:
    """One registered set as this process sees it."""

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


def _registered(process_set: ProcessSet) -> SetMember | None:
    from . import mpi_ops
    state = mpi_ops._state
    if state is None or process_set.process_set_id is None:
        return None
    return state.sets.get(process_set.process_set_id)
