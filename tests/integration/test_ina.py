"""Allreduce through a real ina-switch process and 2-4 mpiexec ranks on loopback: results
within the documented bound, identical on every rank; injected loss, duplication and
reordering; the switch or a worker dying; fallback to the ring with the reason."""
from __future__ import annotations

import contextlib
import socket
import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.switch import parse_status, send_faults
from ina_collectives.switch.embedded import embedded_switch
from tests.inputs import check_result, check_within_bound
from tests.integration import mpirun, rank_cases

K = P.MAX_ELEMENTS


def run_ina(sw, n, cases, rounds=1, settings=None, timeout=240.0):
    params = {"cases": cases, "rounds": rounds,
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0, **(settings or {})}}
    return mpirun.run(n, rank_cases.ina_cases, params, env={"INA_SWITCH": sw.address_text},
                      timeout=timeout)


def check_job(results, cases, n, rounds=1, engine="ina", **build):
    """Every case alike on every rank, within the bound (``build``: the switch's k, block
    and bits where not the software switch's defaults), all on ``engine``."""
    for i, case in enumerate(cases * rounds):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        if engine == "ina":
            check_within_bound(per_rank[0], *case, n, **build)
        else:
            check_result(per_rank[0], *case, n)
    for r in results:
        assert r["stats"]["engines"] == {engine: len(cases) * rounds}, r["stats"]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_results_within_bound_and_identical(switch, n):
    cases = [("float32", "sum", 0, 0), ("float32", "sum", 1, 1), ("float32", "sum", K - 1, 2),
             ("float32", "sum", K + 1, 3), ("float32", "average", 9 * K + 5, 4),
             ("float64", "sum", 3 * K + 7, 5), ("float16", "average", 2 * K + 1, 6),
             ("float32", "sum", 1_000_003, 7)]
    # Two rounds: the slot versions carry over from one call to the next.
    results = run_ina(switch, n, cases, rounds=2)
    check_job(results, cases, n, rounds=2)


@pytest.mark.mpi
@pytest.mark.parametrize("bits, block", [(16, 32), (16, 8), (32, 1)])
def test_value_widths_and_sub_blocks_within_bound(switch, bits, block):
    """16-bit values and sub-block sizes as a job's settings: every result within the
    bound of its width and B, identical on every rank; int32 takes the ring (exact)."""
    n, k = 3, P.max_elements(P.MAX_DATAGRAM, block, bits)
    cases = [("float32", "sum", 2 * k + 3, 1), ("float32", "average", 300_001, 2),
             ("float64", "sum", k + 1, 3), ("float16", "average", 50_000, 4)]
    results = run_ina(switch, n, cases + [("int32", "sum", 1000, 5)],
                      settings={"switch_value_bits": bits, "switch_block": block})
    for i, case in enumerate(cases):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, n, k=k, block=block, bits=bits)
    check_result(results[0]["results"][-1], "int32", "sum", 1000, 5, n)
    stats = results[0]["stats"]
    assert stats["engines"] == {"ina": 4, "ring": 1}, stats
    assert stats["switch"]["value_bits"] == bits and stats["switch"]["block"] == block


def test_a_join_of_another_protocol_version_is_refused_naming_both(switch):
    """The version byte leads every header: a worker of version 2 gets this switch's
    refusal (status 'another protocol version') in a reply of its own version, and a
    worker that reads a reply of another version refuses it, naming both versions."""
    old = P.control_packet(4321, 0, [P.CTRL_JOIN, 2, 64, 8])
    old = bytes([2]) + old[1:]  # a version-2 worker's join
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(old, (switch.host, switch.port))
        head, reply = P.read_control(s.recv(65536))
    assert head["version"] == P.PROTOCOL_VERSION
    assert reply[:2].tolist() == [P.CTRL_JOIN, P.JOIN_VERSION]
    assert P.JOIN_STATUS[P.JOIN_VERSION] == "another protocol version"
    # An aggregator of the next version answering this worker: refused, both named.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as fake, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as worker:
        fake.bind(("127.0.0.1", 0))
        fake.settimeout(5)
        worker.sendto(b"", fake.getsockname())  # (bind the worker's port)
        fake.recvfrom(16)

        def answer() -> None:
            request, addr = fake.recvfrom(65536)
            head, body = P.read_control(request)
            reply = P.control_packet(head["job"], 0, [int(body[0]), 0], reply=True)
            fake.sendto(bytes([P.PROTOCOL_VERSION + 1]) + reply[1:], addr)

        import threading
        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(ValueError, match=f"speaks protocol version "
                                             f"{P.PROTOCOL_VERSION + 1}, this worker version "
                                             f"{P.PROTOCOL_VERSION}: join refused"):
            P.control_request(worker, fake.getsockname(), 7, 0, [P.CTRL_JOIN, 1, 8, 1, 32, 32],
                              5.0, "join")
        t.join(5)


