"""The ranks' own communicator when the job was not started by MPI (torchrun).

The collectives layer talks to its peers through the subset of mpi4py's Intracomm it
uses: nonblocking Iallgather(v), Ibcast, Ialltoallv, Ibarrier, Iallreduce, Isend and
Irecv returning requests polled with Test(), and Get_rank, Get_size, Dup, Free. An
``MPI.Intracomm`` is one such communicator; ``TorchPeers`` is the other, made from a
torch.distributed store: each is a gloo process group, and each Dup() another one, so
the engines (agreement, exponent exchange, outcome votes, the ring) run unchanged under
torchrun with no MPI job at all.
"""
from __future__ import annotations

import datetime
import itertools
import pickle
import warnings
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .waiting import Deadline, wait


def _torch_op(op: Any) -> Any:
    """torch's ReduceOp for an MPI.Op (MPI.Op objects are not hashable)."""
    import torch.distributed as dist
    pairs = [(MPI.SUM, dist.ReduceOp.SUM), (MPI.PROD, dist.ReduceOp.PRODUCT),
             (MPI.MIN, dist.ReduceOp.MIN), (MPI.MAX, dist.ReduceOp.MAX),
             (MPI.BAND, dist.ReduceOp.BAND), (MPI.BOR, dist.ReduceOp.BOR),
             (MPI.BXOR, dist.ReduceOp.BXOR)]
    for mpi_op, torch_op in pairs:
        if op == mpi_op:
            return torch_op
    raise ValueError(f"no gloo reduction for {op}")


# The dtypes gloo's allreduce takes as they are.
_GLOO_REDUCES = tuple(np.dtype(t) for t in ("int8", "uint8", "int32", "int64", "float16",
                                            "float32", "float64"))


class Request:
    """A gloo Work seen as an MPI request: Test() completes it (and then copies results
    into place where the operation needed a staging buffer)."""

    __slots__ = ("_work", "_then", "_done")

    def __init__(self, work: Any, then: Callable[[], None] | None = None):
        self._work, self._then, self._done = work, then, False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        if self._done:
            return True
        if not self._work.is_completed():
            return False
        self._work.wait()  # finished: raises the operation's error, if any
        if self._then is not None:
            self._then()
        self._done = True
        return True

    def Wait(self, seconds: float) -> None:  # noqa: N802
        """Block until the operation ends, at most ``seconds`` (then gloo raises). gloo's
        send and receive are only completed by a wait: Test() alone never sees them end."""
        if self._done:
            return
        self._work.wait(datetime.timedelta(seconds=seconds))
        if self._then is not None:
            self._then()
        self._done = True

    def Cancel(self) -> None:  # noqa: N802 - gloo cannot cancel: the peers' timeout ends it
        pass

    def source(self) -> int:
        """The rank an ended receive came from."""
        return int(self._work._source_rank())  # (gloo's Work: its name for it)

    def Free(self) -> None:  # noqa: N802
        pass


def _tensor(array: np.ndarray, source: bool = False) -> Any:
    """A tensor sharing ``array``'s memory (results must land in the caller's array).
    ``source``: gloo only reads it, so a read-only array will do (torch warns of any
    read-only array; a buffer results land in must be writable)."""
    import torch
    if not array.flags.c_contiguous:
        raise ValueError("the peers' operations need contiguous buffers")
    if array.flags.writeable:
        return torch.from_numpy(array.reshape(-1))
    if not source:
        raise ValueError(f"a read-only buffer of {array.nbytes} bytes cannot take the "
                         "peers' results")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(array.reshape(-1))


