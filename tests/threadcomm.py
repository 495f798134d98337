"""Multi-rank unit tests in one process: a communicator per thread, with the part of
mpi4py's Intracomm the library calls (Get_rank, Get_size, Dup, Free; Iallreduce,
Iallgather, Iallgatherv, Ibcast, Ibarrier and their blocking forms; the lowercase object
forms allreduce, allgather and bcast; Split, Split_type, Get_group and Create_group), so
that a collective path runs at n = 2-4 with no launcher:

    results = run_ranks(3, lambda comm: repair_share(comm, ...))

Each rank's k-th collective meets the others' k-th (as MPI matches them, by order on a
communicator). A request completes, in Test() or Wait(), once every rank has made the
call; each rank then computes the result from copies of every rank's contribution taken
when it made the call. A rank that never makes a call leaves the others' requests open:
their bounded waits (collectives.waiting.wait) end with CollectiveTimeout, as with MPI.
A rank that raises is reported by run_ranks, with its rank, after the others end.
A rank that calls ``stop()`` is a process frozen there: none of its later calls, on this
communicator or any made from it, reaches the others (nor completes on it).

``ThreadPeers`` is the same communicator seen by the library as a job's peers without
MPI (``collectives.peers.TorchPeers``, what torchrun's ranks use): ``Collectives`` and
``BackgroundRuntime`` take it as they take gloo's, so their thread and their engines run
in one process. As with gloo's, the ring declines (it polls point-to-point messages this
communicator does not carry) and the exact engine is the peers' own allreduce ("gloo").
"""
from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ina_collectives.collectives.peers import TorchPeers

_REDUCE = [(MPI.SUM, np.add), (MPI.PROD, np.multiply), (MPI.MIN, np.minimum),
           (MPI.MAX, np.maximum), (MPI.BAND, np.bitwise_and), (MPI.BOR, np.bitwise_or),
           (MPI.BXOR, np.bitwise_xor), (MPI.LAND, np.logical_and),
           (MPI.LOR, np.logical_or)]


def _ufunc(op: Any) -> np.ufunc:
    for mpi_op, ufunc in _REDUCE:
        if op == mpi_op:  # (MPI.Op objects are not hashable)
            return ufunc
    raise ValueError(f"the thread communicator has no reduction for {op}")


def _array(spec: Any) -> tuple[np.ndarray, list[int] | None, list[int] | None]:
    """An mpi4py buffer spec as used by the library: an array, [array, MPI type] or
    [array, counts, displacements, MPI type] (counts in the array's elements)."""
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            return np.asarray(spec[0]), None, None
        return np.asarray(spec[0]), list(spec[1]), list(spec[2])
    return np.asarray(spec), None, None


class _Meeting:
    """One collective call: each rank's contribution, and whatever a call makes once
    (a Dup's new shared state)."""

    def __init__(self, n: int, kind: str):
        self.kind, self.parts, self.arrived = kind, [None] * n, 0
        self.made: Any = None


class _Shared:
    """What the ranks of one communicator share: the calls under way, by number, and the
    communicators Create_group made of some of them."""

    def __init__(self, n: int):
        self.n = n
        self.lock = threading.Condition()
        self.meetings: dict[int, _Meeting] = {}
        self.groups: dict[tuple, _Shared] = {}


class _Process:
    """One rank's process, whatever communicator it calls on: whether it stopped."""

    def __init__(self) -> None:
        self.stopped = False