@pytest.mark.mpi
def test_64_mib_on_four_ranks(switch):
    cases = [("float32", "sum", 16 << 20, 11)]
    check_job(run_ina(switch, 4, cases), cases, 4)


@pytest.mark.mpi
@pytest.mark.parametrize("injected", [
    {"drop_in": 0.005, "drop_out": 0.005},
    {"drop_in": 0.025, "drop_out": 0.025},
    {"drop_in": 0.1, "drop_out": 0.1},
    {"duplicate_in": 0.1, "duplicate_out": 0.1},
    {"reorder_in": 0.2, "reorder_out": 0.2},
    {"delay_ms_in": 3, "delay_ms_out": 4},
    {"drop_in": 0.02, "duplicate_out": 0.05, "reorder_in": 0.1, "delay_ms_out": 1},
], ids=["loss-1%", "loss-5%", "loss-20%", "duplicate", "reorder", "delay", "mixed"])
@pytest.mark.parametrize("path", ["UDP_SEGMENT", "sendmmsg"])
def test_faults_give_the_same_results(switch, faults, injected, path):
    """On both send paths: segmentation offload with MTU-sized packets (K of a 9000-byte
    MTU, several datagrams per send), and sendmmsg (the fallback) with 64 KiB ones."""
    faults(**injected)
    gso = path == "UDP_SEGMENT"
    k = P.elements_for_mtu(9000) if gso else K
    cases = [("float32", "sum", 2 * k * 8 + 3, 21), ("float64", "average", 40_000, 22)]
    results = run_ina(switch, 3, cases, rounds=3, settings={
        "retransmit_timeout": 0.01, "switch_gso": gso, "switch_elements": k})
    for i, case in enumerate(cases * 3):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, 3, k=k)
    for r in results:
        assert r["stats"]["engines"] == {"ina": 6}, r["stats"]
        assert r["stats"]["switch"]["send_path"] == path, r["stats"]["switch"]
        if gso:  # several new packets per system call
            transport = r["stats"]["transport"]
            assert transport["send_calls"] < transport["sent"], transport


@pytest.mark.mpi
def test_faults_give_the_same_results_with_the_switchs_sendmmsg_path():
    """The switch's own fallback (results by sendmmsg, forced with --send-path), with
    loss, duplication, reordering and delay at once, workers on UDP_SEGMENT."""
    k = P.elements_for_mtu(9000)
    cases = [("float32", "sum", 2 * k * 8 + 3, 23), ("float64", "average", 40_000, 24)]
    with embedded_switch("--send-path", "sendmmsg") as sw:
        send_faults((sw.host, sw.port), drop_in=0.02, drop_out=0.02, duplicate_out=0.05,
                    reorder_in=0.1, delay_ms_out=1)
        results = run_ina(sw, 3, cases, rounds=2, settings={
            "retransmit_timeout": 0.01, "switch_elements": k})
        sw.stop()
    for i, case in enumerate(cases * 2):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, 3, k=k)
    status = parse_status(sw.final_status)
    assert status["send_path"] == "sendmmsg" and (
        status["drops"].get("injected_loss_in") or status["drops"].get("injected_loss_out")), \
        sw.final_status


