"""The chaos soak (bench/loopback/chaos.py), short: 30 s of a 2-rank job in namespaces
while the switch is killed and restarted, a rank is stopped, bursts of loss hit the
links and a second job joins and leaves, each at least once; every result the exact
sum, the same bits on both ranks, no stall past the bound, and the job back on the
switch after each restart."""
from __future__ import annotations

import pytest

from bench.loopback import chaos
from tests.conftest import needs_nft, needs_root


@needs_root
@needs_nft
@pytest.mark.mpi
def test_a_short_chaos_soak_passes_with_every_kind_of_event():
    s = chaos.run_chaos(0.5, n=2, seed=3, echo=False)
    report = chaos.report(s)
    assert s["ok"], report
    assert all(s["event_counts"][k] >= 1 for k in chaos.KINDS), report
    main = s["main"]
    assert main["wrong"] == 0 and main["ranks_differ"] == 0, report
    # Each stall is held to the bound once for each event that began while it lasted,
    # and once more (chaos.check_job): a call may meet several events on a loaded machine.
    assert main["longest_stall_s"] <= main["longest_stall_bound_s"], report
    restarts = s["event_counts"]["restart"]
    # Each restart is an outage the job returns from (a stop or a loss burst may add one).
    assert main["outages"] >= restarts and main["returns"] == main["outages"], report
    assert main["engines"].get("ina", 0) > main["engines"].get("ring", 0), report
    assert all(j["ok"] for j in s["second_jobs"]), report
