"""ina/aggregators.py at 1-2 ranks in one process (tests/threadcomm.py), with a software
switch in a thread (tests/switch/test_server.py: switch_thread) or a port where nobody
listens: the ranks join and agree on K and the path MTU, an INA_SWITCH that names no
aggregator or one twice is refused, an aggregator nobody answers leaves every rank with
the same reason (or, with require_switch, an error), failed joins back off in time,
an aggregator lost mid-run is joined again at a call boundary (rank 0's news from
probes that do not wait), and an installed job whose ports do not
fit this communicator is joined as a job of its own. (tests/integration/test_aggregators.py
runs the aggregators themselves, software and P4, under mpiexec jobs.)"""
from __future__ import annotations

import logging
import time

import pytest

from ina_collectives import protocol as P
from ina_collectives.errors import AggregatorUnavailable
from ina_collectives.ina import kernels
from ina_collectives.ina.aggregators import Aggregators
from ina_collectives.settings import Settings
from tests.switch.test_server import switch_thread
from tests.threadcomm import run_ranks


def settings_for(address: str, **more) -> Settings:
    return Settings(switch=address, timeout=5, switch_join_timeout=0.3, **more)


def on_aggregators(n: int, settings: Settings, body):
    """``body(aggregators, comm)`` on n ranks, each with the Aggregators it joined
    (released after); the results by rank."""
    def rank(comm):
        aggs = Aggregators(comm, settings, kernels.select(settings.kernels))
        try:
            return body(aggs, comm)
        finally:
            aggs.release()
    return run_ranks(n, rank, timeout=60)


def test_every_rank_joins_and_the_ranks_agree_on_k_and_the_path_mtu():
    with switch_thread() as sw:
        address = "%s:%d" % sw.address

        def body(aggs, comm):
            link = aggs.link
            return (aggs.serving(), aggs.unavailable, aggs.where(0), aggs.elements,
                    aggs.path_mtu, link.k, link.slots, aggs.outages)

        results = on_aggregators(2, settings_for(address), body)
    assert results[0] == results[1]
    serving, unavailable, where, k, mtu, link_k, slots, outages = results[0]
    assert (serving, unavailable, where, outages) == ([0], None, address, 0)
    assert k == link_k == P.elements_for_mtu(mtu, P.DEFAULT_BLOCK, 32), (k, mtu)
    assert slots > 0


def test_no_switch_named_is_unavailable_and_a_wrong_list_is_refused_naming_it():
    def body(aggs, comm):
        return aggs.unavailable, aggs.serving(), aggs.link

    assert on_aggregators(1, Settings(switch=""), body) == [
        ("ina: no aggregator configured (INA_SWITCH)", [], None)]
    for text, words in ((",", "names no aggregator"),
                        ("127.0.0.1:9,127.0.0.1:9", "name 127.0.0.1:9 twice"),
                        ("127.0.0.1:0", "port 0 is out of range")):
        with pytest.raises(Exception) as refused:
            on_aggregators(1, settings_for(text), body)
        assert isinstance(refused.value.__cause__, ValueError), text
        assert str(refused.value.__cause__).startswith(f"INA_SWITCH={text!r}: "), text
        assert words in str(refused.value.__cause__), text


def test_an_aggregator_nobody_answers_leaves_every_rank_the_same_reason(closed_udp_port):
    address = f"127.0.0.1:{closed_udp_port}"

    def body(aggs, comm):
        return aggs.unavailable, aggs.serving(), aggs.outages

    results = on_aggregators(2, settings_for(address), body)
    assert results[0] == results[1]
    reason, serving, outages = results[0]
    assert reason.startswith("ina: aggregator unavailable (rank 0: "), reason
    assert (serving, outages) == ([], 0)

    def rank(comm):
        settings = settings_for(address, require_switch=True)
        with pytest.raises(AggregatorUnavailable, match="INA_REQUIRE_SWITCH is set and "
                                                        "the switch cannot serve: ina: "):
            Aggregators(comm, settings, kernels.select(settings.kernels))
    run_ranks(2, rank, timeout=30)