def test_rtt_estimator_follows_rfc6298():
    from ina_collectives._fast import transport

    state = np.zeros(3)  # SRTT, RTTVAR, RTO
    assert transport.rtt_update(state, 0.010, 0.001, 0.5) == pytest.approx(0.030)
    assert state[:2] == pytest.approx([0.010, 0.005])
    # SRTT 7/8 old + 1/8 sample; RTTVAR 3/4 old + 1/4 |SRTT - sample|.
    assert transport.rtt_update(state, 0.018, 0.001, 0.5) == pytest.approx(0.011 + 4 * 0.00575)
    assert state[:2] == pytest.approx([0.011, 0.00575])
    for _ in range(200):  # steady round trips: RTTVAR decays, the floor holds
        rto = transport.rtt_update(state, 0.001, 0.005, 0.5)
    assert rto == 0.005 and state[0] == pytest.approx(0.001)
    assert transport.rtt_update(state, 10.0, 0.005, 0.5) == 0.5
    # Steady round trips of 8 ms (a slow target's queue): RTTVAR decays to nothing, and
    # the RTO stays at 3/2 SRTT, not SRTT + 1 ms.
    state[:] = 0
    for _ in range(200):
        rto = transport.rtt_update(state, 0.008, 0.001, 0.5)
    assert state[0] == pytest.approx(0.008) and rto == pytest.approx(0.012)


@pytest.mark.mpi
def test_timeout_adapts_to_a_slow_aggregator(switch, faults):
    """Results 30 ms late (above the initial 20 ms timeout): after the first window's
    resends the measured round trip raises the timeout, instead of resending every chunk
    (as a fixed 20 ms timeout does)."""
    chunks = 96
    faults(delay_ms_out=30)
    cases = [("float32", "sum", chunks * K, 23)]
    results = run_ina(switch, 2, cases, settings={"retransmit_timeout": 0.02})
    check_job(results, cases, 2)
    for r in results:
        t = r["stats"]["transport"]
        assert t["srtt"] >= 0.03 and t["rto"] > t["srtt"], t
        # A fixed 20 ms timeout resends every chunk at least once.
        assert t["rtt_samples"] > chunks / 2 and t["retransmitted"] < chunks / 2, t


@pytest.mark.mpi
def test_switch_killed_mid_operation_falls_back_to_the_ring():
    with embedded_switch() as sw:
        cases = [("float32", "sum", 1 << 20, 31), ("float32", "sum", 8 << 20, 32),
                 ("float32", "average", 1 << 20, 33)]
        params = {"cases": cases, "switch_pid": sw.pid, "kill_after": 0.02,
                  "settings": {"switch_min_bytes": 0, "switch_silence": 1.0}}
        results = mpirun.run(3, rank_cases.ina_switch_dies, params,
                             env={"INA_SWITCH": sw.address_text}, timeout=120)
        assert sw.process.wait(5) == -9
    for i, case in enumerate(cases):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1
        if i == 0:
            check_within_bound(per_rank[0], *case, 3)
        else:  # the ring's float32 sums, with the ring's own bound
            check_result(per_rank[0], *case, 3)
    for r in results:
        assert [e["engine"] for e in r["engines"]] == ["ina", "ring", "ring"]
        # (in its stream, or at its opening when the kill came that early)
        reason = r["engines"][1]["passed_over"][-1]
        assert ("aggregator failed mid-operation" in reason
                or "aggregator failed at the opening" in reason), reason
        assert r["seconds"][1] < 30
        assert any("aggregator failed" in k for k in r["stats"]["fallback_reasons"])


