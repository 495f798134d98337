"""The chooser: one communicator's collectives. It checks a call, picks its engine, hands
a call an engine gave up to the fallback, and keeps the stats. The only place that
decides which engine serves a call, and the owner of the communicator's error path
(recovery.py). It knows engines only by the protocols of engine.py: the offload is given
to it (``offload``, or None: the layer above decides whether the job has one, and what
stats() shows where it has none), so this layer never imports one, nor reads its settings.

An allreduce goes in steps (``allreduce_flat``): its identity, once; its engine
chosen (``_choose``: the first whose ``declines`` says None, Horovod's ``Enabled``);
the run (``_run``, its ``Execute``), where the offload makes the gate of a call it serves
itself, with the chooser's part of it (``_HostGate``: the call boundary and the
agreement by MPI); the gate of a call another engine serves (``_gated``: through the
offload's ``gate``, or the agreement), or none where the caller compared the calls
(``_unchecked``); and a call given up midway finished alike on every rank
(``_finish``). A gate that ended in a rescue, or at a call boundary that changed the
offload's layout, starts the call over.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..errors import AgreementError, CommunicatorBroken
from ..settings import Settings
from .agreement import Agreed, CallSignature, agree, columns, disagree, identity
from .engine import (
    AllreduceCall,
    Engine,
    Gated,
    GateOutcome,
    HandOver,
    HostGate,
    OffloadEngine,
    was_refused,
)
from .mpi_engine import MpiEngine
from .ops import Op, as_op, check_quorum, check_supported, dtype_code, op_code
from .peers import TorchPeers
from .recovery import ErrorPath
from .ring import RingEngine
from .stats import Stats
from .waiting import Deadline, dump_on_signal, wait, watch_run

log = logging.getLogger("ina_collectives")

_VALUE_BITS = (0, *P.VALUE_BITS)  # a call's value widths (0: the job's)

# What makes the offload: ``offload(comm, settings, error_path)``, collective.
OffloadFactory = Callable[[Any, Settings, ErrorPath], OffloadEngine]


class Collectives:
    """The library's state for one communicator (what Horovod calls its global state)."""

    def __init__(self, comm: MPI.Intracomm | TorchPeers, settings: Settings,
                 offload: OffloadFactory | None = None,
                 absent: dict[str, Any] | None = None):
        """``offload(comm, settings, error_path)`` makes the engine tried first, which
        serves calls out of the hosts (collective); None: the job has none, and every
        call takes the exact engines. The layer above decides which, from its settings
        (ina.offload.offload_for), and refuses a job that requires an offload it lacks.
        ``absent``: what stats() shows of the offload where there is none (the keys its
        ``report`` gives), so that a snapshot has the same keys either way."""
        # The peers: an MPI communicator, or (no MPI job: torchrun) a torch one.
        if not isinstance(comm, (MPI.Intracomm, TorchPeers)) or comm == MPI.COMM_NULL:
            raise TypeError(f"expected an mpi4py intracommunicator, got {comm!r}")
        # The library's logger level, unless the user's logging configuration set one.
        if log.level == logging.NOTSET or getattr(log, "_ina_level", None) == log.level:
            log.setLevel(settings.log_level.upper())
            log._ina_level = log.level  # type: ignore[attr-defined]
        watch_run(settings.run_dir)  # (ina-run's mark of a failed rank ends every wait)
        dump_on_signal(settings.run_dir)  # (kill -USR2: what it waits for, its stacks)
        # Our own copy of the communicator: the ring's messages never match the user's.
        self.comm = comm.Dup()
        self.settings = settings
        self.stats = Stats(absent if offload is None else None)
        self.errors = ErrorPath(self.comm, settings.timeout)
        # The exact engine that finishes a call another engine gave up midway: the ring,
        # or where it cannot run (gloo's peers, no MPI job) the peers' own allreduce.
        self.ring = RingEngine(self.comm, settings)
        self.fallback: Engine = self.ring if self.ring.usable else MpiEngine(self.comm)
        # Without an offload there is no engine before the ring (no reason to count).
        try:
            self.offload: OffloadEngine | None = (
                offload(self.comm, settings, self.errors) if offload is not None else None)
        except BaseException:
            self.comm.Free()  # init failed: nothing of it stays
            raise
        if settings.check_agreement:  # every call starts with the agreement: a gate
            self.errors.set_gate(lambda: columns(self._width()))
        self.engines: list[Engine] = ([self.offload] if self.offload else []) + [
            self.ring, MpiEngine(self.comm)]
        self.stats.reports = [engine.report for engine in self.engines]
        self._seq = 0
        self._broken: str | None = None
        # What a call's ``following`` raised or returned that was refused (allreduce_flat).
        self._following_refused: Exception | None = None

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def free(self) -> None:
        if self._broken is None:
            self.finish_calls()
        for engine in self.engines:
            engine.close()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self._broken = "the communicator was freed (finalize)"

    # -- the array API ------------------------------------------------------------------

    def allreduce(self, array: Any, op: Any = Op.SUM, out: np.ndarray | None = None
                  ) -> np.ndarray:
        """Reduce ``array`` over all ranks into ``out`` (a new array if None) and return it.

        Any array-like and any memory layout: non-contiguous input or output is staged
        through a contiguous copy. ``out`` may be ``array`` itself (in place).
        """
        ours = as_op(op)
        if ours is None:
            raise ValueError(f"op {op!r} is not one of SUM, PROD, MIN, MAX, AVERAGE; "
                             f"use ina_collectives.mpi.Intracomm.Allreduce for MPI's other ops")
        src = np.asarray(array)
        check_supported(src.dtype, ours)
        if out is None:
            out = np.empty_like(src, order="C")
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        if out.shape != src.shape:
            raise ValueError(f"out has shape {out.shape}, the input {src.shape}")
        if out.dtype != src.dtype:
            raise TypeError(f"out has dtype {out.dtype}, the input {src.dtype}")
        if not out.flags.writeable:
            raise ValueError("out is read-only")

        # Ranks must agree element by element, whatever each one's memory layout: the
        # engines see every array flattened in C order, through a copy where needed.
        recv = _c_order_view(out)
        staged = recv is None
        if staged:
            recv = np.empty(out.size, dtype=out.dtype)
        same_memory = out is src or (  # (ctypes only where the memory may be shared)
            np.may_share_memory(out, src) and out.ctypes.data == src.ctypes.data
            and out.strides == src.strides)
        if staged or same_memory:
            if staged:
                recv[...] = src.reshape(-1)
            send = None  # in place
        else:
            send = _c_order_view(src)
            if send is None or np.may_share_memory(send, recv):
                send = src.flatten()
        self.allreduce_flat(send, recv, ours)
        if staged:
            out[...] = recv.reshape(out.shape)
        return out

    def allreduce_flat(self, send: np.ndarray | None, recv: np.ndarray, op: Op,
                       value_bits: int = 0, key: Hashable = None, present: int = 0,
                       following: Callable[[], Following | None] | None = None) -> None:
        """The core call: 1-D contiguous ``recv`` (and ``send``, or None for in place).
        ``value_bits``: 16 asks the offload for 16-bit values for this call (the caller
        has made sure every rank asks alike: the runtime's negotiation does). ``key``:
        what the caller knows the call by, alike on every rank (AllreduceCall.key).
        ``present``: the ranks whose input counts, a bitmap alike on every rank (0: all,
        by the offload's rules; every rank named: all, counted in quorum mode too;
        AllreduceCall.present). The caller checked that an engine takes the dtype and op
        (ops.check_supported). ``following``: where the caller knows its next call
        already (a runtime's queue), what makes it ready: called at most once, when this
        call's stream pauses at its drain (its last window in flight), it returns that
        call's arguments (buffers filled), or None where it is not ready; the offload
        may queue it behind this call, to start at once (docs/protocol.md, Calls back to
        back), and the caller's next call must be made with them. What it raises, or a
        value that is not such arguments, leaves this call as it is (the next call is
        not started) and is raised once this call is done."""
        self._check_usable()
        args = Following(send, recv, op, value_bits, key, present)
        self._check_arguments(args)
        if following is not None and not callable(following):
            raise TypeError(f"following must be a callable that returns the next call's "
                            f"arguments (Following) or None, got {following!r:.80}")
        signature = _signature(recv, op)
        call = AllreduceCall(*args, ident=identity(signature, value_bits))
        self._following_refused = None
        if following is not None and self.offload is not None:
            call.following = lambda: self._next_call(following)
        deadline = Deadline(self.settings.timeout)
        self._seq += 1
        passed_over: list[str] = []  # why the engines before the one that served did not
        served = None
        while served is None:  # (None: the gate ended in a rescue or a new layout)
            if not self.settings.check_agreement:
                served = self._unchecked(call, signature, deadline, passed_over)
            else:
                served = self._gated(call, signature, deadline, passed_over)
        self.stats.record(served.name, recv.nbytes, passed_over)
        refused, self._following_refused = self._following_refused, None
        if refused is not None:  # (this call is done: only its successor was not started)
            raise refused

    # -- the steps of a call ------------------------------------------------------------

    def _check_arguments(self, args: Following) -> None:
        """A call's value width, key and ranks present, as ``allreduce_flat`` takes
        them (ValueError or TypeError naming what is wrong)."""
        if args.value_bits not in _VALUE_BITS:
            raise ValueError(f"value_bits must be 0 (the job's), 32 or 16, got "
                             f"{args.value_bits}")
        if args.key is not None:
            try:
                hash(args.key)
            except TypeError:
                raise TypeError(f"an allreduce's key must be hashable (str, int, tuple of "
                                f"them), got {args.key!r:.80}") from None
        present = args.present
        if present and not 0 < present < (1 << self.comm.Get_size()):
            raise ValueError(f"present must be a bitmap of some of the "
                             f"{self.comm.Get_size()} ranks, got {present:#x}")

    def _next_call(self, following: Callable[[], Following | None]
                   ) -> AllreduceCall | None:
        """A call's ``following``: the caller's next call made ready (``following``) and
        checked, for the offload to queue where it can (docs/protocol.md, Calls back to
        back); None where there is none, or the ranks' calls are not compared."""
        if not self.settings.check_agreement:
            return None
        try:
            args = following()
            if args is None:
                return None
            if not isinstance(args, Following):
                raise TypeError(f"following returned {args!r:.80}, not the next call's "
                                f"arguments (Following) or None")
            recv, send = args.recv, args.send
            if not (isinstance(recv, np.ndarray) and recv.ndim == 1
                    and recv.flags.c_contiguous and recv.flags.writeable
                    and isinstance(args.op, Op)
                    and (send is None or (isinstance(send, np.ndarray)
                                          and send.shape == recv.shape
                                          and send.dtype == recv.dtype))):
                raise TypeError(f"following returned a call that is not 1-D contiguous "
                                f"NumPy arrays and an Op: {args!r:.120}")
            self._check_arguments(args)
        except Exception as exc:  # (raised once this call is done: allreduce_flat)
            self._following_refused = exc
            return None
        return AllreduceCall(*args, ident=identity(_signature(args.recv, args.op),
                                                   args.value_bits))

    def _choose(self, call: AllreduceCall) -> tuple[Engine, list[str]]:
        """The first engine that takes ``call``, and why the ones before it did not."""
        passed_over = []
        for engine in self.engines:
            reason = engine.declines(call)
            if reason is None:
                return engine, passed_over
            passed_over.append(reason)
        raise TypeError(f"no engine can reduce dtype {call.dtype} with op {call.op.name}: "
                        f"{'; '.join(passed_over)}")

    def _unchecked(self, call: AllreduceCall, signature: CallSignature,
                   deadline: Deadline, passed_over: list[str]) -> Engine:
        """No gate (the caller compared the ranks' calls: the runtime's negotiation): a
        call boundary, the choice, the run. Returns the engine that served the call."""
        if self.offload is not None:
            self.offload.at_call_boundary(self._seq, None)
        engine, declined = self._choose(call)
        passed_over += declined
        handover = self._run(engine, call, deadline, signature)
        return engine if handover is None else self._finish(call, handover, passed_over)

    def _gated(self, call: AllreduceCall, signature: CallSignature, deadline: Deadline,
               passed_over: list[str]) -> Engine | None:
        """A call whose ranks' calls are compared: the offload's run makes the gate of a
        call it serves (with ``_HostGate``); another engine's call has the offload's gate
        (``_offload_gate``), or the agreement by MPI. Returns the engine that served the
        call; None: start over (a rescue ran, or the layout changed)."""
        engine, declined = self._choose(call)
        offload = self.offload
        if engine is offload:
            handover = self._run(offload, call, deadline, signature,
                                 _HostGate(self, signature, deadline))
            if handover is not None and handover.rechoose:
                if handover.reason:  # (nothing moved: every rank starts the call over)
                    passed_over.append(handover.reason)
                return None
            return offload if handover is None else self._finish(call, handover,
                                                                 passed_over)
        if offload is not None:
            gated = self._offload_gate(offload, call.ident, signature, deadline)
            if gated is None:
                return None  # the gate failed and nothing was lost: choose again
            if gated.outcome is not GateOutcome.NOT_HERE:
                passed_over += declined
                if gated.outcome is GateOutcome.TO_FALLBACK:  # a rank was running it:
                    passed_over.append(gated.reason)          # all take the fallback
                    engine = self.fallback
                handover = self._run(engine, call, deadline, signature)
                return engine if handover is None else self._finish(call, handover,
                                                                     passed_over)
        agreed = self._agree(signature, deadline,
                             offload.news() if offload is not None else 0, None,
                             self._width())
        if agreed is None:
            return None
        if not self._call_boundary(agreed.news):  # (the same on every rank)
            engine, declined = self._choose(call)  # joined again, or grown: choose again
        passed_over += declined
        handover = self._run(engine, call, deadline, signature)
        return engine if handover is None else self._finish(call, handover, passed_over)

    def _run(self, engine: Engine, call: AllreduceCall, deadline: Deadline,
             signature: CallSignature, gate: HostGate | None = None) -> HandOver | None:
        """``engine.run`` (``gate``: the chooser's part of the offload's gate, for a
        call the offload serves); an exception leaves the communicator broken (part of
        the call may be in flight), unless MPI refused the call's arguments before it
        started. A call the offload saw the ranks make differently
        (``HandOver.mismatch``) raises AgreementError on every rank, naming what differs
        (``disagree``)."""
        try:
            handover = (engine.run(call, deadline) if gate is None else
                        engine.run(call, deadline, gate))  # type: ignore[call-arg]
            if handover is not None and handover.mismatch:
                disagree(self.comm, signature, self._seq, deadline, self._width())
            return handover
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            self._failed_in(engine, exc)
            raise

    def _failed_in(self, engine: Engine, exc: BaseException) -> None:
        """A call failed in ``engine``: part of it may still be in flight, and nothing
        later is safe (not when MPI refused the call's arguments before it started:
        mpi4py's caller gets MPI's exception and goes on)."""
        if not was_refused(exc):
            self._broken = f"allreduce #{self._seq} failed in engine {engine.name}: {exc!r}"

    def _finish(self, call: AllreduceCall, handover: HandOver, passed_over: list[str]
                ) -> Engine:
        """A call given up midway, alike on every rank: chosen again where nothing of it
        moved (``rechoose``: its gate failed), else finished on the fallback from its
        intact input (all of it, or the ranges left). Returns the engine that did."""
        passed_over.append(handover.reason)
        engine = self.fallback
        try:
            if handover.rechoose:
                engine, declined = self._choose(call)
                passed_over += declined
                engine.run(call, Deadline(self.settings.timeout))
                return engine
            # The bound restarts: the engine that gave up may have used it all.
            restart = Deadline(self.settings.timeout)
            for start, stop in handover.ranges or [(0, call.recv.size)]:
                part = call.recv[start:stop]
                np.copyto(part, handover.intact[start:stop], casting="unsafe")
                engine.run(AllreduceCall(None, part, call.op, present=call.present),
                           restart)
            return engine
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            self._failed_in(engine, exc)
            raise

    # -- the gates and the offload's hooks ----------------------------------------------

    def _width(self) -> int:
        """The int16 window values every rank passes in the agreement (the offload's)."""
        return self.offload.window_size() if self.offload is not None else 0

    def _call_boundary(self, news: int | None) -> bool:
        """Call ``self._seq`` starts, alike on every rank, with rank 0's ``news``; False
        when the offload's layout changed (a prepared call must be chosen again)."""
        offload = self.offload
        return offload is None or offload.at_call_boundary(self._seq, news)

    def _offload_gate(self, offload: OffloadEngine, ident: int, signature: CallSignature,
                      deadline: Deadline) -> Gated | None:
        """The gate of a call the offload does not serve, through the offload
        (``offload.gate``, which makes the call boundary): NOT_HERE where it makes
        none now. None when the ranks must choose again (the gate failed, or the layout
        changed); raises AgreementError on every rank when the offload saw their calls
        differ."""
        try:
            gated = offload.gate(ident, deadline, _HostGate(self, signature, deadline))
            if gated.outcome is GateOutcome.MISMATCH:
                disagree(self.comm, signature, self._seq, deadline, self._width())
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            self._broken = f"the gate of allreduce #{self._seq} failed: {exc!r}"
            raise
        return None if gated.outcome is GateOutcome.RESTART else gated

    def _agree(self, signature: CallSignature, deadline: Deadline, news: int = 0,
               window: np.ndarray | None = None, width: int = 0) -> Agreed | None:
        """The gate by MPI: agree, or (a rank could not finish its last call alone) run
        the rescue and return None."""
        try:
            agreed = agree(self.comm, signature, self._seq, deadline, news, window, width)
            if agreed.trouble:
                self.errors.rescue(f"the call before allreduce #{self._seq}")
                return None
            self.errors.forget()  # every rank is past its last call: nothing to keep
            return agreed
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            self._broken = f"the agreement of allreduce #{self._seq} failed: {exc!r}"
            raise

    def reduce_scatter_flat(self, buf: np.ndarray, op: Op, bounds: list[tuple[int, int]]
                            ) -> None:
        """Reduce the 1-D contiguous ``buf`` over all ranks into this rank's part,
        ``buf[bounds[rank][0]:bounds[rank][1]]`` (``bounds``: every rank's part, the same
        on every rank; the caller has made sure every rank called alike: the runtime's
        negotiation does; and that an engine takes the dtype and op). On the fallback's
        own reduce-scatter (the ring's): by arithmetic an offload that moves all of buf
        each way per rank gives it no bandwidth (the ring moves (n-1)/n of it), and
        measured on netsim an FSDP2 step through the INA offload was 0.85x gloo's."""
        self._check_usable()
        if len(bounds) != self.size or bounds[0][0] != 0 or bounds[-1][1] != buf.size or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds {bounds} must cover the {buf.size} elements in order, "
                             f"one part per rank ({self.size})")
        engine = self.fallback
        if engine is not self.ring:  # (gloo's peers: an allreduce, all of it, chosen)
            self.allreduce_flat(None, buf, op)
            return
        self._seq += 1
        try:
            engine.reduce_scatter(AllreduceCall(None, buf, op), bounds,
                                  Deadline(self.settings.timeout))
        except BaseException as exc:
            self._broken = (f"reduce-scatter #{self._seq} failed in engine {engine.name}: "
                            f"{exc!r}")
            raise
        self.stats.record(engine.name, buf.nbytes, [])

    def set_quorum(self, k: int, checked: bool = False) -> None:
        """Collective: the offload's calls from the next one on complete each chunk when
        k ranks contributed (0: every rank; docs/quorum.md). Every rank must ask the
        same k: AgreementError on every rank otherwise (``checked``: the caller compared
        the ranks' k already, as the Horovod runtime's negotiation does)."""
        self._check_usable()
        check_quorum(k)
        if not checked:
            # Its gate first, by the agreement: the call before may have ended without a
            # host collective, and a rank that could not finish it posts TROUBLE in the
            # next gate (an offload's gate would meet the next call, in the new mode,
            # with its own number).
            self.check_agreement(CallSignature(CallSignature.MPI_DIRECT, -1, -1, -1,
                                               f"set_quorum({k})"), through_offload=False)
            both = np.array([k, -k], np.int64)
            extremes = np.empty_like(both)
            wait(self.comm.Iallreduce(both, extremes, MPI.MAX),
                 Deadline(self.settings.timeout), lambda: "every rank to set the quorum")
            if extremes[0] != -extremes[1]:
                raise AgreementError(f"the ranks asked for different quorums (from "
                                     f"{-extremes[1]} to {extremes[0]}); every rank must "
                                     "call set_quorum with the same k")
        if self.offload is not None:
            self.offload.quorum.set(k)

    def quorum_active(self) -> bool:
        """Whether the offload's calls now complete with fewer than every rank (an
        AVERAGE then divides each chunk by the ranks it counted; docs/quorum.md)."""
        return self.offload is not None and self.offload.quorum.active()

    def check_agreement(self, signature: CallSignature, deadline: Deadline | None = None,
                        news: int = 0, through_offload: bool = True) -> int | None:
        """Count the call and, if enabled, check that all ranks made it alike (through
        the offload's gate where it takes them, unless not ``through_offload``: a call
        that changes the offload's mode, whose next call must not meet its gate there);
        rank 0's ``news`` (see agree), or None when the check is off."""
        self._check_usable()
        self._seq += 1
        if not self.settings.check_agreement:
            return None
        deadline = deadline or Deadline(self.settings.timeout)
        while True:  # (again after a gate that ended in a rescue: each one bounded)
            offload = self.offload
            if through_offload and offload is not None:
                gated = self._offload_gate(offload, identity(signature), signature,
                                           deadline)
                if gated is None:
                    continue
                if gated.outcome is not GateOutcome.NOT_HERE:
                    return 0  # (news is for what the offload lost: nothing is)
            agreed = self._agree(signature, deadline, news, None, self._width())
            if agreed is not None:
                return agreed.news

    def meet_trouble(self, what: str) -> None:
        """Collective with a rank that posts TROUBLE for the call this rank kept
        (``errors.kept_call``) while no gate of this communicator's owner comes of itself
        (the runtime, between negotiated rounds): one gate now, that rank's rescue
        through the offload, and nothing more (the others go on to their next call, whose
        gate that rank makes too)."""
        agreed = agree(self.comm, CallSignature(CallSignature.FINISH, -1, -1, -1, what),
                       self._seq + 1, Deadline(self.settings.timeout), 0, None,
                       self._width())
        if agreed.trouble:
            self.errors.rescue(what)
        self.errors.forget()

    def finish_calls(self) -> None:
        """Collective, before the communicator goes: a rank that could not finish the
        last call alone may still need what this rank kept of it (recovery.py). A gate
        of its own, bounded by the offload's silence bound (the time a call of its takes
        to give up) plus a margin; no answer only logs."""
        if self.errors.kept is None or not self.errors.gated:
            return
        signature = CallSignature(CallSignature.FINISH, -1, -1, -1, "finalize")
        bound = Deadline(self.errors.silence + 5.0)
        try:
            agreed = agree(self.comm, signature, self._seq + 1, bound, 0, None,
                           self._width())
            while agreed.trouble:  # (each gate bounded by what is left of ``bound``)
                self.errors.rescue("the last call before finalize")
                agreed = agree(self.comm, signature, self._seq + 1, bound, 0, None,
                               self._width())
        except Exception as exc:  # (the ranks may free at different times: log only)
            log.warning("at finalize, the ranks did not all confirm the last call: %s",
                        exc)
        self.errors.forget()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CommunicatorBroken(f"this communicator cannot be used any more: {self._broken}")


