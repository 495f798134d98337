"""The chooser: one communicator's collectives. It checks a call, picks its engine, hands
a call an engine gave up to the fallback, and keeps the stats. The only place that
decides which engine serves a call, and the owner of the communicator's error path
(recovery.py). It knows engines only by the protocol of engine.py: a switch engine is
given to it (``switch_engine``), so this layer never imports one."""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..errors import AggregatorUnavailable, AgreementError, CommunicatorBroken
from ..settings import Settings
from .agreement import Agreed, CallSignature, agree, columns, disagree, identity
from .engine import AllreduceCall, Engine, HandOver, Opened, was_refused
from .mpi_engine import MpiEngine
from .ops import Op, as_op, check_quorum, check_supported, dtype_code, op_code
from .peers import TorchPeers
from .recovery import ErrorPath
from .ring import RingEngine
from .stats import Stats
from .waiting import Deadline, wait, watch_run

log = logging.getLogger("ina_collectives")


class Collectives:
    """The library's state for one communicator (what Horovod calls its global state)."""

    def __init__(self, comm: MPI.Intracomm | TorchPeers, settings: Settings,
                 switch_engine: Callable[[Any, Settings, ErrorPath], Engine] | None = None):
        """``switch_engine(comm, settings, error_path)`` makes the engine that serves
        calls through the aggregators INA_SWITCH names (ina.InaEngine; collective),
        tried first; needed where ``settings.switch`` is set."""
        # The peers: an MPI communicator, or (no MPI job: torchrun) a torch one.
        if not isinstance(comm, (MPI.Intracomm, TorchPeers)) or comm == MPI.COMM_NULL:
            raise TypeError(f"expected an mpi4py intracommunicator, got {comm!r}")
        # The library's logger level, unless the user's logging configuration set one.
        if log.level == logging.NOTSET or getattr(log, "_ina_level", None) == log.level:
            log.setLevel(settings.log_level.upper())
            log._ina_level = log.level  # type: ignore[attr-defined]
        # Our own copy of the communicator: the ring's messages never match the user's.
        if settings.require_switch and not settings.switch:
            raise AggregatorUnavailable("INA_REQUIRE_SWITCH is set but no switch is "
                                        "configured: set INA_SWITCH=host:port")
        if settings.switch and switch_engine is None:
            raise ValueError("INA_SWITCH is set, and this communicator was given no switch "
                             "engine (pass switch_engine=ina_collectives.ina.InaEngine)")
        watch_run(settings.run_dir)  # (ina-run's mark of a failed rank ends every wait)
        self.comm = comm.Dup()
        self.settings = settings
        self.stats = Stats()
        self.errors = ErrorPath(self.comm, settings.timeout)
        # The exact engine that finishes a call another engine gave up midway: the ring,
        # or where it cannot run (gloo's peers, no MPI job) the peers' own allreduce.
        self.ring = RingEngine(self.comm, settings)
        self.fallback: Engine = self.ring if self.ring.usable else MpiEngine(self.comm)
        # Without INA_SWITCH there is no switch engine at all (no fallback reason to count).
        try:
            self.switch_engine = (switch_engine(self.comm, settings, self.errors)
                                  if settings.switch else None)
        except BaseException:
            self.comm.Free()  # init failed: nothing of it stays
            raise
        if settings.check_agreement:  # every call starts with the agreement: a gate
            self.errors.set_gate(lambda: columns(self._window_size()))
        self.engines: list[Engine] = ([self.switch_engine] if self.switch_engine else []) + [
            self.ring, MpiEngine(self.comm)]
        self.stats.reports = [engine.report for engine in self.engines]
        self._seq = 0
        self._broken: str | None = None

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
                       value_bits: int = 0) -> None:
        """The core call: 1-D contiguous ``recv`` (and ``send``, or None for in place).
        ``value_bits``: 16 asks the switch for 16-bit values for this call (the caller
        has made sure every rank asks alike: the runtime's negotiation does). The caller
        checked that an engine takes the dtype and op (ops.check_supported)."""
        self._check_usable()
        if value_bits not in (0, *P.VALUE_BITS):
            raise ValueError(f"value_bits must be 0 (the job's), 32 or 16, got {value_bits}")
        call = AllreduceCall(send, recv, op, value_bits)
        deadline = Deadline(self.settings.timeout)
        signature = CallSignature(
            CallSignature.ARRAYS, recv.size, dtype_code(recv.dtype), op_code(op),
            lambda: f"{recv.size} x {recv.dtype} {op.name}")
        self._seq += 1
        ran = False  # (a predicted call runs in the loop: it may have to start over)
        started_over: list[str] = []
        while True:
            if not self.settings.check_agreement:
                prepared = agreed = None
                self._at_call_boundary(None)
                engine, passed_over = self._choose(call)
                break
            engine, passed_over = self._choose(call)
            opener = self._opener()
            if opener is not None:
                # The gate through the switch: the call's opening agrees on the call and
                # on a switch call's first window, with no host collective; a call that
                # repeats one the switch served needs no opening: its own packets carry
                # its identity and predicted exponents (docs/protocol.md, One round trip).
                prepared = engine.prepare(call)
                if engine is opener and opener.predicts(
                        identity(signature, call.value_bits), prepared):
                    layout = self._layout()
                    self._at_call_boundary(0)
                    if self._layout() != layout:
                        continue
                    agreed, ran = None, True
                    handover = self._run(engine, call, deadline, prepared, None, signature)
                    if handover is not None and handover.rechoose:
                        # No rank finished it and nothing of it moved: every rank starts
                        # the call over, its gate included (the switch is lost).
                        started_over.append(handover.reason)
                        continue
                    break
                opened = self._open(opener, signature, call.value_bits, deadline, prepared)
                if opened is None:
                    continue  # an opening failed and nothing was lost: choose again
                agreed = Agreed(0, opened.window)
                if opened.outcome == "to_ring":  # a rank was streaming it: all take the ring
                    passed_over.append(opened.reason)
                    engine, prepared, agreed = self.fallback, None, None
                break
            # One gate per call: the agreement also agrees on a switch call's first
            # window of exponents, as long as every rank's window (window_size).
            width = self._window_size()
            prepared = engine.prepare(call, width)
            agreed = self._agree(signature, deadline, self._answers_again(),
                                 prepared.proposal if prepared is not None else None, width)
            if agreed is None:
                continue  # a rescue ran (the aggregator may be gone): choose again
            layout = self._layout()  # a call boundary, the same on every rank
            self._at_call_boundary(agreed.news)
            if self._layout() != layout:  # joined again, or grown: choose again
                engine, passed_over = self._choose(call)
                prepared = None
            break
        first = (agreed.window[:prepared.proposal.size]
                 if prepared is not None and agreed is not None else None)
        try:
            passed_over = started_over + passed_over
            if not ran:
                handover = self._run(engine, call, deadline, prepared, first, signature)
            if handover is not None and handover.rechoose:  # its opening failed
                passed_over.append(handover.reason)
                engine, more = self._choose(call)
                passed_over += more
                engine.run(call, Deadline(self.settings.timeout))
            elif handover is not None:  # given up midway, alike on every rank: start again
                engine = self.fallback
                passed_over.append(handover.reason)
                # The bound restarts: the engine that gave up may have used it all.
                restart = Deadline(self.settings.timeout)
                for start, stop in handover.ranges or [(0, call.recv.size)]:
                    part = call.recv[start:stop]
                    np.copyto(part, handover.intact[start:stop], casting="unsafe")
                    engine.run(AllreduceCall(None, part, op), restart)
        except AgreementError:
            raise  # every rank raised together (``_run``): the communicator stays usable
        except BaseException as exc:
            # Part of the operation may still be in flight: nothing later is safe. (Not
            # when MPI refused the call's arguments before it started: mpi4py's caller
            # gets MPI's exception and goes on.)
            if not was_refused(exc):
                self._broken = (f"allreduce #{self._seq} failed in engine {engine.name}: "
                                f"{exc!r}")
            raise
        self.stats.record(engine.name, recv.nbytes, passed_over)

    def _run(self, engine: Engine, call: AllreduceCall, deadline: Deadline,
             prepared: Any, first: np.ndarray | None, signature: CallSignature
             ) -> HandOver | None:
        """``engine.run``; an exception leaves the communicator broken (part of the call
        may be in flight), unless MPI refused the call's arguments before it started. A
        call the switch saw the ranks make differently (``HandOver.mismatch``) raises
        AgreementError on every rank, naming what differs (``disagree``)."""
        try:
            handover = engine.run(call, deadline, prepared, first)
            if handover is not None and handover.mismatch:
                disagree(self.comm, signature, self._seq, deadline, self._window_size())
            return handover
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            if not was_refused(exc):
                self._broken = (f"allreduce #{self._seq} failed in engine {engine.name}: "
                                f"{exc!r}")
            raise

    # -- the engines' hooks, asked of every engine alike --------------------------------

    def _opener(self) -> Engine | None:
        """The engine through which the next call's gate opens, if any does."""
        return next((engine for engine in self.engines if engine.opens()), None)

    def _window_size(self) -> int:
        return max(engine.window_size() for engine in self.engines)

    def _answers_again(self) -> int:
        return max(engine.answers_again() for engine in self.engines)

    def _layout(self) -> tuple:
        return tuple(engine.layout() for engine in self.engines)

    def _at_call_boundary(self, news: int | None) -> None:
        for engine in self.engines:
            engine.at_call_boundary(self._seq, news)

    def help_rescue(self, what: str) -> None:
        """Collective, when a gate (this communicator's, or its owner's) showed TROUBLE:
        this rank takes part in the rescue (recovery.py) through the engine whose calls
        end without a vote."""
        if not any(engine.help_rescue(what) for engine in self.engines):
            raise CommunicatorBroken(f"a rank could not finish {what}, and this "
                                     "communicator has no switch engine")

    def next_collective_is_gate(self, columns: int | None) -> None:
        """The owner of this communicator's next collective (the runtime: its negotiation,
        or the next call's opening) says whether it is a gate, whose rows are
        ``columns`` int64 values, or (None) not one: a switch call then ends with a vote
        (recovery.py)."""
        self.errors.set_gate(None if columns is None else (lambda: columns),
                             background=True)

    def past_gate(self) -> None:
        """The owner's gate passed without TROUBLE: every rank is past its last call."""
        self.errors.forget()

    def _open(self, opener: Engine, signature: CallSignature, value_bits: int,
              deadline: Deadline, prepared: Any = None) -> Opened | None:
        """The gate while the switch serves and takes openings: the call's opening
        (``opener.open``), this call's number a call boundary first. None when the ranks
        must choose again (an opening failed, or the aggregators changed); raises
        AgreementError on every rank when the switch saw their calls differ."""
        layout = self._layout()
        self._at_call_boundary(0)
        if self._layout() != layout:
            return None
        try:
            opened = opener.open(identity(signature, value_bits), prepared, deadline)
            if opened.outcome == "mismatch":
                disagree(self.comm, signature, self._seq, deadline, self._window_size())
        except AgreementError:
            raise  # every rank raised together: the communicator stays usable
        except BaseException as exc:
            self._broken = f"the opening of allreduce #{self._seq} failed: {exc!r}"
            raise
        return None if opened.outcome == "restart" else opened

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

    def _agree(self, signature: CallSignature, deadline: Deadline, news: int = 0,
               window: np.ndarray | None = None, width: int = 0) -> Agreed | None:
        """The gate: agree, or (a rank could not finish its last switch call) run the
        rescue and return None."""
        try:
            agreed = agree(self.comm, signature, self._seq, deadline, news, window, width)
            if agreed.trouble:
                self.help_rescue(f"the switch call before allreduce #{self._seq}")
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
        negotiation does; and that an engine takes the dtype and op). On the ring: by
        arithmetic the switch gives a reduce-scatter no bandwidth (it moves all of buf
        each way per worker, the ring (n-1)/n of it), and measured on netsim an FSDP2
        step with it was 0.85x gloo's."""
        self._check_usable()
        if len(bounds) != self.size or bounds[0][0] != 0 or bounds[-1][1] != buf.size or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds {bounds} must cover the {buf.size} elements in order, "
                             f"one part per rank ({self.size})")
        if not self.ring.usable:  # (gloo's peers: their allreduce, all of it)
            self.allreduce_flat(None, buf, op)
            return
        self._seq += 1
        deadline = Deadline(self.settings.timeout)
        try:
            self.ring.ring.reduce_scatter(buf, op, bounds, deadline)
        except BaseException as exc:
            self._broken = f"reduce-scatter #{self._seq} failed on the ring: {exc!r}"
            raise
        self.stats.record(self.ring.name, buf.nbytes, [])

    def set_quorum(self, k: int, checked: bool = False) -> None:
        """Collective: the switch-served calls from the next one on complete each chunk
        when k workers contributed (0: sync; docs/quorum.md). Every rank must ask the
        same k: AgreementError on every rank otherwise (``checked``: the caller compared
        the ranks' k already, as the Horovod runtime's negotiation does)."""
        self._check_usable()
        check_quorum(k)
        if not checked:
            both = np.array([k, -k], np.int64)
            extremes = np.empty_like(both)
            wait(self.comm.Iallreduce(both, extremes, MPI.MAX),
                 Deadline(self.settings.timeout), lambda: "every rank to set the quorum")
            if extremes[0] != -extremes[1]:
                raise AgreementError(f"the ranks asked for different quorums (from "
                                     f"{-extremes[1]} to {extremes[0]}); every rank must "
                                     "call set_quorum with the same k")
        for engine in self.engines:
            engine.set_quorum(k)

    def opens_served(self, dtype: np.dtype, op: Op, nbytes: int) -> bool:
        """Whether an allreduce of this dtype, op and size, made next, would open through
        the switch and be served by it (the runtime's gate for the call before it:
        a rank in trouble meets the others when their opening fails, recovery.py)."""
        return any(engine.opens_served(np.dtype(dtype), op, nbytes)
                   for engine in self.engines)

    def quorum_active(self) -> bool:
        """Whether switch-served calls now complete with fewer than every worker (an
        AVERAGE then divides each chunk by the workers it counted; docs/quorum.md)."""
        return any(engine.quorum_active() for engine in self.engines)

    def check_agreement(self, signature: CallSignature, deadline: Deadline | None = None,
                        news: int = 0) -> int | None:
        """Count the call and, if enabled, check that all ranks made it alike; rank 0's
        ``news`` (see agree), or None when the check is off."""
        self._check_usable()
        self._seq += 1
        if not self.settings.check_agreement:
            return None
        while True:
            opener = self._opener()
            if opener is not None:
                if self._open(opener, signature, 0,
                              deadline or Deadline(self.settings.timeout)):
                    return 0  # (news is for a missing aggregator: none is)
                continue
            width = self._window_size()
            agreed = self._agree(signature, deadline or Deadline(self.settings.timeout),
                                 news, None, width)
            if agreed is not None:
                return agreed.news

    def finish_calls(self) -> None:
        """Collective, before the communicator goes: a rank that could not finish the
        last switch call alone may still need this rank's kept window (recovery.py). A
        gate of its own, bounded by the silence bound (the time a stream takes to give
        up) plus a margin; no answer only logs."""
        if self.errors.kept is None or not self.errors.gated:
            return
        signature = CallSignature(CallSignature.FINISH, -1, -1, -1, "finalize")
        bound = Deadline(self.settings.switch_silence + 5.0)
        try:
            while True:
                width = self._window_size()
                agreed = agree(self.comm, signature, self._seq + 1, bound, 0, None, width)
                if not agreed.trouble:
                    break
                self.help_rescue("the last switch call")
        except Exception as exc:  # (the ranks may free at different times: log only)
            log.warning("at finalize, the ranks did not all confirm the last switch "
                        "call: %s", exc)
        self.errors.forget()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CommunicatorBroken(f"this communicator cannot be used any more: {self._broken}")


def _c_order_view(array: np.ndarray) -> np.ndarray | None:
    """A 1-D view of a C-contiguous array, or None if it has none."""
    return array.reshape(-1) if array.flags.c_contiguous else None