@pytest.mark.mpi
def test_after_a_switch_restart_the_ranks_return_to_it(tmp_path):
    """The switch dies: that call finishes on the ring, and 30 more calls take the ring
    while it is down. A switch starts again at the same address: with 20 ms between calls
    (a training step), the second call after the restart goes through it (rank 0 probes
    at each call without waiting, and its news rides on the next call's agreement), and
    every call after it, exact within the bound, every rank alike."""
    import threading

    from ina_collectives.launch.cli import free_udp_ports

    port = free_udp_ports(1)[0]
    case = ("float32", "sum", 100_000)
    outage = 30
    params = {"case": case, "after": 6, "outage": outage, "pause": 0.02, "dir": str(tmp_path),
              # (every call opened: the bound of exact exponents holds for each of these
              # calls, whose inputs differ; a predicted one's is test_predicted's)
              "settings": {"switch_min_bytes": 0, "switch_silence": 0.5,
                           "switch_predict": False}}
    env = {"INA_SWITCH": f"127.0.0.1:{port}"}
    outcome: dict = {}

    def run_job() -> None:
        try:
            outcome["results"] = mpirun.run(2, rank_cases.ina_switch_restarts, params, env=env,
                                            timeout=120)
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    job = threading.Thread(target=run_job)

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / name).exists():
            assert job.is_alive() and time.monotonic() < deadline, f"no {name}: {outcome}"
            time.sleep(0.05)

    with embedded_switch("--port", str(port)) as first:
        job.start()
        wait_for("served")
        first.process.kill()
        first.process.wait(5)
    (tmp_path / "killed").touch()
    wait_for("failed")
    with embedded_switch("--port", str(port)) as second:
        (tmp_path / "restarted").touch()
        job.join(120)
        assert not job.is_alive()
        assert second.process.poll() is None
    assert "error" not in outcome, outcome["error"]
    results = outcome["results"]
    for r in results:
        engines = r["engines"]
        restart = 2 + outage  # the first call after the restart
        # The call after the kill finds the switch gone: at its opening (then, nothing
        # of it being lost, it takes the engine its size takes without the switch: MPI,
        # below ring_min_bytes), or in its stream (then the ring finishes it). While the
        # switch is down, calls of this size take MPI.
        assert engines[0] == "ina" and engines[1] in ("ring", "mpi"), engines
        assert "ina" not in engines[2:restart], engines
        back = engines.index("ina", 2)
        assert back <= restart + 1 and set(engines[back:]) == {"ina"}, engines
        state = r["stats"]["switch"]
        assert (state["serving"], state["outages"], state["returns"]) == (True, 1, 1), state
    for i in range(len(results[0]["results"])):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1
        if results[0]["engines"][i] == "ina":
            check_within_bound(per_rank[0], *case, 100 + i, 2)
        else:
            check_result(per_rank[0], *case, 100 + i, 2)


@pytest.mark.mpi
def test_restarts_between_the_ranks_own_mpi_calls_return_within_the_time_bound(tmp_path):
    """The restart issue's scenario, three times in one job: 2 ranks loop over MPI's own
    Allreduce, a library call of 256 KiB and an allreduce of a flag, with 10 ms of compute
    between calls; the switch is SIGKILLed, and restarted at the same port 0.8 s later,
    then serves 3 s.
    After each restart the job is back on the switch by rank 0's clock, not a count of
    calls: every call that starts more than switch_retry_seconds (1 s) after the switch
    listens again is served by it (the test allows 1 s more, for a loaded machine). Every
    result is right (exact on the ring, within the bound through the switch) and the
    same bits on both ranks, and the stats count 3 outages and 3 returns."""
    import threading

    from ina_collectives.launch.cli import free_udp_ports

    port = free_udp_ports(1)[0]
    params = {"case": ("float32", "sum", 65_536), "pause": 0.01, "dir": str(tmp_path),
              "settings": {"switch_min_bytes": 0, "switch_silence": 0.5,
                           "switch_predict": False}}
    outcome: dict = {}

    def run_job() -> None:
        try:
            outcome["results"] = mpirun.run(2, rank_cases.restarts_among_mpi_calls, params,
                                            env={"INA_SWITCH": f"127.0.0.1:{port}"},
                                            timeout=180)
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    job = threading.Thread(target=run_job)
    back_at: list[float] = []  # when the switch listened again
    until: list[float] = []  # when it was killed again, or the job told to stop
    with contextlib.ExitStack() as stack:
        sw = stack.enter_context(embedded_switch("--port", str(port)))
        job.start()
        deadline = time.monotonic() + 60
        while not (tmp_path / "served").exists():
            assert job.is_alive() and time.monotonic() < deadline, f"never served: {outcome}"
            time.sleep(0.05)
        for _ in range(3):
            time.sleep(1.0)  # on the switch
            until.append(time.monotonic())
            sw.process.kill()
            sw.process.wait(5)
            stack.close()
            time.sleep(0.8)  # on the ring
            sw = stack.enter_context(embedded_switch("--port", str(port)))
            back_at.append(time.monotonic())
            time.sleep(2.0)  # the return, then the switch again
        time.sleep(1.0)
        until.append(time.monotonic())
        (tmp_path / "stop").touch()
        job.join(120)
        assert not job.is_alive()
    assert "error" not in outcome, outcome["error"]
    results = outcome["results"]
    bound = 1.0 + 1.0
    for r in results:
        assert r["wrong"] == [], r["wrong"][:3]
        starts, engines = r["starts"], r["engines"]
        for t, end in zip(back_at, until[1:]):
            # (a call that starts in the last moments before the next kill may still be
            # in flight when it comes, and rightly end on the ring)
            late = [e for s, e in zip(starts, engines) if t + bound < s < end - 0.25]
            timeline = " ".join(f"{s - t:.2f}:{e}" for s, e in zip(starts, engines)
                                if t - 2 < s < t + 4)
            assert late and set(late) == {"ina"}, (t, timeline)
        # (the measured returns, for -s: seconds from listening to the first served call)
        print("returned after", [round(next(s for s, e in zip(starts, engines)
                                            if s > t and e == "ina") - t, 3) for t in back_at])
        state = r["stats"]["switch"]
        assert (state["serving"], state["outages"], state["returns"]) == (True, 3, 3), state
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["engines"] == results[1]["engines"]


