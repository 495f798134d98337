"""The engine choice (ina_collectives.collectives) on one rank: why each engine declines
a call, which engine serves it, the reasons recorded, and the chooser's argument checks;
the steps of a call with a scripted offload (``Scripted``): a predicted call, the
offload's gate and its outcomes, a call started over, one given up midway, the unchecked
path, the offload's hooks asked of it alone, and the reduce-scatter through the
protocol."""
from __future__ import annotations

import socket
import time
import types

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives import Collectives
from ina_collectives.collectives.engine import (
    AllreduceCall,
    Gated,
    GateOutcome,
    HandOver,
    OffloadEngine,
)
from ina_collectives.collectives.mpi_engine import MpiEngine
from ina_collectives.collectives.ops import Op
from ina_collectives.collectives.recovery import ErrorPath
from ina_collectives.collectives.ring import RingEngine
from ina_collectives.errors import CommunicatorBroken
from ina_collectives.ina.engine import InaEngine
from ina_collectives.settings import Settings


def call(dtype="float32", size=16, op=Op.SUM):
    return AllreduceCall(None, np.zeros(size, dtype), op)


def test_ring_declines_small_arrays_mpi_reduces_and_dtypes_it_lacks():
    ring = RingEngine(MPI.COMM_SELF, Settings(ring_min_bytes=1024))
    assert ring.declines(call(size=1024 // 4)) is None
    assert "below ring_min_bytes (1024)" in ring.declines(call(size=10))
    assert "complex64 is left to MPI" in ring.declines(call("complex64", 1000))


def test_mpi_declines_what_it_cannot_reduce():
    mpi = MpiEngine(MPI.COMM_SELF)
    assert mpi.declines(call("complex128")) is None
    assert "no MPI reduction for object" in mpi.declines(call("object"))


def test_ina_with_no_aggregator_answering_is_unavailable_with_the_reason(closed_udp_port):
    settings = Settings(switch=f"127.0.0.1:{closed_udp_port}", switch_join_timeout=0.3)
    engine = InaEngine(MPI.COMM_SELF, settings, ErrorPath(MPI.COMM_SELF, settings.timeout))
    try:
        reason = engine.declines(call(size=1 << 20))
        assert reason.startswith("ina: aggregator unavailable (rank 0: ")
        assert engine.link is None
    finally:
        engine.close()


class ServingAggregators:
    """What InaEngine asks of its aggregators to choose a call, as a set of one that
    serves (or none, with ``unavailable``'s reason) would answer: no link, no socket."""

    def __init__(self, unavailable: str | None = None):
        self.addresses, self.unavailable, self.released = [("127.0.0.1", 9)], unavailable, 0
        self.tree_rates = None  # (no topology file)

    def where(self, i: int) -> str:
        return "%s:%d" % self.addresses[i]

    def release(self) -> None:
        self.released += 1


def ina_engine(settings: Settings, aggregators: ServingAggregators) -> InaEngine:
    return InaEngine(MPI.COMM_SELF, settings, ErrorPath(MPI.COMM_SELF, settings.timeout),
                     aggregators)


def test_ina_declines_what_the_switch_cannot_sum():
    aggregators = ServingAggregators()
    engine = ina_engine(Settings(switch_min_bytes=1024), aggregators)
    try:
        assert engine.aggregators is aggregators
        assert engine.declines(call(size=1024)) is None
        assert engine.declines(call("float64", 1024, Op.AVERAGE)) is None
        assert "int32 is not a float" in engine.declines(call("int32", 1024))
        assert "op MAX is not SUM or AVERAGE" in engine.declines(call(size=1024, op=Op.MAX))
        assert "below switch_min_bytes (1024)" in engine.declines(call(size=8))
    finally:
        engine.close()
    assert aggregators.released == 1  # the engine's close releases them


def test_ina_with_no_aggregator_serving_declines_every_call_with_the_reason_first():
    why = "ina: aggregator unavailable (rank 0: no answer)"
    engine = ina_engine(Settings(switch_min_bytes=1024), ServingAggregators(why))
    try:
        assert engine.declines(call(size=1024)) == why
        assert engine.declines(call("int32", 8, Op.MAX)) == why
        assert engine.window_size() == 0
    finally:
        engine.close()


def test_each_call_the_ina_engine_declines_takes_the_next_engine_and_its_reason_is_counted():
    """A switch in this process serves the one float SUM over switch_min_bytes; an int32
    SUM, a float MAX and a float SUM under the threshold take the ring, each with the
    INA engine's reason in the call's passed_over and in fallback_reasons."""
    from tests.inputs import check_result, check_within_bound, make_input
    from tests.switch.test_server import switch_thread

    cases = [("float32", "sum", 50_000, 51), ("int32", "sum", 50_000, 52),
             ("float32", "max", 50_000, 53), ("float32", "sum", 10, 54)]
    with switch_thread() as sw:
        settings = Settings(switch="%s:%d" % sw.address, switch_min_bytes=1000,
                            ring_min_bytes=0)
        coll = Collectives(MPI.COMM_SELF, settings, InaEngine)
        try:
            passed_over = []
            for case in cases:
                got = coll.allreduce(make_input(*case, 0), op=case[1])
                (check_within_bound if case == cases[0] else check_result)(got, *case, 1)
                passed_over.append(coll.stats.last["passed_over"])
            snap = coll.stats.snapshot()
        finally:
            coll.free()
    assert passed_over == [[], ["ina: dtype int32 is not a float"],
                           ["ina: op MAX is not SUM or AVERAGE"],
                           ["ina: below switch_min_bytes (1000)"]]
    assert snap["engines"] == {"ina": 1, "ring": 3}, snap
    assert snap["fallback_reasons"] == {"ina: dtype int32 is not a float": 1,
                                        "ina: op MAX is not SUM or AVERAGE": 1,
                                        "ina: below switch_min_bytes (1000)": 1}


@pytest.fixture
def one_rank():
    coll = Collectives(MPI.COMM_SELF, Settings(ring_min_bytes=64))  # (no offload)
    yield coll
    coll.free()


def test_the_chooser_records_which_engine_served_and_why_others_declined(one_rank):
    small = one_rank.allreduce(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(small, np.arange(4, dtype=np.float32))
    assert one_rank.stats.last == {"engine": "mpi", "bytes": 16,
                                   "passed_over": ["ring: below ring_min_bytes (64)"]}
    big = np.arange(100, dtype=np.float64)
    out = one_rank.allreduce(big, op="average")
    np.testing.assert_array_equal(out, big)
    snap = one_rank.stats.snapshot()
    assert snap["engines"] == {"mpi": 1, "ring": 1} and snap["calls"] == 2
    assert snap["fallback_reasons"] == {"ring: below ring_min_bytes (64)": 1}
    z = np.array([1 + 2j, -3j], np.complex64)
    np.testing.assert_array_equal(one_rank.allreduce(z, op="average"), z)
    assert one_rank.stats.last["engine"] == "mpi"
    assert one_rank.stats.last["passed_over"] == ["ring: dtype complex64 is left to MPI"]
    ints = np.arange(-50, 50, dtype=np.int32)
    np.testing.assert_array_equal(one_rank.allreduce(ints, op=MPI.SUM), ints)
    assert one_rank.stats.last["engine"] == "ring" and one_rank.stats.calls == 4


def test_the_chooser_checks_its_arguments(one_rank):
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="AVERAGE is not defined for dtype int32"):
        one_rank.allreduce(np.ones(8, np.int32), op=Op.AVERAGE)
    with pytest.raises(TypeError, match="dtype object"):
        one_rank.allreduce(np.array([None] * 3))
    with pytest.raises(TypeError, match="dtype bool with op SUM is not supported"):
        one_rank.allreduce(np.ones(8, bool))
    with pytest.raises(TypeError, match="op MAX is not defined for dtype complex64"):
        one_rank.allreduce(np.ones(8, np.complex64), op="max")
    with pytest.raises(ValueError, match="out has shape"):
        one_rank.allreduce(x, out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="out has dtype"):
        one_rank.allreduce(x, out=np.empty(8, np.float64))
    with pytest.raises(ValueError, match="unknown op 'median'"):
        one_rank.allreduce(x, op="median")
    with pytest.raises(ValueError, match="MIN, MAX, AVERAGE; use ina_collectives.mpi"):
        one_rank.allreduce(x, op=MPI.MAXLOC)
    with pytest.raises(ValueError, match="value_bits must be 0"):
        one_rank.allreduce_flat(None, x, Op.SUM, 8)
    with pytest.raises(TypeError, match=r"key must be hashable .*got \(\['w'\],\)"):
        one_rank.allreduce_flat(None, x, Op.SUM, 0, (["w"],))
    assert one_rank.stats.calls == 0  # nothing reached an engine


def test_non_contiguous_and_in_place_calls(one_rank):
    x = np.arange(20, dtype=np.float32)[::2]
    np.testing.assert_array_equal(one_rank.allreduce(x), x)
    y = np.arange(10, dtype=np.float64)
    assert one_rank.allreduce(y, out=y) is y
    np.testing.assert_array_equal(y, np.arange(10, dtype=np.float64))


def test_mpi_declines_dtypes_this_mpi_cannot_reduce():
    mpi = MpiEngine(MPI.COMM_SELF)
    for taken in ("int8", "uint64", "float16", "complex64"):
        assert mpi.declines(call(taken)) is None, taken
    for refused in ("bool", "longdouble", "clongdouble", "datetime64[s]"):
        assert mpi.declines(call(refused)) == f"mpi: no MPI reduction for {np.dtype(refused)}"


@pytest.mark.parametrize("check_agreement", [True, False])
def test_an_absent_aggregator_is_passed_over_with_its_reason_and_tried_again(
        closed_udp_port, monkeypatch, check_agreement):
    """Absent at init: every call takes the ring and stats say why. Rank 0 looks for an
    answer at every call without waiting (its news rides on the call's agreement, or,
    with the agreement check off, on a broadcast of its own) and never blocks on a probe;
    it sends probes by its clock, not per call: at most one per PROBE_INTERVAL."""
    from ina_collectives.ina import aggregators as ina_engine

    settings = Settings(switch=f"127.0.0.1:{closed_udp_port}", switch_join_timeout=0.2,
                        switch_min_bytes=0, ring_min_bytes=0, check_agreement=check_agreement)
    coll = Collectives(MPI.COMM_SELF, settings, InaEngine)
    looks, sends = [], set()
    look = ina_engine._AnswerWatch.answered

    def looking(self):
        looks.append(coll.stats.calls + 1)
        seen = look(self)
        sends.add(self.sent_at)
        return seen

    monkeypatch.setattr(ina_engine._AnswerWatch, "answered", looking)
    monkeypatch.setattr(ina_engine._AnswerWatch, "PROBE_INTERVAL", 3600.0)
    try:
        x = np.arange(1000, dtype=np.float32)
        for _ in range(16):
            np.testing.assert_array_equal(coll.allreduce(x, op="average"), x)
        snap = coll.stats.snapshot()
        assert snap["engines"] == {"ring": 16}
        (reason,) = snap["fallback_reasons"]
        assert reason.startswith("ina: aggregator unavailable (rank 0: ") and \
            str(closed_udp_port) in reason, reason
        assert snap["fallback_reasons"][reason] == 16
        assert {k: snap["switch"][k] for k in ("serving", "outages", "returns")} == {
            "serving": False, "outages": 0, "returns": 0}
        assert looks == list(range(1, 17)), looks
        assert len(sends) == 1, sends  # one probe in the hour, not one per call
    finally:
        coll.free()


def test_rank_0_whose_installed_port_is_taken_keeps_calling_on_the_ring(closed_udp_port,
                                                                         caplog):
    """A job installed by a controller (INA_JOB, INA_WORKER_PORTS) whose aggregator is
    absent: rank 0 probes it as the installed worker, from its installed port. With that
    port taken by another process, no probe can be sent: every call still takes the
    ring (none fails), the warning says why once, and calls go on once it is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as free:
        free.bind(("0.0.0.0", 0))
        port = free.getsockname()[1]
    settings = Settings(switch=f"127.0.0.1:{closed_udp_port}", switch_join_timeout=0.2,
                        switch_min_bytes=0, ring_min_bytes=0, job=77,
                        worker_ports=str(port))
    coll = Collectives(MPI.COMM_SELF, settings, InaEngine)  # (its link had the port, closed)
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        taken.bind(("0.0.0.0", port))
        caplog.set_level("WARNING", logger="ina_collectives")
        x = np.arange(1000, dtype=np.float32)
        for _ in range(4):
            np.testing.assert_array_equal(coll.allreduce(x, op="average"), x)
        said = [r.getMessage() for r in caplog.records if "cannot probe" in r.getMessage()]
        assert len(said) == 1 and f":{port}" in said[0], said
        taken.close()
        for _ in range(2):
            np.testing.assert_array_equal(coll.allreduce(x, op="average"), x)
        assert coll.stats.snapshot()["engines"] == {"ring": 6}
    finally:
        taken.close()
        coll.free()


def test_one_rank_through_a_switch_that_starts_late(closed_udp_port):
    """The switch is absent at init and listens from the second call on: rank 0's
    probes (by its clock) find it, and the first call after the answer joins it; from
    then on calls go through the switch, within the bound. The schedule is time, not
    calls: calls 50 ms apart return within the 1 s bound of switch_retry_seconds (the
    test allows 5 s, for a loaded machine), and every call after is served."""
    from ina_collectives.switch.embedded import embedded_switch
    from tests.inputs import check_within_bound, make_input

    settings = Settings(switch=f"127.0.0.1:{closed_udp_port}", switch_join_timeout=0.5,
                        switch_min_bytes=0, ring_min_bytes=0)
    coll = Collectives(MPI.COMM_SELF, settings, InaEngine)
    try:
        x = make_input("float32", "sum", 5000, 7, 0)
        np.testing.assert_array_equal(coll.allreduce(x), x)
        with embedded_switch("--port", str(closed_udp_port)) as sw:
            listening = time.monotonic()
            engines = []
            while "ina" not in engines and time.monotonic() - listening < 5.0:
                check_within_bound(coll.allreduce(x), "float32", "sum", 5000, 7, 1)
                engines.append(coll.stats.last["engine"])
                time.sleep(0.05)  # a training step: the probe's answer comes meanwhile
            assert engines[-1] == "ina", engines
            for _ in range(3):
                check_within_bound(coll.allreduce(x), "float32", "sum", 5000, 7, 1)
                assert coll.stats.last["engine"] == "ina"
            state = coll.stats.snapshot()["switch"]
            assert (state["serving"], state["outages"], state["returns"]) == (True, 0, 1)
            coll.free()  # leaves the job while the switch runs
            assert sw.process.poll() is None, sw.lines
    finally:
        if coll.comm != MPI.COMM_NULL:
            coll.free()


def test_ina_with_one_of_two_aggregators_answering_serves_from_that_one(closed_udp_port):
    from ina_collectives.switch.embedded import embedded_switch
    from tests.inputs import check_within_bound, make_input

    with embedded_switch() as sw:
        settings = Settings(switch=f"{sw.address_text},127.0.0.1:{closed_udp_port}",
                            switch_join_timeout=0.3, switch_min_bytes=0, ring_min_bytes=0)
        coll = Collectives(MPI.COMM_SELF, settings, InaEngine)
        try:
            x = make_input("float32", "sum", 100_000, 9, 0)
            check_within_bound(coll.allreduce(x), "float32", "sum", 100_000, 9, 1)
            snap = coll.stats.snapshot()
            assert snap["engines"] == {"ina": 1}, snap
            first, second = snap["switch"]["aggregators"]
            assert first["serving"] and first["share"] == 1.0, first
            assert not second["serving"] and str(closed_udp_port) in second["why_not"], second
        finally:
            coll.free()


def test_a_job_granted_fewer_slots_runs_with_them_and_grows_when_they_free_up():
    """The switch's pool (8 slots) is shared: another job holds 6, so this one (asking 8)
    is granted 2 and runs with them; when the other leaves, a later call boundary asks
    again (after 1, 2 ... calls) and the job rejoins with all 8."""
    from ina_collectives import protocol as P
    from ina_collectives.ina.link import WorkerLink
    from ina_collectives.switch.embedded import embedded_switch
    from tests.inputs import check_within_bound, make_input

    with embedded_switch("--pool-slots", "8") as sw:
        holder = WorkerLink((sw.host, sw.port), P.JobFormat(77, 1, 1024), 0, 6)
        holder.join(5.0)
        settings = Settings(switch=sw.address_text, switch_slots=8, switch_min_bytes=0,
                            ring_min_bytes=0)
        coll = Collectives(MPI.COMM_SELF, settings, InaEngine)
        try:
            x = make_input("float32", "sum", 200_000, 12, 0)
            check_within_bound(coll.allreduce(x), "float32", "sum", 200_000, 12, 1)
            (state,) = coll.stats.snapshot()["switch"]["aggregators"]
            assert (state["slots"], state["slots_asked"]) == (2, 8), state
            holder.leave()
            holder.close()
            for _ in range(4):
                check_within_bound(coll.allreduce(x), "float32", "sum", 200_000, 12, 1)
            (state,) = coll.stats.snapshot()["switch"]["aggregators"]
            assert (state["slots"], state["slots_asked"]) == (8, 8), state
            assert coll.stats.snapshot()["engines"] == {"ina": 5}
        finally:
            coll.free()
        sw.stop()
    assert any("S 2 of 8 asked" in line for line in sw.lines), sw.lines


# -- the chooser's steps with an offload, scripted (collectives/engine.py: OffloadEngine) --


class Scripted(OffloadEngine):
    """An offload that takes float32 calls, 'reduces' by doubling (unlike one rank's
    exact engines, which leave the input as it is) and makes each gate as scripted: its
    own opening (``gates``: outcomes in turn, AGREED once they run out), a prediction
    (``predicts``: no gate at all), or the chooser's agreement; ``log`` records what
    the chooser asked of it and what it asked of the chooser's part of the gate."""

    name = "offload"

    def __init__(self, errors: ErrorPath, gates: bool = True, predicts: bool = False,
                 outcomes: tuple = (), handovers: tuple = ()):
        self.gating, self.predicting = gates, predicts
        self.outcomes, self.handovers = list(outcomes), list(handovers)
        self.log: list[tuple] = []
        self.quorum = types.SimpleNamespace(k=0)
        self.quorum.set = lambda k: setattr(self.quorum, "k", k)
        self.quorum.active = lambda: self.quorum.k > 0
        errors.set_rescue(lambda what: self.log.append(("help", what)), 2.0)

    def declines(self, call):
        return None if call.dtype == np.float32 else "offload: not float32"

    def _opened(self, host, proposal):
        if not host.boundary(0):
            return Gated(GateOutcome.RESTART)
        outcome = self.outcomes.pop(0) if self.outcomes else GateOutcome.AGREED
        self.log.append(("gate", proposal is not None, outcome))
        window = (proposal + 1 if outcome is GateOutcome.AGREED and proposal is not None
                  else None)
        return Gated(outcome, window, "" if outcome is GateOutcome.AGREED
                     else f"offload: gate {outcome}")

    def run(self, call, deadline, gate=None):
        proposal = np.array([0, 3, 5], np.int16)
        intact = (call.recv if call.send is None else call.send).copy()
        window = None
        if gate is None:
            self.log.append(("run", "unchecked"))
        elif self.gating and self.predicting:
            self.log.append(("run", "predicted", gate.boundary(0)))
        elif self.gating:
            opened = self._opened(gate, proposal)
            if opened.outcome is not GateOutcome.AGREED:
                return HandOver(opened.reason if opened.outcome is not GateOutcome.RESTART
                                else "", intact,
                                rechoose=opened.outcome is not GateOutcome.TO_FALLBACK,
                                mismatch=opened.outcome is GateOutcome.MISMATCH)
            window = opened.window
        else:
            agreed = gate.agree(self.news(), proposal, self.window_size())
            gate.boundary(agreed.news)
            window = agreed.window
        if window is not None:
            self.log.append(("run", window.tolist()))
        if self.handovers:
            handover = self.handovers.pop(0)(call)
            if handover is not None:
                return handover
        np.multiply(intact, 2, out=call.recv)
        return None

    def gate(self, ident, deadline, gate):
        if not self.gating:
            self.log.append(("gate", "not here"))
            return Gated(GateOutcome.NOT_HERE)
        return self._opened(gate, None)

    def window_size(self):
        return 3

    def news(self):
        return 0

    def at_call_boundary(self, seq, news):
        self.log.append(("boundary", seq, news))
        return True


def scripted(**script) -> tuple[Collectives, Scripted]:
    made = []

    def offload(comm, settings, errors):
        made.append(Scripted(errors, **script))
        return made[0]

    coll = Collectives(MPI.COMM_SELF, Settings(ring_min_bytes=0, **script.pop("more", {})),
                       offload)  # (the chooser reads no offload's settings)
    return coll, made[0]


def served(coll: Collectives, x: np.ndarray) -> tuple[list, str, list]:
    out = coll.allreduce(x)
    return out.tolist(), coll.stats.last["engine"], coll.stats.last["passed_over"]


def test_a_call_the_offload_serves_is_its_run_alone_with_the_choosers_part_of_the_gate():
    """Enabled, then Execute: the offload's run makes the gate (here a prediction), with
    the chooser's call boundary; the chooser asks nothing else of it."""
    coll, offload = scripted(predicts=True)
    try:
        assert served(coll, np.ones(4, np.float32)) == ([2.0] * 4, "offload", [])
        assert offload.log == [("boundary", 1, 0), ("run", "predicted", True)]
    finally:
        coll.free()


def test_a_gate_inside_the_offloads_run_restarts_the_call_or_hands_it_to_the_ring():
    """AGREED: the run goes on with the window. RESTART: nothing was lost, the call
    starts over (a new run, a new gate). TO_FALLBACK: a rank was running it, every rank
    takes the ring from the intact input and the reason is counted. A call the offload
    declines has the offload's own gate all the same (``gate``), before the ring runs."""
    coll, offload = scripted(outcomes=(GateOutcome.AGREED, GateOutcome.RESTART,
                                       GateOutcome.AGREED, GateOutcome.TO_FALLBACK))
    try:
        x = np.ones(4, np.float32)
        assert served(coll, x) == ([2.0] * 4, "offload", [])
        assert offload.log == [("boundary", 1, 0), ("gate", True, GateOutcome.AGREED),
                               ("run", [1, 4, 6])]
        offload.log.clear()
        assert served(coll, x) == ([2.0] * 4, "offload", [])
        assert [entry[0] for entry in offload.log] == ["boundary", "gate", "boundary",
                                                       "gate", "run"]
        assert served(coll, x) == ([1.0] * 4, "ring", ["offload: gate to_fallback"])
        offload.log.clear()
        assert served(coll, np.ones(4, np.float64)) == (
            [1.0] * 4, "ring", ["offload: not float32"])
        assert offload.log == [("boundary", 4, 0), ("gate", False, GateOutcome.AGREED)]
    finally:
        coll.free()


def test_a_mismatch_the_offloads_gate_saw_raises_on_every_rank_naming_it():
    from ina_collectives.errors import AgreementError

    coll, offload = scripted(outcomes=(GateOutcome.MISMATCH,))
    try:
        with pytest.raises(AgreementError, match="ranks disagree on the value width"):
            coll.allreduce(np.ones(4, np.float32))
        assert served(coll, np.ones(4, np.float32)) == ([2.0] * 4, "offload", [])
    finally:
        coll.free()


def test_a_call_no_rank_finished_starts_over_with_its_gate_and_its_reason_counted():
    def lost(call):
        offload.predicting = False  # (what served the prediction is lost)
        return HandOver("offload: lost", call.send.copy(), rechoose=True)

    coll, offload = scripted(predicts=True, handovers=(lost,))
    try:
        assert served(coll, np.ones(4, np.float32)) == ([2.0] * 4, "offload",
                                                        ["offload: lost"])
        assert [entry[0] for entry in offload.log] == ["boundary", "run", "boundary",
                                                       "gate", "run"]
    finally:
        coll.free()


def test_a_call_given_up_midway_is_finished_on_the_fallback_from_its_intact_input():
    """The offload did the first half (doubled) and hands the second over: the ring
    finishes those elements from the intact input; the reason is counted. Its gate was
    the chooser's agreement, with the offload's proposal, and the offload's boundary."""
    def half(call):
        intact = call.send.copy()
        call.recv[:2] = intact[:2] * 2
        return HandOver("offload: failed midway", intact, [(2, 4)])

    coll, offload = scripted(gates=False, handovers=(half,))
    try:
        assert served(coll, np.ones(4, np.float32)) == (
            [2.0, 2.0, 1.0, 1.0], "ring", ["offload: failed midway"])
        assert offload.log == [("boundary", 1, 0), ("run", [0, 3, 5])]
        offload.log.clear()  # a call the offload declines: it makes no gate, MPI does
        assert served(coll, np.ones(4, np.float64)) == ([1.0] * 4, "ring",
                                                        ["offload: not float32"])
        assert offload.log == [("gate", "not here"), ("boundary", 2, 0)]
    finally:
        coll.free()


def test_unchecked_calls_have_a_boundary_before_the_choice_and_no_gate():
    coll, offload = scripted(outcomes=(GateOutcome.MISMATCH,),
                             more={"check_agreement": False})
    try:
        assert served(coll, np.ones(4, np.float32)) == ([2.0] * 4, "offload", [])
        assert offload.log == [("boundary", 1, None), ("run", "unchecked")]
    finally:
        coll.free()


def test_the_offloads_quorum_and_rescue_are_asked_of_it_alone():
    coll, offload = scripted()
    try:
        assert not coll.quorum_active()
        coll.set_quorum(1, checked=True)
        assert coll.quorum_active() and offload.quorum.k == 1
        coll.errors.rescue("call #3")
        assert offload.log[-1] == ("help", "call #3") and coll.errors.silence == 2.0
    finally:
        coll.free()
    ring_only = Collectives(MPI.COMM_SELF, Settings(switch=""))
    try:
        assert ring_only.offload is None
        assert not ring_only.quorum_active()
        with pytest.raises(CommunicatorBroken, match="could not finish call #3, and this "
                                                     "communicator has no engine"):
            ring_only.errors.rescue("call #3")
    finally:
        ring_only.free()


def test_a_reduce_scatter_goes_through_the_fallbacks_own_and_an_engine_without_one_reduces_all():
    coll = Collectives(MPI.COMM_SELF, Settings(switch=""))
    try:
        buf = np.arange(6, dtype=np.float32)
        coll.reduce_scatter_flat(buf, Op.SUM, [(0, 6)])
        assert buf.tolist() == list(range(6))
        assert coll.stats.last["engine"] == "ring"
        with pytest.raises(ValueError, match="must cover the 6 elements"):
            coll.reduce_scatter_flat(buf, Op.SUM, [(0, 5)])
    finally:
        coll.free()
    mpi = MpiEngine(MPI.COMM_SELF)
    x = np.arange(4, dtype=np.float64)
    mpi.reduce_scatter(AllreduceCall(None, x, Op.AVERAGE), [(0, 4)], None)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    ring = RingEngine(MPI.COMM_SELF, Settings())
    with pytest.raises(ValueError, match="in place"):
        ring.reduce_scatter(AllreduceCall(x, x.copy(), Op.SUM), [(0, 4)], None)


def test_set_quorum_makes_its_gate_by_the_agreement_before_its_check(monkeypatch):
    """The call before may have ended without a host collective, and a rank that could
    not finish it posts TROUBLE in the next gate: set_quorum's first collective is the
    agreement's gate (never the offload's), then the ranks compare k; ranks that differ
    all raise, naming the range."""
    from ina_collectives.collectives import chooser
    from ina_collectives.errors import AgreementError
    from tests.threadcomm import ThreadPeers, run_ranks

    gates = []
    plain = chooser.agree

    def counting(comm, call, *args, **kwargs):
        gates.append(call.describe())
        return plain(comm, call, *args, **kwargs)
    monkeypatch.setattr(chooser, "agree", counting)

    def rank(comm):
        coll = Collectives(comm, Settings(switch="", timeout=5.0))
        try:
            coll.set_quorum(1)
            try:
                coll.set_quorum(1 + comm.Get_rank())
            except AgreementError as exc:
                return str(exc)
            return None
        finally:
            coll.free()

    results = run_ranks(2, rank, timeout=30, kind=ThreadPeers)
    assert sorted(gates) == ["set_quorum(1)"] * 3 + ["set_quorum(2)"], gates
    assert all(r and "different quorums (from 1 to 2)" in r for r in results), results
