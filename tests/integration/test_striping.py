"""A job striped across several aggregators (INA_SWITCH lists them; docs/striping.md):
separate ina-switch processes or one switch's shards (--threads), with loss, one of them
killed mid-call; and several jobs at once on one switch."""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from ina_collectives import protocol as P
from ina_collectives.switch import parse_status, send_faults
from ina_collectives.switch.embedded import embedded_switch
from tests.integration import mpirun, rank_cases
from tests.integration.test_ina import check_job, run_ina

K = P.MAX_ELEMENTS
CASES = [("float32", "sum", 1, 1), ("float32", "sum", K + 1, 3),
         ("float32", "average", 9 * K + 5, 4), ("float64", "sum", 3 * K + 7, 5),
         ("float16", "average", 2 * K + 1, 6), ("float32", "sum", 1_000_003, 7)]


def both(*switches):
    """What INA_SWITCH says for a job striped across these switches."""
    return types.SimpleNamespace(address_text=",".join(s.address_text for s in switches))


def aggregators(result):
    return {a["address"]: a for a in result["stats"]["switch"]["aggregators"]}


@pytest.mark.mpi
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_a_job_striped_across_two_switches_within_bound(loss):
    with embedded_switch() as a, embedded_switch() as b:
        for sw in (a, b):
            send_faults((sw.host, sw.port), drop_in=loss, drop_out=loss)
        results = run_ina(both(a, b), 3, CASES, rounds=2)
        a.stop()
        b.stop()
    check_job(results, CASES, 3, rounds=2)
    for r in results:
        switch = r["stats"]["switch"]
        # The calls of many chunks used both (a call of a few may go to one alone when
        # the measured shares are uneven, as loss makes them).
        assert 2 * 2 <= switch["striped_calls"] <= 2 * (len(CASES) - 1), switch
        assert [x["serving"] for x in switch["aggregators"]] == [True, True], switch
        assert all(x["elements_per_second"] > 0 for x in switch["aggregators"]), switch
        assert abs(sum(x["share"] for x in switch["aggregators"]) - 1) < 1e-6, switch
    for sw in (a, b):  # both aggregated: results went out of each
        status = parse_status(sw.final_status)
        assert status["results"] > 0, sw.final_status
        if loss:
            assert status["drops"].get("injected_loss_in"), sw.final_status


@pytest.mark.mpi
def test_a_sharded_switch_serves_a_job_from_every_shard():
    with embedded_switch(threads=2) as sw:
        assert len(sw.addresses) == 2 and sw.address_text.count(",") == 1
        results = run_ina(sw, 2, CASES)
        sw.stop()
    check_job(results, CASES, 2)
    assert 2 <= results[0]["stats"]["switch"]["striped_calls"] <= len(CASES) - 1
    shard_lines = [line for line in sw.lines if line.startswith("ina-switch 127.0.0.1:")
                   and " in=" in line]
    assert len(shard_lines) == 3, sw.lines  # each shard's line, then the sum of both
    per_shard = [parse_status(line)["results"] for line in shard_lines]
    assert per_shard[0] > 0 and per_shard[1] > 0 and per_shard[2] == per_shard[0] + per_shard[1]


@pytest.mark.mpi
def test_naming_one_shard_finds_them_all():
    """INA_SWITCH names only the first port of a switch of two shards: its reply to rank
    0's probe lists both (CAP_SHARDS), and the job stripes across them."""
    with embedded_switch(threads=2) as sw:
        first = types.SimpleNamespace(address_text="%s:%d" % sw.addresses[0])
        results = run_ina(first, 2, CASES)
        sw.stop()
    check_job(results, CASES, 2)
    for r in results:
        assert sorted(aggregators(r)) == sorted(f"{h}:{p}" for h, p in sw.addresses), r
        assert r["stats"]["switch"]["striped_calls"] >= 2, r["stats"]["switch"]


