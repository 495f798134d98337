"""The switch's behaviour, the same test body on both aggregators: the software switch
(``ina-switch``) and the P4 program on BMv2 (``simple_switch_grpc``), each in a network
namespace with the workers in namespaces of their own, each configured by the project's
controller over P4Runtime (tests/integration/fabric.py).

The BMv2 cases carry the ``bmv2`` marker and skip, with one reason, where p4c and BMv2
are not found (ina_collectives/testing/bmv2.py: PATH, then $P4TOOLS_DIR or
/opt/p4tools). Every case needs root (namespaces). BMv2 forwards a few thousand packets
a second: tensors stay small.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.testing import bmv2
from tests.conftest import needs_p4_extra, needs_root
from tests.inputs import check_within_bound
from tests.integration import rank_cases

pytest.importorskip("pyroute2", reason="the namespaces need pyroute2 (the bench extra)")
from tests.integration.fabric import KINDS, Fabric  # noqa: E402

pytestmark = [pytest.mark.mpi, needs_root, needs_p4_extra]

needs_bmv2 = pytest.mark.skipif(bmv2.find_tools() is None, reason=bmv2.missing_tools())
# The two aggregators: BMv2's cases are marked, and skip without the toolchain.
AGGREGATORS = [pytest.param("software", id="software"),
               pytest.param("bmv2", id="bmv2", marks=[pytest.mark.bmv2, needs_bmv2])]
# Builds (K, S, B, V): 32-bit values in sub-blocks of 8, and the 16-bit build.
BUILD32 = (32, 64, 8, 32)
BUILD16 = (64, 64, 16, 16)
N = 4  # worker namespaces of every fabric
# (every call opened: a call that repeats another with other inputs would go predicted,
# summed with the exponents the last one needed, and the bound of exact exponents
# checked here would not hold: tests/ina/test_predicted.py has that bound)
NO_THRESHOLDS = {"switch_min_bytes": 0, "ring_min_bytes": 0, "switch_predict": False}


class Fabrics:
    """The module's fabrics, one per (aggregator, build), made on first use; one runs at
    a time (they share the addresses)."""

    def __init__(self, tmp_path_factory):
        self.tmp = tmp_path_factory
        self.current: tuple | None = None
        self.fabric: Fabric | None = None

    def get(self, kind: str, build: tuple = BUILD32) -> Fabric:
        if self.current != (kind, build):
            self.close()
            self.fabric = Fabric(kind, N, *build, log_dir=self.tmp.mktemp(kind))
            self.fabric.__enter__()
            self.current = (kind, build)
        return self.fabric

    def close(self) -> None:
        if self.fabric is not None:
            self.fabric.close()
        self.fabric, self.current = None, None


@pytest.fixture(scope="module")
def fabrics(tmp_path_factory):
    made = Fabrics(tmp_path_factory)
    yield made
    made.close()


@pytest.fixture(scope="module", params=AGGREGATORS)
def aggregator(request):
    """The aggregator a case runs on. Module-scoped, so that pytest runs every case of
    one aggregator in a row and its fabric is built once, not once per case."""
    return request.param


@pytest.fixture
def fabric(fabrics, aggregator):
    """The fabric of the test's aggregator (parametrized as ``aggregator``), 32-bit
    build; a switch the test killed is started again and the loss rules cleared after."""
    f = fabrics.get(aggregator)
    yield f
    f.set_loss(0)
    if not f.switch_running():
        fabrics.close()  # the next test makes a fresh one


_job_ids = iter(range(100, 60000))


@pytest.fixture
def new_job():
    """``new_job(fabric, workers, slots=8, slot_base=0)``: a job installed through the
    controller, torn down after the test (where its switch still runs)."""
    made = []

    def install(fabric: Fabric, workers, slots=8, slot_base=0):
        job = fabric.job(next(_job_ids), workers, slots=slots, slot_base=slot_base)
        fabric.configure(job)
        made.append((fabric, job))
        return job

    yield install
    for fabric, job in made:
        if fabric.switch_running():
            with fabric.controller() as c:
                c.teardown(job)


def assert_served_and_within_bound(results, cases, n, build, rounds=1):
    k, _, block, bits = build
    for i, case in enumerate(cases * rounds):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, n, k=k, block=block, bits=bits)
    for r in results:
        assert r["stats"]["engines"] == {"ina": len(cases) * rounds}, (
            r["stats"]["engines"], r["stats"].get("fallback_reasons"))


# -- sync allreduce -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("build", [BUILD32, BUILD16], ids=["int32", "int16"])
def test_sync_allreduce_is_served_within_the_bound(fabrics, aggregator, build, n, new_job):
    fabric = fabrics.get(aggregator, build)
    job = new_job(fabric, list(range(n)))
    cases = [("float32", "sum", 5 * build[0] + 3, 1), ("float64", "average", 700, 2),
             ("float32", "sum", 3000, 3)]
    results = fabric.run(job, rank_cases.ina_cases, {"cases": cases, "rounds": 2,
                                            "settings": NO_THRESHOLDS})
    assert_served_and_within_bound(results, cases, n, build, rounds=2)
    with fabric.controller() as c:
        drops = c.read_drops()
    assert drops.get("unknown worker", 0) == 0 and drops.get("malformed", 0) == 0, drops


@pytest.mark.bmv2
@needs_bmv2
def test_results_are_bit_identical_on_both_aggregators(fabrics, new_job):
    """The same inputs through the software switch and through BMv2: the same bits."""
    cases = [("float32", "sum", 1000, 7), ("float64", "average", 333, 8),
             ("float16", "sum", 257, 9)]
    outcome = {}
    for kind in KINDS:
        fabric = fabrics.get(kind)
        job = new_job(fabric, [0, 1, 2])
        results = fabric.run(job, rank_cases.ina_cases, {"cases": cases, "settings": NO_THRESHOLDS})
        assert all(r["stats"]["engines"] == {"ina": 3} for r in results), kind
        outcome[kind] = [x.tobytes() for x in results[0]["results"]]
    assert outcome["software"] == outcome["bmv2"]


# -- the links and the cells ---------------------------------------------------------------

def test_loss_on_the_links_both_ways_gives_the_same_results(fabric, aggregator, new_job):
    job = new_job(fabric, [0, 1, 2])
    # (About 300 packets each way: at 3% loss some are lost but for 0.97^300, 1e-4. At
    # 2000 and 1500 values, about 70, none were lost in one CI run in ten or so.)
    cases = [("float32", "sum", 8000, 11), ("float32", "average", 6000, 12)]
    clean = fabric.run(job, rank_cases.ina_cases, {"cases": cases, "settings": NO_THRESHOLDS})
    fabric.set_loss(0.03)
    lossy = fabric.run(job, rank_cases.ina_cases, {"cases": cases, "settings": {
        **NO_THRESHOLDS, "switch_silence": 10.0}}, timeout=240)
    dropped = fabric.dropped()
    fabric.set_loss(0)
    assert dropped > 0
    for a, b in zip(clean, lossy):
        assert [x.tobytes() for x in a["results"]] == [x.tobytes() for x in b["results"]]
        assert b["stats"]["engines"] == {"ina": 2}, b["stats"].get("fallback_reasons")


def test_a_leaf_under_a_root_serves_every_call_with_loss_at_each_level(fabric, aggregator):
    """The aggregator as a tree's leaf (docs/trees.md; its ina_parents entry, installed by
    the controller): two ranks under it, and a root above it, a software switch in the
    fabric's fourth namespace whose one worker is the leaf. Every sum goes up once and
    its result comes down once; with 3% loss on every link (the root's too) the resends
    go up through the leaf, and every call returns the same bits on the switch."""
    job_id = next(_job_ids)
    cases = [("float32", "sum", 8000, 21), ("float64", "average", 3000, 22)]
    with fabric.root(3, job_id, slots=8) as parent:
        job = dataclasses.replace(fabric.job(job_id, [0, 1]), parent=parent)
        fabric.configure(job)
        try:
            with fabric.controller() as c:
                before = c.read_leaf()
            clean = fabric.run(job, rank_cases.ina_cases, {"cases": cases,
                                                           "settings": NO_THRESHOLDS})
            assert_served_and_within_bound(clean, cases, 2, BUILD32)
            with fabric.controller() as c:
                after = c.read_leaf()
            grew = {e: after[e] - before[e] for e in after}
            assert grew["sent_up"] == grew["came_down"] > 0, grew
            fabric.set_loss(0.03)
            lossy = fabric.run(job, rank_cases.ina_cases, {"cases": cases, "settings": {
                **NO_THRESHOLDS, "switch_silence": 10.0}}, timeout=240)
            dropped = fabric.dropped()
            fabric.set_loss(0)
            assert dropped > 0
            with fabric.controller() as c:
                lost = {e: v - after[e] for e, v in c.read_leaf().items()}
            # (About 500 packets cross the root's link: some are lost but for 0.97^500.)
            assert lost["resent_up"] > 0 and lost["came_down"] >= lost["sent_up"] > 0, lost
            for a, b in zip(clean, lossy):
                assert [x.tobytes() for x in a["results"]] == [x.tobytes()
                                                               for x in b["results"]]
                assert b["stats"]["engines"] == {"ina": 2}, b["stats"].get("fallback_reasons")
        finally:
            with fabric.controller() as c:
                c.teardown(job)


def test_runs_after_runs_reuse_the_cells_with_a_new_epoch(fabric, aggregator, new_job):
    """One job configured once, three runs: each starts its slots at version 0, and the
    run's epoch makes the last run's cells idle, so each gets its own sums."""
    job = new_job(fabric, [0, 1], slots=2)
    for run in range(3):
        case = ("float32", "sum", 40, 20 + run)  # another seed: a stale answer differs
        results = fabric.run(job, rank_cases.ina_cases,
                             {"cases": [case], "settings": NO_THRESHOLDS})
        assert_served_and_within_bound(results, [case], 2, BUILD32)


def test_two_jobs_side_by_side(fabric, aggregator, new_job):
    jobs = [new_job(fabric, [0, 1], slots=4, slot_base=0),
            new_job(fabric, [2, 3], slots=4, slot_base=4)]
    case = ("float32", "sum", 20 * 32 + 1)

    def run(j):
        return fabric.run(jobs[j], rank_cases.ina_cases, {"cases": [(*case, 80 + j)], "rounds": 3,
                                                 "settings": NO_THRESHOLDS})

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(run, range(2)))
    chunks = -(-case[2] // BUILD32[0])
    with fabric.controller() as c:
        counted = [c.read_job_results(job.job_id) for job in jobs]
    for j, results in enumerate(outcomes):
        assert_served_and_within_bound(results, [(*case, 80 + j)], 2, BUILD32, rounds=3)
    assert counted == [3 * chunks, 3 * chunks]


def test_quorum_set_and_changed_through_p4runtime_mid_run(fabric, aggregator, new_job,
                                                          tmp_path):
    """The controller asks the running job for quorum 2, later quorum 3 (P4Runtime writes
    of its ina_modes entry): every rank switches at the same call each time, and every
    call gives every rank the same bits."""
    job = new_job(fabric, [0, 1, 2, 3], slots=4)
    running, wait, go = _paced(fabric, job, tmp_path, 16, {"3": "two", "9": "three"},
                               {"quorum_max_steps": 0})
    with fabric.controller() as c:
        wait("two")
        c.set_mode(job.job_id, 2)
        go("two")
        wait("three")
        generation = c.set_mode(job.job_id, 3)
        go("three")
        results = running.result(timeout=180)
        assert c.read_mode(job.job_id) == (3, generation)
    stamps = [r["quorum"] for r in results]
    assert all(s == stamps[0] for s in stamps), stamps
    seen = [q for i, q in enumerate(stamps[0]) if i == 0 or q != stamps[0][i - 1]]
    assert seen == [0, 2, 3], stamps[0]
    assert stamps[0].index(2) <= 5 and stamps[0].index(3) <= 11, stamps[0]
    for i in range(16):
        assert len({r["results"][i].tobytes() for r in results}) == 1, f"call {i}"
    for r in results:
        assert set(r["engines"]) == {"ina"}, r["engines"]
        report = r["stats"]["switch"]["quorum"]
        assert report["mode_changes"] == 2 and report["mode"] == "quorum 3", report


def test_an_unconfigured_sender_is_dropped_and_counted(fabric, aggregator, new_job):
    """A data packet from a port no job installed, and one from an installed worker's
    namespace posing as another worker: dropped, counted as unknown workers; the job then
    runs as before."""
    from tests.control.test_controller import ina_packet
    job = new_job(fabric, [0, 1])
    k, _, block, bits = BUILD32
    packet = ina_packet(job.job_id, 0, 0, range(k), block=block, bits=bits)
    posing = ina_packet(job.job_id, 1, 0, range(k), block=block, bits=bits)
    with fabric.controller() as c:
        before = c.read_drops()
        stranger = fabric.udp_socket(0, 45000)
        try:
            stranger.sendto(packet, (fabric.switch_address.split(":")[0], P.UDP_PORT))
            stranger.sendto(posing, (fabric.switch_address.split(":")[0], P.UDP_PORT))
            deadline = time.monotonic() + 10
            while True:
                after = c.read_drops()
                if after["unknown worker"] - before["unknown worker"] >= 2:
                    break
                assert time.monotonic() < deadline, (before, after)
                time.sleep(0.05)
            stranger.settimeout(0.3)
            with pytest.raises(OSError):  # no answer of any kind
                stranger.recv(65536)
        finally:
            stranger.close()
        assert after["unknown worker"] - before["unknown worker"] == 2
    case = ("float32", "sum", 300, 5)
    results = fabric.run(job, rank_cases.ina_cases, {"cases": [case], "settings": NO_THRESHOLDS})
    assert_served_and_within_bound(results, [case], 2, BUILD32)


def test_a_served_call_opens_through_the_switch_and_makes_no_mpi_call(fabric, aggregator,
                                                                     new_job):
    """The switch states that it takes openings and predicted first windows (its probe
    answer): the first sync call the switch serves is agreed on by its opening, the
    calls that repeat it go predicted (one round trip, no opening), and none makes an
    MPI call. With the MPI gate (INA_INTERNAL_SWITCH_OPENING=0) the same calls make one each, at
    least."""
    job = new_job(fabric, [0, 1, 2])
    params = {"calls": 5, "count": 500, "settings": {**NO_THRESHOLDS, "switch_predict": True}}
    opened = fabric.run(job, rank_cases.mpi_calls_per_call, params)
    gated = fabric.run(job, rank_cases.mpi_calls_per_call, params,
                       env={"INA_INTERNAL_SWITCH_OPENING": "0"})
    for r in opened:
        assert "engines" in r, r.get("traceback", r)
        assert r["engines"] == ["ina"] * 5, r["engines"]
        assert r["mpi"] == [{}] * 5, r["mpi"]
        switch = r["stats"]["switch"]
        assert switch["predicted_calls"] == 5, switch
        assert switch["opened_calls"] + switch["predicted_calls"] == 6, switch
    for r in gated:
        assert r["engines"] == ["ina"] * 5 and all(r["mpi"]), r["mpi"]
    for a, b in zip(opened, gated):
        # The predicted calls' first windows are summed with exponents learned from the
        # call before (docs/quantization.md): a few quanta from the gated calls' sums.
        for x, y in zip(a["results"], b["results"]):
            np.testing.assert_allclose(x, y, rtol=0, atol=np.abs(y).max() * 2**-16)


# -- what the switch does not take ---------------------------------------------------------

def test_nan_and_inf_take_the_exact_path(fabric, aggregator, new_job):
    job = new_job(fabric, [0, 1])
    results = fabric.run(job, rank_cases.ina_nan, {"size": 3000, "at": 7, "dtype": "float32"})
    for r in results:
        assert np.isnan(r["result"][7]) and np.isinf(r["result"][9])
        np.testing.assert_array_equal(np.delete(r["result"], [7, 9]), 2.0)
        assert r["stats"]["last_call"]["engine"] == "ring"
        assert "NaN or Inf" in " ".join(r["stats"]["last_call"]["passed_over"])
        np.testing.assert_array_equal(r["after"], 2.0)
        assert r["after_engine"] == "ina"


@pytest.mark.parametrize("known", [[], [100], [100, 101]],
                         ids=["opening", "predicted-meets-opening", "predicted-both"])
def test_ranks_that_disagree_get_an_agreement_error_and_go_on(fabric, aggregator, new_job,
                                                              known):
    """The last rank's call is one element longer: every rank gets AgreementError naming
    the lengths, at once (not by the silence bound), and the next call goes through the
    switch. The calls' openings meet (none known), or the others' predicted packets meet
    its opening (100 known), or predicted packets of two identities meet (both known)."""
    job = new_job(fabric, [0, 1, 2])
    results = fabric.run(job, rank_cases.disagree, {"what": "length", "known": known, "settings": {
        "switch_min_bytes": 0, "switch_silence": 20.0}})
    for r in results:
        first = r["first"]
        assert isinstance(first, dict) and first["error"] == "AgreementError", first
        assert "length" in first["message"] and "rank 2:" in first["message"], first
        np.testing.assert_array_equal(r["second"], np.full(10, 3, np.float32))
        assert r["second_engine"] == "ina", r
        assert r["switch"]["outages"] == 0, r["switch"]  # (no wait for the silence bound)
    # The ranks whose call was known went predicted, and the switch told them MISMATCH.
    predicted = [r["switch"]["mismatched_predictions"] for r in results]
    assert predicted == {0: [0, 0, 0], 1: [1, 1, 0], 2: [1, 1, 1]}[len(known)], predicted


# -- failures ------------------------------------------------------------------------------

def test_a_rank_killed_mid_call_fails_every_other_rank_within_the_bound(fabric, aggregator,
                                                                        new_job):
    job = new_job(fabric, [0, 1, 2])
    results = fabric.run(job, rank_cases.ina_worker_dies, {
        "count": 50_000, "stop_after": 0.3,
        "settings": {"switch_min_bytes": 0, "switch_silence": 1.0, "timeout": 4}},
        survive_dead_ranks=True, timeout=120)
    for r in results[:2]:
        err = r["error"]
        assert err["error"] == "CollectiveTimeout", err
        assert err["message"].startswith("waited 4 s for all "), err
        assert r["seconds"] < 30


def _paced(fabric, job, tmp_path, calls, pauses, settings=None, env=None, pause=0.0):
    """paced_calls on the job's ranks, in a thread: (future, wait(name), go(name))."""
    pool = ThreadPoolExecutor(1)
    running = pool.submit(fabric.run, job, rank_cases.paced_calls, {
        "case": ("float32", "sum", 400), "calls": calls, "pauses": pauses, "pause": pause,
        "dir": str(tmp_path), "settings": {**NO_THRESHOLDS, **(settings or {})}}, env=env)
    pool.shutdown(wait=False)

    def wait(name):
        deadline = time.monotonic() + 90
        while not (tmp_path / name).exists():
            if running.done():
                running.result()  # raises the job's failure
                raise AssertionError(f"the job ended before {name}")
            assert time.monotonic() < deadline, f"no {name}"
            time.sleep(0.02)

    def go(name):
        (tmp_path / f"{name}.go").touch()

    return running, wait, go


@pytest.mark.parametrize("how", ["restart", "reinstall"])
def test_a_killed_switch_means_the_ring_and_its_return_the_switch(fabric, aggregator, how,
                                                                    tmp_path, new_job):
    """The switch is killed (or the job torn down) after call 2: the next call finishes
    on the ring, and once the switch is started and configured again (or the job installed
    again) the ranks return to it: one outage, one return, every result identical."""
    job = new_job(fabric, [0, 1])
    running, wait, go = _paced(fabric, job, tmp_path, 16, {"2": "down", "4": "up"},
                               {"switch_silence": 1.0, "log_level": "INFO"}, pause=0.02)
    wait("down")
    if how == "restart":
        fabric.kill_switch()
    else:
        with fabric.controller() as c:
            c.teardown(job)
    go("down")
    wait("up")
    if how == "restart":
        fabric.start_switch()
        fabric.configure(job, push="always")
    else:
        fabric.configure(job)
    go("up")
    results = running.result(timeout=180)
    for r in results:
        engines = r["engines"]
        assert engines[:2] == ["ina", "ina"] and engines[2] != "ina", engines
        # Back once the switch answers rank 0's probes (by its clock, at most every
        # 50 ms: docs/reliability.md, The return). The calls are 20 ms apart, as
        # training steps are.
        assert "ina" in engines[4:], "\n".join(map(str, (
            how, engines, r["stats"]["switch"], r["stats"]["fallback_reasons"], *r["log"])))
        back = engines.index("ina", 4)
        assert set(engines[back:]) == {"ina"}, (how, engines)
        state = r["stats"]["switch"]
        assert (state["outages"], state["returns"]) == (1, 1), state
    for i in range(16):
        assert len({r["results"][i].tobytes() for r in results}) == 1, f"call {i}"


def test_a_switch_killed_mid_call_and_configured_again_ends_every_call_within_its_bound(
        fabric, aggregator, tmp_path, new_job):
    """The restart issue's P4 scenario: the ranks loop over MPI's own Allreduce, a 4 KiB
    library call and an allreduce of a flag, 0.2 s apart; the switch is SIGKILLed at a
    moment of its own (mid-call, not at a call boundary), then started and configured
    again (pipeline pushed, job installed) 2 s later. A restarted P4 switch has empty
    registers while the workers are mid-call. Every call ends within its bound (the
    silence bound, the rescue on the ring, the rejoin: a few seconds, never the 300 s
    of a stuck rank), every result is right and the same on both ranks, and the job is
    back on the switch within the return's bound once it is configured again."""
    job = new_job(fabric, list(range(N)))
    params = {"case": ("float32", "sum", 1024), "pause": 0.2, "dir": str(tmp_path),
              "settings": {**NO_THRESHOLDS, "switch_silence": 1.0, "timeout": 30}}
    pool = ThreadPoolExecutor(1)
    running = pool.submit(fabric.run, job, rank_cases.restarts_among_mpi_calls, params,
                          timeout=240)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 90
    while not (tmp_path / "served").exists():
        assert not running.done() and time.monotonic() < deadline, "never served"
        time.sleep(0.05)
    time.sleep(1.3)  # (mid-call or between: the kill's moment is not a call's boundary)
    killed = time.monotonic()
    fabric.kill_switch()
    time.sleep(2.0)
    fabric.start_switch()
    fabric.configure(job, push="always")
    configured = time.monotonic()
    time.sleep(6.0)
    (tmp_path / "stop").touch()
    results = running.result(timeout=180)
    bound = 1.0 + 1.0 + 3.0 + 0.2  # silence, join and slack, the pause between calls
    for r in results:
        assert r["wrong"] == [], r["wrong"][:3]
        starts, engines = r["starts"], r["engines"]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert max(gaps) < bound, (max(gaps), list(zip(starts, engines)))
        assert any(e != "ina" for s, e in zip(starts, engines) if killed < s < configured), (
            "no call fell back while the switch was down")
        late = [e for s, e in zip(starts, engines) if s > configured + 2.5]
        assert late and set(late) == {"ina"}, list(zip(starts, engines))
        state = r["stats"]["switch"]
        assert state["outages"] == state["returns"] >= 1, state
    assert all(r["digest"] == results[0]["digest"] for r in results)


# -- stale packets -------------------------------------------------------------------------

def _data_frames(sock, job_id, limit=4):
    """Worker data packets (not retransmissions) of the job among the captured frames."""
    frames = []
    while True:
        try:
            frame = sock.recv(65536)
        except BlockingIOError:
            return frames
        if len(frame) < 14 + 20 + 8 + P.HEADER_BYTES or frame[23] != 17:
            continue
        udp = frame[34:]
        if (int.from_bytes(udp[2:4], "big") != P.UDP_PORT
                or int.from_bytes(udp[4:6], "big") != len(udp)):  # not a segmented batch
            continue
        head = P.unpack_header(udp[8:])
        if (head["job"] == job_id and head["count"] > 0 and not head["flags"]
                and len(frames) < limit):
            frames.append(frame[:40] + b"\0\0" + frame[42:])  # no UDP checksum


def test_replayed_copies_of_earlier_packets_are_dropped_as_stale(fabric, aggregator, tmp_path,
                                                                  new_job):
    """Two copies of worker 0's first data packets, replayed between later sync calls of
    the same run (a delayed duplicate): dropped and counted as stale; no call stalls, and
    every result is the one a run without them gives."""
    job = new_job(fabric, [0, 1], slots=4)
    one_datagram_each = {"INA_INTERNAL_SWITCH_GSO": "0"}  # frames to replay, not segmented batches
    clean = fabric.run(job, rank_cases.paced_calls, {"case": ("float32", "sum", 400), "calls": 8,
                                            "settings": NO_THRESHOLDS}, env=one_datagram_each)
    capture = fabric.capture(0)
    try:
        running, wait, go = _paced(fabric, job, tmp_path, 8, {"2": "first", "5": "second"},
                                   {"switch_silence": 10.0}, env=one_datagram_each)
        wait("first")
        frames = _data_frames(capture, job.job_id)
        go("first")
        assert len(frames) == 4, len(frames)
        with fabric.controller() as c:
            before = c.read_drops()
            wait("second")
            fabric.inject(0, frames * 2)
            deadline = time.monotonic() + 10
            while c.read_drops()["stale"] - before["stale"] < 8:
                assert time.monotonic() < deadline, (
                    {k: v for k, v in c.read_drops().items() if v != before[k]}, frames[0].hex())
                time.sleep(0.05)
            go("second")
            start = time.monotonic()
            results = running.result(timeout=180)
            seconds = time.monotonic() - start
            after = c.read_drops()
    finally:
        capture.close()
    assert after["stale"] - before["stale"] == 8, (before, after)
    assert after["mismatched chunk"] == before["mismatched chunk"], (before, after)
    assert seconds < 10, f"the calls after the replay took {seconds:.1f} s: a stall"
    for r, c in zip(results, clean):
        assert r["engines"] == ["ina"] * 8, r["engines"]
        assert [x.tobytes() for x in r["results"]] == [x.tobytes() for x in c["results"]]


# -- the emulated-network benchmark on BMv2 ------------------------------------------------

@pytest.mark.bmv2
@needs_bmv2
def test_netsim_runs_ina_through_bmv2_beside_the_ring(tmp_path):
    """bench.cluster.netsim --aggregator bmv2: BMv2 on the emulated cluster's bridge in
    place of the software switch; INA's calls are all served by it, checked correct on every rank
    (netsim_ranks writes a record only then), and its counters are printed."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cluster.netsim", "--aggregator", "bmv2", "--n", "2",
         "--rates", "200", "--sizes", "64K", "--reps", "2", "--loss", "0", "--systems",
         "ina", "ring", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert sorted(r["system"] for r in records) == ["ina", "ring"], records
    ina = next(r for r in records if r["system"] == "ina")
    assert ina["aggregator"] == "bmv2" and ina["engines"] == {"ina": 3}, ina
    assert "BMv2 after ina n=2" in proc.stderr and "drops:" in proc.stderr, proc.stderr[-2000:]