def test_an_aggregator_that_never_answers_is_never_joined_and_failed_joins_back_off_in_time(
        closed_udp_port, caplog):
    """Nobody answers rank 0's probes: calls 1-7 (no agreement: rank 0's news comes in
    a broadcast of its own) try no join at all. Where the news says it answered but the
    join fails, the next news waits 0.05, 0.1, 0.2 ... s of rank 0's clock, at most
    switch_retry_seconds (0.3 here), and every rank says the same."""
    address = f"127.0.0.1:{closed_udp_port}"

    def body(aggs, comm):
        for seq in range(1, 8):
            aggs.at_call_boundary(seq)
        quiet = [r.getMessage() for r in caplog.records if "still unavailable" in
                 r.getMessage()]
        for seq in range(8, 13):
            aggs.at_call_boundary(seq, 1)  # (news as if it answered: the join fails)
        return quiet, aggs.unavailable is not None, aggs.returns

    caplog.set_level(logging.INFO, logger="ina_collectives")
    results = on_aggregators(2, settings_for(address, switch_retry_seconds=0.3), body)
    assert results == [([], True, 0)] * 2
    said = [r.getMessage() for r in caplog.records if "still unavailable" in r.getMessage()]
    gaps = sorted(float(m.split("once it answers ")[1].split(" s")[0]) for m in said)
    assert gaps == sorted(2 * [0.05, 0.1, 0.2, 0.3, 0.3]), said


def test_an_aggregator_lost_mid_run_is_joined_again_at_a_call_boundary():
    """Lost at call 3 on every rank: calls take the ring (``unavailable`` is the
    reason); from call 4 on (no agreement: rank 0's news in a broadcast of its own)
    rank 0's probes find it answering, and every rank joins it again at the same call.
    Lost again: rank 0's news, given to a call's boundary as an agreement would carry
    it, brings every rank back."""
    with switch_thread() as sw:
        def body(aggs, comm):
            aggs.lost([0], "ina: the switch went silent", 3)
            out = [(aggs.unavailable, aggs.outages, aggs.link is None)]
            seq, deadline = 4, time.monotonic() + 5
            while aggs.returns == 0 and time.monotonic() < deadline:
                aggs.at_call_boundary(seq)  # (no news given: the agreement check is off)
                seq += 1
                time.sleep(0.01)
            out.append((aggs.unavailable, aggs.returns, aggs.serving()))
            aggs.lost([0], "ina: the switch went silent again", seq)
            news = 0
            if comm.Get_rank() == 0:
                deadline = time.monotonic() + 5
                while not news and time.monotonic() < deadline:
                    news = aggs.answers_again()
                    time.sleep(0.002)
            news = comm.bcast(news, root=0)
            aggs.at_call_boundary(seq + 1, news)
            out.append((news, aggs.unavailable, aggs.returns, aggs.outages, aggs.serving()))
            return out

        results = on_aggregators(2, settings_for("%s:%d" % sw.address), body)
    for lost, back, again in results:
        assert lost == ("ina: the switch went silent", 1, True)
        assert back == (None, 1, [0])
        assert again == (1, None, 2, 2, [0])


def test_an_installed_job_whose_ports_do_not_fit_is_joined_as_a_job_of_its_own(caplog):
    """job 7 names 3 worker ports, for 2 ranks at one aggregator: this communicator
    joins with a job id of its own (and says so) instead of probing entries that are not
    its."""
    caplog.set_level(logging.INFO, logger="ina_collectives")
    with switch_thread() as sw:
        def body(aggs, comm):
            return aggs.settings.job, aggs.serving(), aggs.link.job != 7

        settings = settings_for("%s:%d" % sw.address, job=7, worker_ports="7001,7002,7003")
        results = on_aggregators(2, settings, body)
    assert results == [(0, [0], True)] * 2
    assert any("the installed job 7 is for 3 worker port(s)" in r.getMessage()
               for r in caplog.records)