def _c_order_view(array: np.ndarray) -> np.ndarray | None:
    """A 1-D view of a C-contiguous array, or None if it has none."""
    return array.reshape(-1) if array.flags.c_contiguous else None


def _signature(recv: np.ndarray, op: Op) -> CallSignature:
    """The signature of an allreduce of ``recv`` with ``op``: what its gate compares."""
    return CallSignature(CallSignature.ARRAYS, recv.size, dtype_code(recv.dtype),
                         op_code(op), lambda: f"{recv.size} x {recv.dtype} {op.name}")


class Following(NamedTuple):
    """A call's arguments, as ``allreduce_flat`` takes them (its ``following``)."""

    send: np.ndarray | None
    recv: np.ndarray
    op: Op
    value_bits: int = 0
    key: Hashable = None
    present: int = 0


class _HostGate(HostGate):
    """The chooser's part of one call's gate, for the offload (engine.HostGate)."""

    def __init__(self, chooser: Collectives, signature: CallSignature, deadline: Deadline):
        self._chooser, self._signature, self._deadline = chooser, signature, deadline

    def boundary(self, news: int | None) -> bool:
        return self._chooser._call_boundary(news)

    def agree(self, news: int, proposal: np.ndarray | None, width: int) -> Agreed | None:
        return self._chooser._agree(self._signature, self._deadline, news, proposal, width)