@pytest.mark.mpi
def test_ctrl_c_ends_a_blocked_call_at_once_and_the_others_learn_it(switch, faults):
    """The stream runs without the GIL; it takes it every 20 ms to see signals. With the
    switch holding every result back 500 ms, a call of 8 MiB takes seconds: SIGINT on
    rank 0 ends it with KeyboardInterrupt (well within a second; the bound of the issue,
    100 ms, is what the 20 ms check gives on an idle machine), and rank 1 gets
    CollectiveTimeout naming what it waited for."""
    faults(delay_ms_out=500)
    params = {"count": 2 << 20, "interrupt_after": 0.3,
              "settings": {"switch_min_bytes": 0, "switch_silence": 1.5, "timeout": 3}}
    results = mpirun.run(2, rank_cases.ina_interrupted, params,
                         env={"INA_SWITCH": switch.address_text}, timeout=120)
    interrupted, other = results
    assert interrupted["error"]["error"] == "KeyboardInterrupt", interrupted
    assert interrupted["after_signal"] < 1.0, interrupted
    assert other["error"]["error"] == "CollectiveTimeout", other
    assert "to take up the error path" in other["error"]["message"], other


@pytest.mark.mpi
@pytest.mark.parametrize("quorum", [0, 2])
def test_a_worker_that_stops_gives_a_clear_error_and_the_switch_frees_the_job(quorum):
    """One of three ranks freezes mid-call: the others fail within their bound, naming
    what they waited for (in quorum 2 their chunks complete without it, and the wait
    that gives up is a collective's), and the switch frees the job."""
    with embedded_switch("--idle", "1") as sw:
        params = {"count": 1 << 20, "stop_after": 0.2,
                  "settings": {"switch_min_bytes": 0, "switch_silence": 1.0, "timeout": 4,
                               "quorum": quorum}}
        results = mpirun.run(3, rank_cases.ina_worker_dies, params,
                             env={"INA_SWITCH": sw.address_text}, timeout=120,
                             survive_dead_ranks=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("freed" in line for line in sw.lines):
            time.sleep(0.1)
        lines = list(sw.lines)
    for r in results[:2]:
        err = r["error"]
        assert err["error"] == "CollectiveTimeout", err
        # Where the peer froze decides which wait gives up first (entering the call,
        # agreeing on exponents, reporting the stream's outcome or, a sync call's, taking
        # up its error path); each names its wait.
        assert err["message"].startswith("waited 4 s for all "), err
        assert any(w in err["message"] for w in ("to enter allreduce", "to agree on the exponents",
                                                  "to report the outcome",
                                                  "to take up the error path")), err
        assert r["seconds"] < 20
    assert any("sent nothing for 1 s: freed" in line for line in lines), lines


@pytest.mark.mpi
def test_no_switch_listening_means_the_ring_with_the_reason(closed_udp_port):
    port = closed_udp_port
    cases = [("float32", "sum", 300_000, 41)]
    results = mpirun.run(2, rank_cases.ina_cases, {"cases": cases, "settings": {
        "switch_min_bytes": 0, "ring_min_bytes": 0, "switch_join_timeout": 1.0}},
        env={"INA_SWITCH": f"127.0.0.1:{port}"})
    check_job(results, cases, 2, engine="ring")
    (reason,) = results[0]["stats"]["fallback_reasons"]
    assert reason.startswith("ina: aggregator unavailable") and str(port) in reason, reason


@pytest.mark.mpi
def test_a_refused_job_means_the_ring_with_the_reason():
    """Another job holds the whole pool: no slot is free, the job is refused."""
    from ina_collectives.ina.link import WorkerLink

    with embedded_switch("--pool-slots", "4") as sw:
        holder = WorkerLink((sw.host, sw.port), P.JobFormat(77, 1, 1024), 0, 4)
        holder.join(5.0)
        cases = [("float32", "sum", 300_000, 42)]
        results = run_ina(sw, 2, cases, settings={"switch_retry_seconds": 0})
        holder.leave()
        holder.close()
    check_job(results, cases, 2, engine="ring")
    (reason,) = results[0]["stats"]["fallback_reasons"]
    assert "refused job" in reason and "no room for the job" in reason, reason


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("where", ["first window", "last chunk"])
def test_nan_and_inf_take_the_exact_path(switch, dtype, where):
    # A bad value in the first window is seen before the stream; one past it only by the
    # stream, which computes those chunks' exponents as it goes: the result is the
    # exact path's all the same, and the next call is the switch's again.
    size = 2_000_000
    at = 7 if where == "first window" else size - 5
    nan = mpirun.run(2, rank_cases.ina_nan, {"size": size, "at": at, "dtype": dtype},
                     env={"INA_SWITCH": switch.address_text})
    for r in nan:
        assert np.isnan(r["result"][at]) and np.isinf(r["result"][at + 2])
        np.testing.assert_array_equal(np.delete(r["result"], [at, at + 2]), 2.0)
        assert r["stats"]["last_call"]["engine"] == "ring"
        assert "ina: NaN or Inf in the input (exact path)" in r["stats"]["last_call"]["passed_over"]
        np.testing.assert_array_equal(r["after"], 2.0)
        assert r["after_engine"] == "ina"


@pytest.mark.mpi
@pytest.mark.parametrize("predicted", [False, True], ids=["opened", "predicted"])
def test_a_switch_that_dies_after_one_rank_returned_leaves_every_rank_the_same_bits(
        predicted):
    """All or nothing without a vote (docs/protocol-recovery.md): rank 0 holds every result of a
    sync call, returns and kills the switch; rank 1 lost those results, and completes
    the call from rank 0's kept window: both return the same bits, the exact sum.
    Opened: at its silence bound rank 1 asks rank 0 for the window directly
    (ina/windows.py) while rank 0 waits in finalize. Predicted (docs/protocol.md, One
    round trip): rank 1's call went without an opening and it heard nothing of it; it
    reaches its error path by the silence bound, rank 0 at its next gate (here
    finalize), where rank 1's role PREDICTED is read as FAILED since rank 0 finished that
    call. The next call's agreement as that gate runs in one process:
    tests/ina/test_engine_faults.py."""
    count = 3 * K + 100  # 4 chunks: with S 8, all of them are the last window
    with embedded_switch() as sw:
        results = mpirun.run(2, rank_cases.ina_switch_dies_after_the_last_result,
                             {"count": count, "then": "finalize", "switch_pid": sw.process.pid,
                              "predicted": predicted},
                             env={"INA_SWITCH": sw.address_text}, timeout=120)
    expected = np.arange(count, dtype=np.float32) * 3
    for r in results:
        assert r["served_first"] == "ina" and r["second_engine"] == "ina", r
        np.testing.assert_array_equal(r["second"], expected)
    assert results[0]["second"].tobytes() == results[1]["second"].tobytes()
    assert results[0]["switch"]["rescued_calls"] == 0
    assert results[1]["switch"]["rescued_calls"] == int(predicted)
    assert results[1]["switch"]["peer_completed_calls"] == int(not predicted)
    assert results[0]["switch"]["vote_free_calls"] == 2
    assert results[1]["switch"]["vote_free_calls"] == 1 + (not predicted)
    assert results[1]["seconds"] >= 1.5   # it waited for its silence bound
    # Finalize makes a gate again after the rescue, and both ranks meet in it (a rank
    # left waiting there would give up after its bound, 1.5 + 5 s, with a warning).
    assert all(r["finalize_seconds"] < 3 for r in results), results


@pytest.mark.mpi
def test_malformed_and_foreign_packets_are_dropped_and_counted():
    from ina_collectives.protocol import INA

    with embedded_switch() as sw:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for raw in (b"\x00" * 3, b"\x09" + b"\x00" * 40,
                        bytes(INA(job=777, worker=0, values=[1, 2])),           # no such job
                        bytes(INA(flags="RESULT", job=777, values=[1])),         # a result
                        bytes(INA(flags="CONTROL", job=5)) + b"\x00\x00\x00\x01\x07",  # odd
                        bytes(INA(flags="CONTROL", job=5, values=[99, 1]))):     # unknown op
                s.sendto(raw, (sw.host, sw.port))
        # A running job keeps working, and a stranger cannot touch its slots.
        cases = [("float32", "sum", 3 * K, 61)]
        results = run_ina(sw, 2, cases)
        check_job(results, cases, 2)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(bytes(INA(job=1, worker=0, values=[5] * 4)), (sw.host, sw.port))
        assert sw.stop() == 0
    status = parse_status(sw.final_status)["drops"]
    assert status.get("malformed") == 2 and status.get("result_from_a_worker") == 1, status
    assert status.get("unknown_job"), status


def test_fault_settings_are_checked(switch):
    with pytest.raises(ValueError, match="unknown fault.*jitter_in"):
        send_faults((switch.host, switch.port), jitter_in=0.1)
    with pytest.raises(ValueError, match="refused"):
        send_faults((switch.host, switch.port), drop_in=2.0)


def test_switch_cli_errors_are_clear():
    with pytest.raises(RuntimeError, match="cannot bind"):
        with embedded_switch(host="192.0.2.1"):
            pass
    import subprocess
    import sys
    for args, words in [(["--port", "99999"], "argument --port: port 99999 is out of range"),
                        (["--port", "x"], "argument --port: 'x' is not a port number"),
                        (["--log-level", "verbose"],
                         "argument --log-level: 'verbose' is no log level"),
                        (["--faults-from", "localhost"],
                         "argument --faults-from: 'localhost' is not an IPv4 address")]:
        proc = subprocess.run([sys.executable, "-m", "ina_collectives.switch", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
    helped = " ".join(subprocess.run([sys.executable, "-m", "ina_collectives.switch",
                                      "--help"], capture_output=True, text=True,
                                     timeout=60).stdout.split())
    assert "loopback by default" in helped and "(default: 127.0.0.1)" in helped, helped
    assert "fault injection (for tests" in helped, helped


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["length", "dtype", "int", "op"])
def test_ranks_that_disagree_learn_it_from_the_switch_and_go_on(switch, what):
    """A call's opening (docs/protocol.md): the last rank calls with another length,
    dtype (float64, or int32, which no switch serves) or op (MAX, likewise). The switch
    marks the openings' cells, every rank raises AgreementError naming what differs
    (one gate by MPI, on the error path), no opening failed (nothing waited for the
    silence bound) and the next call goes through the switch."""
    n = 3
    results = mpirun.run(n, rank_cases.disagree, {"what": what, "settings": {
        "switch_min_bytes": 0, "switch_silence": 20.0}},
        env={"INA_SWITCH": switch.address_text})
    field = {"int": "dtype"}.get(what, what)
    for r in results:
        first = r["first"]
        assert isinstance(first, dict) and first["error"] == "AgreementError", first
        assert field in first["message"] and "rank 2:" in first["message"], first["message"]
        np.testing.assert_array_equal(r["second"], np.full(10, n, np.float32))
        assert r["second_engine"] == "ina", r
        state = r["switch"]
        assert state["failed_openings"] == 0 and state["opened_calls"] == 1, state
        assert state["outages"] == 0, state


@pytest.mark.mpi
def test_a_rank_that_never_comes_fails_the_others_openings_and_is_named():
    """The last rank never calls: the others' openings go unanswered until the silence
    bound; they take the error path, whose gate by MPI times out naming what it waited
    for."""
    with embedded_switch() as sw:
        results = mpirun.run(3, rank_cases.rank_absent, {"timeout": 2.0, "settings": {
            "switch_min_bytes": 0, "switch_silence": 1.0}},
            env={"INA_SWITCH": sw.address_text}, timeout=60)
    for r in results[:2]:
        first = r["first"]
        assert first["error"] == "CollectiveTimeout", first
        assert "the error path of the opening of call #1" in first["message"], first
        assert r["after"]["error"] == "CommunicatorBroken"