@pytest.mark.mpi
@pytest.mark.parametrize("standby", [True, False])
def test_an_aggregator_killed_mid_call_hands_its_share_over_and_the_other_serves(standby):
    """Four large calls striped across two switches; B is SIGKILLed 20 ms into the
    second. The call under way then (the second, or the third if the second was quicker)
    has its share on B streamed again through A, which already serves the job (the
    standby, switch_standby), or with the standby off finished on the ring; the share on
    A stays, and later calls go to A alone. Every element is reduced once: all within
    bound, every rank the same bits."""
    cases = [("float32", "sum", 3_000_000, 61), ("float32", "sum", 3_000_000, 62),
             ("float32", "average", 3_000_000, 63), ("float32", "sum", 3_000_000, 64)]
    with embedded_switch() as a, embedded_switch() as b:
        results = mpirun.run(2, rank_cases.ina_switch_dies, {
            "cases": cases, "kill_after": 0.02, "switch_pid": b.pid,
            "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0, "switch_silence": 0.5,
                         "switch_retry_seconds": 0, "switch_standby": standby}},
            env={"INA_SWITCH": both(a, b).address_text}, timeout=120)
        assert a.process.poll() is None, a.lines
    for i, case in enumerate(cases):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        from tests.inputs import check_within_bound
        check_within_bound(per_rank[0], *case, 2)
    for r in results:
        stats = r["stats"]
        engines = [e["engine"] for e in r["engines"]]
        switch = stats["switch"]
        assert switch["serving"] and switch["outages"] == 0, switch  # A kept serving
        state = aggregators(r)
        assert state[a.address_text]["serving"] and not state[b.address_text]["serving"]
        assert "failed mid-operation" in state[b.address_text]["why_not"], state
        if standby:
            assert engines == ["ina"] * 4, engines
            assert switch["standby_takeovers"] == 1, switch
            assert switch["partial_handovers"] == 0 and not stats["fallback_reasons"], stats
        else:
            assert engines.count("ring") == 1 and engines[0] == engines[-1] == "ina", engines
            assert switch["partial_handovers"] == 1 and switch["standby_takeovers"] == 0
            (reason,) = stats["fallback_reasons"]
            assert "aggregator failed mid-operation" in reason and str(b.port) in reason


@pytest.mark.mpi
def test_three_jobs_at_once_on_one_switch():
    cases = [("float32", "sum", 400_000, 70), ("float32", "average", 3 * K + 1, 71)]
    with embedded_switch() as sw:
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(run_ina, sw, 2, [(d, op, count, seed + 10 * j)
                                                 for d, op, count, seed in cases], 4)
                    for j in range(3)]
            results = [job.result() for job in jobs]
        sw.stop()
    for j, job in enumerate(results):
        check_job(job, [(d, op, count, seed + 10 * j) for d, op, count, seed in cases], 2,
                  rounds=4)
    status = parse_status(sw.final_status)
    assert status["control"]["joins"] == 6 and status["control"]["leaves"] == 6, status
    # No job's packets touched another's cells. A retransmission that arrives while its
    # own chunk is still in progress (6 ranks on 2 cores: a timer fired early) is each
    # job's own business, dropped and counted as such.
    others = [d for d in status["drops"] if d != "duplicate_in_progress"]
    assert not others, sw.final_status


def test_shards_with_p4runtime_are_refused_by_name():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ina_collectives.switch", "--port", "0",
                          "--threads", "2", "--p4runtime-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--p4runtime-port serves one shard" in out.stderr, out


@pytest.mark.mpi
def test_ctrl_c_ends_a_striped_call_and_its_other_streams():
    """Both switches hold every result back 500 ms: SIGINT on rank 0 ends the call with
    KeyboardInterrupt within a second, its other share's stream (in a thread) cancelled
    first; rank 1 learns it through the bounded outcome wait."""
    with embedded_switch() as a, embedded_switch() as b:
        for sw in (a, b):
            send_faults((sw.host, sw.port), delay_ms_out=500)
        params = {"count": 2 << 20, "interrupt_after": 0.3,
                  "settings": {"switch_min_bytes": 0, "switch_silence": 1.5, "timeout": 3}}
        results = mpirun.run(2, rank_cases.ina_interrupted, params,
                             env={"INA_SWITCH": both(a, b).address_text}, timeout=120)
    interrupted, other = results
    assert interrupted["error"]["error"] == "KeyboardInterrupt", interrupted
    assert interrupted["after_signal"] < 1.0, interrupted
    assert other["error"]["error"] == "CollectiveTimeout", other


@pytest.mark.mpi
def test_shares_follow_each_aggregators_measured_throughput():
    """B holds each result back 20 ms, A does not: after a few calls B's share of each
    call has shrunk well below half (not to nothing: it keeps a floor, so it keeps being
    measured), and the results stay within bound."""
    cases = [("float32", "sum", 40 * K, 90)]
    with embedded_switch() as a, embedded_switch() as b:
        send_faults((b.host, b.port), delay_ms_out=20)
        results = run_ina(both(a, b), 2, cases, rounds=6)
    check_job(results, cases, 2, rounds=6)
    for r in results:
        shares = [x["share"] for x in r["stats"]["switch"]["aggregators"]]
        assert shares[1] < 0.35 and shares[1] >= 0.1, shares
        rates = [x["elements_per_second"] for x in r["stats"]["switch"]["aggregators"]]
        assert rates[0] > 2 * rates[1], rates
