"""The engines that can compute an allreduce, and the call they are offered.

Each engine says why it declines a call (or None if it takes it); ``Collectives`` runs the
first that takes it, in the order INA, ring, MPI. One place decides. ``run`` returns None
when the engine served the call, or the reason it handed the call to the ring midway
(NaN/Inf found, the aggregator failed): then the ring served it.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import protocol as P
from .ops import MPI_OP, RING_DTYPES, Op
from .ring import Ring
from .settings import Settings
from .waiting import Deadline, wait

log = logging.getLogger("ina_collectives")


@dataclass
class AllreduceCall:
    """One allreduce as the engines see it: 1-D contiguous views, recv writable."""

    send: np.ndarray | None  # None: in place, the input is already in recv
    recv: np.ndarray
    op: Op

    @property
    def dtype(self) -> np.dtype:
        return self.recv.dtype

    @property
    def nbytes(self) -> int:
        return self.recv.nbytes


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether this MPI's own reductions take dtype (MPICH has float16, not every MPI does)."""
    return dtype.kind in "fiuc" and dtype.itemsize <= 16 and dtype != np.dtype("longdouble")


class RingEngine:
    name = "ring"

    def __init__(self, comm: MPI.Intracomm, settings: Settings):
        self.ring = Ring(comm, settings.ring_chunk_bytes)
        self.min_bytes = settings.ring_min_bytes

    def declines(self, call: AllreduceCall) -> str | None:
        if call.dtype not in RING_DTYPES:
            return f"ring: dtype {call.dtype} is left to MPI"
        if call.nbytes < self.min_bytes and mpi_reduces(call.dtype):
            return f"ring: below ring_min_bytes ({self.min_bytes})"
        return None

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        if call.send is not None:
            np.copyto(call.recv, call.send)
        self.ring.allreduce(call.recv, call.op, deadline)


