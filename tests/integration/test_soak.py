"""The soak of issue 19 (item 5), shortened: consecutive allreduces of mixed sizes through
the software switch under 5% loss, duplication and reordering in both directions and delay
jitter; every result exact (bit for bit against the exact sum and the ring's result),
identical on every rank, most calls served by the switch, and no hang
(bench/loopback/soak.py)."""
from __future__ import annotations

import time

import pytest

from bench.loopback import soak


@pytest.mark.mpi
def test_soak_200_calls_under_faults_exact_and_served_by_the_switch():
    calls = 200
    start = time.monotonic()
    s = soak.run_soak(n=2, calls=calls, seed=19, timeout=120.0)
    assert time.monotonic() - start < 150
    report = soak.report(s)
    assert s["completed"] == calls, report
    assert s["exact"]["mismatches"] == 0, s["exact"]["first"]
    assert s["ring"]["mismatches"] == 0, s["ring"]["first"]
    assert s["ring"]["checked_calls"] == calls
    assert s["identical_on_all_ranks"], s["ranks_differ_at"]
    # Fallbacks are allowed (a stalled chunk hits the silence bound and the call finishes
    # on the ring, exactly), but the switch must have served nearly every call.
    assert s["engines"].get("ina", 0) >= 0.95 * calls, (s["engines"], s["fallbacks"])
    assert s["fallbacks"]["switch"]["serving"], s["fallbacks"]
    assert s["verdict"]["ok"], report
    # The faults really happened: losses both ways, duplicates, jitter, retransmissions.
    drops = s["switch"]["drops"]
    # A late retransmission once opened a finished cell again ("ghost"): the next use of
    # the slot was then refused as mismatched and the call stalled, or summed stale values.
    assert "mismatched_chunk" not in drops, drops
    assert drops.get("injected_loss_in", 0) > 0 and drops.get("injected_loss_out", 0) > 0, \
        s["switch"]
    assert s["transport_totals"]["retransmitted"] > 0, s["transport_totals"]
    assert s["jitter"]["updates"] > 10 and not s["jitter"]["errors"], s["jitter"]
    for name in ("tiny <1KiB", "xlarge 2-4MiB"):  # the mix spans the sizes
        assert s["seconds_by_class"][name]["calls"] > 0, s["seconds_by_class"]


@pytest.mark.mpi
def test_soak_that_cannot_finish_ends_with_a_clear_error():
    """The job's bound: killed and reported, never a hang."""
    start = time.monotonic()
    with pytest.raises(soak.SoakFailed, match="did not finish within 5 s"):
        soak.run_soak(n=2, calls=1_000_000, timeout=5.0)
    assert time.monotonic() - start < 30


def _record(i, digest="d", engine="ina", exact=None, ring=None, seconds=0.01):
    return {"i": i, "size_class": "tiny <1KiB", "count": 8, "dtype": "float32", "op": "sum",
            "seconds": seconds, "engine": engine, "passed_over": [] if engine == "ina"
            else ["ina: aggregator failed mid-operation"], "digest": digest,
            "exact_diff": exact, "transport": {}, "ring_seconds": 0.001,
            "ring_engine": "ring", "ring_diff": ring}


def _ranks(*per_rank):
    return [{"rank": r, "records": records, "error": None, "stats": {}}
            for r, records in enumerate(per_rank)]


def test_summary_passes_a_clean_run_and_flags_every_failure():
    good = [_record(i) for i in range(10)]
    assert soak.summarize(_ranks(good, good), 10, 0.95)["verdict"]["ok"]
    # Bits that differ between ranks.
    other = [_record(i, digest="x" if i == 3 else "d") for i in range(10)]
    s = soak.summarize(_ranks(good, other), 10, 0.95)
    assert not s["verdict"]["ok"] and s["ranks_differ_at"] == [3]
    # A result off the exact sum, and one off the ring's.
    diff = {"elements": 1, "first": 0, "got": 1.0, "expected": 2.0}
    bad = [_record(i, exact=diff if i == 1 else None, ring=diff if i == 2 else None)
           for i in range(10)]
    failures = soak.summarize(_ranks(bad, good), 10, 0.95)["verdict"]["failures"]
    assert any("exact sum" in f for f in failures) and any("ring's" in f for f in failures)
    # Everything fell back to the ring: exact, but not a pass.
    ring = [_record(i, engine="ring") for i in range(10)]
    s = soak.summarize(_ranks(ring, ring), 10, 0.95)
    assert not s["verdict"]["ok"] and s["fallbacks"]["count"] == 10
    assert any("served by the switch" in f for f in s["verdict"]["failures"])
    # A rank that stopped early.
    s = soak.summarize(_ranks(good, good[:4]), 10, 0.95)
    assert any("made 4 of 10" in f for f in s["verdict"]["failures"])