def _bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s memory as bytes (the same memory)."""
    if not array.flags.c_contiguous:
        raise ValueError("the peers' operations need contiguous buffers")
    return array.reshape(-1).view(np.uint8)


def _buffer(spec: Any) -> tuple[np.ndarray, list[int] | None, list[int] | None]:
    """mpi4py's buffer specs as used here: an array, [array, MPI type] or
    [array, counts, displacements, MPI type] (counts in elements of the array)."""
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            return np.asarray(spec[0]), None, None
        return np.asarray(spec[0]), list(spec[1]), list(spec[2])
    return np.asarray(spec), None, None


class TorchPeers:
    """A communicator over a gloo process group made from a torch.distributed store."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 prefix: str = "ina/peers"):
        import torch.distributed as dist
        self._store, self._rank, self._size, self._timeout = store, rank, size, timeout
        self._prefix = prefix
        self._dups = itertools.count()
        address = gloo_address()
        if address is None:  # gloo's own choice: GLOO_SOCKET_IFNAME, else the hostname's
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                             timeout)
            return
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                         options)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names from here on
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def Dup(self) -> TorchPeers:  # noqa: N802
        """Another gloo group over the same ranks (collective, in the same order)."""
        return TorchPeers(self._store, self._rank, self._size, self._timeout,
                          f"{self._prefix}/{next(self._dups)}")

    def Free(self) -> None:  # noqa: N802
        self._pg = None

    def Iallgather(self, send: Any, recv: Any) -> Request:  # noqa: N802
        src, _, _ = _buffer(send)
        dst, _, _ = _buffer(recv)
        parts = list(_tensor(_bytes(dst)).view(self._size, -1).unbind(0))
        return Request(self._pg.allgather([parts], [_tensor(_bytes(src), source=True)]))

    def allgather(self, obj: Any) -> list[Any]:
        """mpi4py's allgather of a picklable object (the agreement names every rank's
        call with it when they differ), bounded by the peers' timeout."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.empty(self._size, np.int64)
        deadline = Deadline(self._timeout.total_seconds())
        wait(self.Iallgather(np.array([payload.size], np.int64), sizes), deadline,
             lambda: f"all {self._size} ranks' object sizes in an allgather")
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        gathered = np.empty(int(sizes.sum()), np.uint8)
        wait(self.Iallgatherv(payload, [gathered, sizes.tolist(), displs.tolist(),
                                        MPI.BYTE]), deadline,
             lambda: f"all {self._size} ranks' objects in an allgather")
        return [pickle.loads(gathered[d:d + n].tobytes()) for d, n in zip(displs, sizes)]

    def Iallgatherv(self, send: Any, recv: Any) -> Request:  # noqa: N802
        # gloo gathers equal sizes: pad each rank's part to the largest, then place.
        src, _, _ = _buffer(send)
        dst, counts, displs = _buffer(recv)
        src_bytes, dst_bytes = _bytes(src), _bytes(dst)
        counts_b = [c * dst.itemsize for c in counts]
        displs_b = [d * dst.itemsize for d in displs]
        width = max(counts_b) if counts_b else 0
        padded = np.zeros((self._size, max(width, 1)), np.uint8)
        mine = np.zeros(max(width, 1), np.uint8)
        mine[:src_bytes.size] = src_bytes
        parts = list(_tensor(padded).view(self._size, -1).unbind(0))
        work = self._pg.allgather([parts], [_tensor(mine)])

        def place() -> None:
            for r, (c, d) in enumerate(zip(counts_b, displs_b)):
                dst_bytes[d:d + c] = padded[r, :c]
        return Request(work, place)

    def Ibcast(self, buf: Any, root: int = 0) -> Request:  # noqa: N802
        import torch.distributed as dist
        array, _, _ = _buffer(buf)
        options = dist.BroadcastOptions()
        options.rootRank = root
        return Request(self._pg.broadcast(
            [_tensor(_bytes(array), source=self._rank == root)], options))

    def Ialltoallv(self, send: Any, recv: Any) -> Request:  # noqa: N802
        src, scounts, _ = _buffer(send)
        dst, rcounts, _ = _buffer(recv)
        return Request(self._pg.alltoall_base(
            _tensor(_bytes(dst)), _tensor(_bytes(src), source=True),
            [c * dst.itemsize for c in rcounts], [c * src.itemsize for c in scounts]))

    def Ibarrier(self) -> Request:  # noqa: N802
        return Request(self._pg.barrier())

    def Iallreduce(self, send: Any, recv: Any, op: Any = MPI.SUM) -> Request:  # noqa: N802
        import torch.distributed as dist
        dst, _, _ = _buffer(recv)
        if send is not MPI.IN_PLACE:
            src, _, _ = _buffer(send)
            np.copyto(dst.reshape(-1), src.reshape(-1))
        options = dist.AllreduceOptions()
        options.reduceOp = _torch_op(op)
        if dst.dtype in _GLOO_REDUCES:
            return Request(self._pg.allreduce([_tensor(dst)], options))
        # gloo has no reduction for this dtype (int16 exponents): reduce it widened.
        wide = dst.reshape(-1).astype(np.int64 if dst.dtype.kind in "iub" else np.float64)
        return Request(self._pg.allreduce([_tensor(wide)], options),
                       lambda: np.copyto(dst.reshape(-1), wide, casting="unsafe"))

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        array, _, _ = _buffer(buf)
        return Request(self._pg.send([_tensor(_bytes(array), source=True)], dest, tag))

    def Irecv(self, buf: Any, source: int, tag: int = 0) -> Request:  # noqa: N802
        """A receive from ``source``, or from any rank (MPI.ANY_SOURCE: gloo's
        recv_anysource; ``Request.source()`` says who sent it)."""
        array, _, _ = _buffer(buf)
        if source == MPI.ANY_SOURCE:
            return Request(self._pg.recv_anysource([_tensor(_bytes(array))], tag))
        return Request(self._pg.recv([_tensor(_bytes(array))], source, tag))


def gloo_address() -> str | None:
    """The address this rank's gloo groups bind, where gloo's own choice would fail: with
    GLOO_SOCKET_IFNAME unset, gloo binds the address the hostname resolves to, which is
    a loopback one on many machines (Debian's /etc/hosts maps it to 127.0.1.1): its
    peers on other hosts then connect to themselves and wait until the timeout. Where
    MASTER_ADDR (torchrun's rendezvous host) is on another machine, this rank's address
    on the route to it is one they reach. None: leave it to gloo (GLOO_SOCKET_IFNAME
    set, no MASTER_ADDR, or a rendezvous on this machine)."""
    import os
    import socket

    master = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master:
        return None
    try:
        remote = socket.gethostbyname(master)
        if remote.startswith("127."):
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((remote, 9))  # a route lookup: nothing is sent
            local = probe.getsockname()[0]
    except OSError:
        return None
    return None if local.startswith("127.") else local


def started_by_mpi() -> bool:
    """Whether an MPI launcher (mpiexec, ina-run) started this process."""
    import os
    return any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                         "PMIX_RANK"))