class InaEngine:
    """Allreduce computed by the aggregator ("the switch"), with the ring as its fallback.

    Collective to construct: every rank joins the job at the aggregator (or, when a
    controller installed the job, settings.job, checks its entry with a probe) and the
    ranks agree; if any rank failed, no rank uses the aggregator (``unavailable`` says
    why).
    """

    name = "ina"
    FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

    def __init__(self, comm: MPI.Intracomm, settings: Settings, ring: RingEngine):
        from . import kernels
        from .transport import AggregatorUnavailable, WorkerLink, parse_address

        self.comm, self.settings, self.ring = comm, settings, ring
        self.kernels = kernels
        self.link: WorkerLink | None = None
        self.unavailable: str | None = None
        if not settings.switch:
            self.unavailable = "ina: no aggregator configured (INA_SWITCH)"
            return
        n, rank = comm.Get_size(), comm.Get_rank()
        k = settings.switch_elements or P.MAX_ELEMENTS
        error = None
        if n > P.MAX_WORKERS:
            error = f"{n} ranks exceed the aggregator's {P.MAX_WORKERS} workers"
        elif kernels.BACKEND != "fast":
            error = "the compiled fast path is not built"
        ports = [int(p) for p in settings.worker_ports.split(",") if p.strip()]
        if settings.job and error is None and len(ports) != n:
            error = (f"job {settings.job} was installed by a controller, but worker_ports "
                     f"(INA_WORKER_PORTS) names {len(ports)} ports for {n} ranks")
        # Rank 0's job id (INA_JOB, or a fresh one to join with) for every rank: one
        # collective whatever the ranks' settings say, so that none can wait alone.
        job = comm.bcast((settings.job or random.SystemRandom().randrange(1, 65536))
                         if rank == 0 else None)
        if error is None and settings.job != (job if settings.job else 0):
            error = f"INA_JOB is {settings.job} here but {job} on rank 0"
        if error is None:
            try:
                self.link = WorkerLink(parse_address(settings.switch), job, rank, n, k,
                                       settings.switch_slots,
                                       ports[rank] if settings.job else 0)
                if settings.job:  # installed by a controller: worker id = rank
                    self.link.probe(settings.switch_join_timeout)
                else:
                    self.link.join(settings.switch_join_timeout)
            except (AggregatorUnavailable, ValueError, OSError) as exc:
                error = str(exc)
        errors = comm.allgather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            r, e = failed[0]
            self.unavailable = f"ina: aggregator unavailable (rank {r}: {e})"
            log.warning("%s; every call takes the ring", self.unavailable)
            self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.leave()
            self.link.close()
            self.link = None

    def declines(self, call: AllreduceCall) -> str | None:
        if self.unavailable:
            return self.unavailable
        if call.dtype not in self.FLOATS:
            return f"ina: dtype {call.dtype} is not a float"
        if call.op not in (Op.SUM, Op.AVERAGE):
            return f"ina: op {call.op.name} is not SUM or AVERAGE"
        if call.nbytes < self.settings.switch_min_bytes:
            return f"ina: below switch_min_bytes ({self.settings.switch_min_bytes})"
        return None

    def run(self, call: AllreduceCall, deadline: Deadline) -> str | None:
        link, k = self.link, self.link.k
        source = call.recv if call.send is None else call.send
        # The input stays intact until the result is whole: the ring may need it.
        wide = np.float32 if call.dtype == np.float16 else call.dtype
        x = source.astype(wide) if (call.send is None or wide != call.dtype) else source
        local, nonfinite = self.kernels.block_exponents(x, k)
        first = min(link.slots, local.size)
        proposal = np.empty(1 + first, np.int16)
        proposal[0] = nonfinite
        proposal[1:] = local[:first]
        agreed_first = np.empty_like(proposal)
        wait(self.comm.Iallreduce(proposal, agreed_first, MPI.MAX), deadline,
             lambda: f"all ranks to agree on the exponents of a {call.nbytes}-byte allreduce")
        if agreed_first[0]:
            self._ring(call, x)
            return "ina: NaN or Inf in the input (exact path)"
        agreed = np.empty_like(local)
        agreed[:first] = agreed_first[1:]
        out = call.recv if wide == call.dtype else np.empty(call.recv.size, wide)
        result = link.stream(x, out, local, agreed, call.op is Op.AVERAGE,
                             self.settings.retransmit_timeout, self.settings.retransmit_min,
                             self.settings.retransmit_max,
                             self.settings.switch_silence,
                             max(0.0, deadline.expires - time.monotonic()))
        # Every rank learns whether any rank failed (bounded: a dead peer never reports).
        mine = np.array([0 if result.ok else 1], np.int32)
        anyone = np.empty_like(mine)
        wait(self.comm.Iallreduce(mine, anyone, MPI.MAX), deadline,
             lambda: f"all ranks to report the outcome of a {call.nbytes}-byte allreduce "
                     f"through the aggregator (this rank: {result.reason})")
        if anyone[0]:
            here = ("" if result.ok else f"; here: {result.reason}, {result.missing.size} "
                    f"chunks never completed (first {result.missing[:8].tolist()})")
            self.unavailable = f"ina: aggregator failed mid-operation{here}"
            log.warning("%s; this call and all later ones take the ring", self.unavailable)
            self.close()
            self._ring(call, x)
            return self.unavailable
        if out is not call.recv:
            np.copyto(call.recv, out, casting="unsafe")
        return None

    def _ring(self, call: AllreduceCall, x: np.ndarray) -> None:
        np.copyto(call.recv, x, casting="unsafe")  # exact: x is the input or its widening
        self.ring.ring.allreduce(call.recv, call.op, Deadline(self.settings.timeout))



class MpiEngine:
    """MPI's own Allreduce (non-blocking, so that the wait has a bound)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def declines(self, call: AllreduceCall) -> str | None:
        return None if mpi_reduces(call.dtype) else f"mpi: no MPI reduction for {call.dtype}"

    def run(self, call: AllreduceCall, deadline: Deadline) -> None:
        send = MPI.IN_PLACE if call.send is None else call.send
        request = self.comm.Iallreduce(send, call.recv, MPI_OP[call.op])
        wait(request, deadline,
             lambda: f"MPI_Iallreduce of {call.recv.size} x {call.dtype} to complete on all "
                     f"{self.comm.Get_size()} ranks")
        if call.op is Op.AVERAGE:
            np.divide(call.recv, self.comm.Get_size(), out=call.recv)