class _Group:
    """An MPI group as Get_group, Incl and Create_group use it: ranks of a communicator."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks

    def Get_size(self) -> int:  # noqa: N802
        return len(self.ranks)

    def Incl(self, ranks: list[int]) -> _Group:  # noqa: N802
        if len(set(ranks)) < len(ranks) or any(not 0 <= r < len(self.ranks) for r in ranks):
            raise ValueError(f"Incl({ranks}): ranks must be distinct and in "
                             f"0..{len(self.ranks) - 1}")
        return _Group(tuple(self.ranks[r] for r in ranks))

    def Free(self) -> None:  # noqa: N802
        pass


class Request:
    """A collective call of one rank: Test() completes it once every rank made it (never,
    where the rank had stopped: ``stopped``)."""

    def __init__(self, shared: _Shared, number: int, finish: Callable[[list[Any]], None],
                 stopped: bool = False):
        self._shared, self._number, self._finish, self._done = shared, number, finish, False
        self._stopped = stopped

    def Test(self) -> bool:  # noqa: N802 - mpi4py's names
        if self._done:
            return True
        if self._stopped:
            return False
        with self._shared.lock:
            meeting = self._shared.meetings[self._number]
            if meeting.arrived < self._shared.n:
                return False
            parts = list(meeting.parts)
        self._finish(parts)
        self._done = True
        return True

    def Wait(self, timeout: float = 60.0) -> None:  # noqa: N802
        """Block until complete; RuntimeError after ``timeout`` s (a test's own bound)."""
        end = time.monotonic() + timeout
        if self._stopped:
            time.sleep(timeout)
            raise RuntimeError(f"call {self._number} of a stopped rank waited {timeout:g} s")
        with self._shared.lock:
            while self._shared.meetings[self._number].arrived < self._shared.n:
                if not self._shared.lock.wait(max(0.0, end - time.monotonic())):
                    raise RuntimeError(f"call {self._number} "
                                       f"({self._shared.meetings[self._number].kind}) "
                                       f"waited {timeout:g} s for the other ranks")
        self.Test()

    def Cancel(self) -> None:  # noqa: N802
        pass


class ThreadComm:
    """Rank ``rank`` of a communicator whose ranks are threads of this process."""

    def __init__(self, shared: _Shared, rank: int, process: _Process | None = None):
        self._shared, self._rank, self._calls = shared, rank, 0
        self._process = process if process is not None else _Process()
        self._created: dict[tuple, int] = {}  # Create_group's calls, by (tag, ranks)

    @classmethod
    def world(cls, n: int) -> list[ThreadComm]:
        shared = _Shared(n)
        return [cls(shared, r) for r in range(n)]

    def stop(self) -> None:
        """This rank's process freezes here: its later calls, on this communicator and
        every one made from it, never reach the others, nor complete."""
        self._process.stopped = True

    def _made(self, shared: _Shared, rank: int) -> ThreadComm:
        """Another communicator of this rank's process (of this one's class)."""
        return type(self)(shared, rank, self._process)

    def Get_rank(self) -> int:  # noqa: N802
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._shared.n

    rank = property(Get_rank)
    size = property(Get_size)

    def _meet(self, kind: str, part: Any, finish: Callable[[list[Any]], None],
              make: Callable[[], Any] | None = None) -> Request:
        shared, number = self._shared, self._calls
        self._calls += 1
        if self._process.stopped:
            return Request(shared, number, finish, stopped=True)
        with shared.lock:
            meeting = shared.meetings.setdefault(number, _Meeting(shared.n, kind))
            if meeting.kind != kind:
                raise RuntimeError(f"rank {self._rank}'s call {number} is {kind}, another "
                                   f"rank's {meeting.kind}: the ranks' calls differ")
            if make is not None and meeting.made is None:
                meeting.made = make()
            meeting.parts[self._rank] = part
            meeting.arrived += 1
            shared.lock.notify_all()
        return Request(shared, number, finish)

    # -- buffers -------------------------------------------------------------------------

    def Iallreduce(self, send: Any, recv: Any, op: Any = MPI.SUM) -> Request:  # noqa: N802
        dst, _, _ = _array(recv)
        src = dst if send is MPI.IN_PLACE else _array(send)[0]
        ufunc = _ufunc(op)

        def finish(parts: list[np.ndarray]) -> None:
            total = parts[0].copy()
            for part in parts[1:]:
                total = ufunc(total, part)
            dst.reshape(-1)[:] = total.reshape(-1)
        return self._meet("allreduce", np.array(src, copy=True).reshape(-1), finish)

    def Iallgather(self, send: Any, recv: Any) -> Request:  # noqa: N802
        src, dst = _array(send)[0], _array(recv)[0]

        def finish(parts: list[np.ndarray]) -> None:
            flat = dst.reshape(-1).view(np.uint8)
            width = parts[0].size
            for r, part in enumerate(parts):
                flat[r * width:(r + 1) * width] = part
        return self._meet("allgather", np.ascontiguousarray(src).reshape(-1)
                          .view(np.uint8).copy(), finish)

    def Iallgatherv(self, send: Any, recv: Any) -> Request:  # noqa: N802
        src = _array(send)[0]
        dst, counts, displs = _array(recv)

        def finish(parts: list[np.ndarray]) -> None:
            flat = dst.reshape(-1)
            for part, count, at in zip(parts, counts, displs):
                flat[at:at + count] = part[:count]
        return self._meet("allgatherv", np.array(src, copy=True).reshape(-1)
                          .view(dst.dtype), finish)

    def Ibcast(self, buf: Any, root: int = 0) -> Request:  # noqa: N802
        array = _array(buf)[0]

        def finish(parts: list[Any]) -> None:
            if self._rank != root:
                sent = parts[root]
                # MPI requires the same type signature on every rank (a larger buffer
                # is an error, not a conversion): say so rather than cast.
                if (array.dtype, array.size) != (sent.dtype, sent.size):
                    raise RuntimeError(
                        f"rank {self._rank}'s bcast buffer is {array.size} x "
                        f"{array.dtype}, root {root}'s {sent.size} x {sent.dtype}: "
                        f"MPI's type signatures differ")
                array.reshape(-1)[:] = sent
        part = np.array(array, copy=True).reshape(-1) if self._rank == root else None
        return self._meet(f"bcast from {root}", part, finish)

    def Ibarrier(self) -> Request:  # noqa: N802
        return self._meet("barrier", None, lambda parts: None)

    def Allreduce(self, send: Any, recv: Any, op: Any = MPI.SUM) -> None:  # noqa: N802
        self.Iallreduce(send, recv, op).Wait()

    def Allgather(self, send: Any, recv: Any) -> None:  # noqa: N802
        self.Iallgather(send, recv).Wait()

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        self.Ibcast(buf, root).Wait()

    def Barrier(self) -> None:  # noqa: N802
        self.Ibarrier().Wait()

    # -- objects -------------------------------------------------------------------------

    def _objects(self, kind: str, obj: Any) -> list[Any]:
        got: list[Any] = []
        self._meet(kind, copy.deepcopy(obj), got.extend).Wait()
        return [copy.deepcopy(x) for x in got]

    def allgather(self, obj: Any) -> list[Any]:
        return self._objects("allgather object", obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._objects(f"bcast object from {root}", obj)[root]

    def allreduce(self, obj: Any, op: Any = MPI.SUM) -> Any:
        parts = self._objects("allreduce object", obj)
        ufunc = _ufunc(op)
        total = parts[0]
        for part in parts[1:]:
            total = ufunc(total, part)
        return total.item() if isinstance(total, np.generic) else total

    # -- communicators -------------------------------------------------------------------

    def Dup(self) -> ThreadComm:  # noqa: N802
        """Another communicator over the same ranks (collective, by order, as MPI's)."""
        n = self._shared.n
        made: list[_Shared] = []
        request = self._meet("dup", None, lambda parts: None, make=lambda: _Shared(n))
        if self._process.stopped:
            raise RuntimeError(f"rank {self._rank} stopped: its Dup never completes")
        with self._shared.lock:
            made.append(self._shared.meetings[request._number].made)
        return self._made(made[0], self._rank)

    def Split(self, color: int = 0, key: int = 0) -> ThreadComm:  # noqa: N802
        """The ranks of this communicator with the same ``color``, ordered by ``key``
        then rank (collective, as MPI's; MPI.UNDEFINED is not taken)."""
        if color == MPI.UNDEFINED or color < 0:
            raise ValueError(f"Split(color={color}): the thread communicator takes "
                             f"colors >= 0 only")
        parts: list[Any] = []
        request = self._meet("split", (color, key), parts.extend, make=dict)
        request.Wait()
        members = sorted((k, r) for r, (c, k) in enumerate(parts) if c == color)
        with self._shared.lock:
            made = self._shared.meetings[request._number].made
            shared = made.setdefault(color, _Shared(len(members)))
        return self._made(shared, members.index((key, self._rank)))

    def Split_type(self, split_type: int, key: int = 0) -> ThreadComm:  # noqa: N802
        """Every rank is a thread of this process, so of one node: COMM_TYPE_SHARED
        splits nothing off."""
        if split_type != MPI.COMM_TYPE_SHARED:
            raise ValueError(f"Split_type({split_type}): the thread communicator takes "
                             f"MPI.COMM_TYPE_SHARED only")
        return self.Split(0, key)

    def Get_group(self) -> _Group:  # noqa: N802
        return _Group(tuple(range(self._shared.n)))

    def Create_group(self, group: _Group, tag: int = 0) -> ThreadComm:  # noqa: N802
        """A communicator of ``group``'s ranks, collective over those ranks alone (as
        MPI's): their k-th calls with the same tag and group meet."""
        if self._rank not in group.ranks:
            raise ValueError(f"rank {self._rank} is not in the group {list(group.ranks)}")
        key = (tag, group.ranks)
        self._created[key] = count = self._created.get(key, -1) + 1
        with self._shared.lock:
            shared = self._shared.groups.setdefault((*key, count),
                                                    _Shared(len(group.ranks)))
        return self._made(shared, group.ranks.index(self._rank))

    def Free(self) -> None:  # noqa: N802
        pass


class ThreadPeers(ThreadComm, TorchPeers):
    """A ThreadComm that the library takes for a job's peers without MPI, as it takes
    gloo's (see the module's docstring); TorchPeers' own state is never made."""

    def __init__(self, shared: _Shared, rank: int, process: _Process | None = None):
        ThreadComm.__init__(self, shared, rank, process)


class RankFailed(AssertionError):
    """A rank of run_ranks raised: the first such rank, and its exception as the cause."""


def run_ranks(n: int, body: Callable[[ThreadComm], Any], timeout: float = 60.0,
              kind: type[ThreadComm] = ThreadComm) -> list[Any]:
    """``body(comm)`` on n ranks, a thread each, ``comm`` a ``kind`` (ThreadPeers: as
    the library's peers); their results by rank. A rank that raises is reported
    (RankFailed, from its exception) once every thread has ended or ``timeout`` s
    passed; a thread still running then fails the test, naming its rank (the thread is
    a daemon: it ends with the process)."""
    comms = kind.world(n)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def one(rank: int) -> None:
        try:
            results[rank] = body(comms[rank])
        except BaseException as exc:  # reported below, with the rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=one, args=(r,), name=f"rank {r}", daemon=True)
               for r in range(n)]
    for thread in threads:
        thread.start()
    end = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    also = f" (rank(s) {stuck} still run after {timeout:g} s)" if stuck else ""
    if errors:  # (a rank that raised first: the others may wait for it)
        rank, exc = min(errors, key=lambda e: e[0])
        raise RankFailed(f"rank {rank} raised {type(exc).__name__}: {exc}{also}") from exc
    if stuck:
        raise RankFailed(f"rank(s) {stuck} still run after {timeout:g} s")
    return results


def timed_out(n: int, body: Callable[[ThreadComm], Any], timeout: float = 60.0,
              kind: type[ThreadComm] = ThreadComm) -> str:
    """run_ranks, where a rank's bounded wait must end in CollectiveTimeout (a rank
    stopped, or never took part): that timeout's message, which names the wait."""
    from ina_collectives.errors import CollectiveTimeout
    try:
        run_ranks(n, body, timeout, kind)
    except RankFailed as failed:
        if isinstance(failed.__cause__, CollectiveTimeout):
            return str(failed.__cause__)
        raise
    raise AssertionError("every rank ended: no wait timed out")
