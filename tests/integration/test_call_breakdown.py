"""bench.loopback.call_breakdown: a toy run (n = 2, two sizes, a few calls through the
embedded switch) writes a record of every size and part whose parts add up to at most each call
(never a timing); its bad options fail, naming the problem."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.loopback import call_breakdown
from ina_collectives.testing.jobs import child_env
from tests.conftest import ROOT


@pytest.mark.mpi  # the benchmark runs its ranks under mpiexec
def test_a_toy_run_records_every_part_and_the_parts_add_up(tmp_path):
    out = tmp_path / "breakdown.json"
    proc = subprocess.run([sys.executable, "-m", "bench.loopback.call_breakdown", "-n", "2",
                           "--sizes", "4K", "64K", "--calls", "12", "--warmup", "3", "--json",
                           str(out)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["setting"]["n"] == 2 and not record["setting"]["netsim"]
    assert record["parts"] == list(call_breakdown.PARTS)
    (job,) = record["jobs"]
    assert len(job["ranks"]) == 2 and job["rtt"]["echo_same_core"] and job["rtt"]["probe"]
    for rank in job["ranks"]:
        assert [r["bytes"] for r in rank["records"]] == [4096, 65536]
        for size in rank["records"]:
            # Each call repeats the last of its size: no opening (predicted), one stream
            # and the first window's exponents in every call.
            assert size["per_call"]["opening"] == 0, size
            assert size["per_call"]["stream"] == 1, size
            assert size["kernel_calls"] == {"block_exponents": 1}, size
            assert size["not_served"] == 0, size["why_not"]
            rows = size["rows"]
            assert len(rows) == 12 and len(size["plain"]) == 12
            for row in rows:
                whole, *parts = row[:len(call_breakdown.PARTS)]
                assert all(p >= 0 for p in parts) and sum(parts) <= whole, row
    (summary,) = record["summaries"]
    for size in summary["sizes"]:
        median = size["median_us"]
        assert {key for _, key in call_breakdown.ROWS} <= set(median)
        assert median["python"] >= 0
    for label, _ in call_breakdown.ROWS:
        assert f"| {label} |" in proc.stdout
    assert "| part | 4 KiB | 64 KiB |" in proc.stdout


def test_the_wire_arithmetic():
    # 4 KiB in one packet of 1024 values (K 2165): a header, 32 pairs, 4 KiB; the opening's
    # packet a header and G = 68 pairs; each with Ethernet, IP and UDP headers.
    got = call_breakdown.wire(4096, 2165, 32, 32, 8)
    head, pair, frame = 40, 4, 42
    assert got == {"data_packets": 1, "opening_packets": 1,
                   "bytes": head + 32 * pair + 4096 + frame + head + 68 * pair + frame}
    assert call_breakdown.wire(1 << 20, 2165, 32, 32, 8)["data_packets"] == 122
    predicted = call_breakdown.wire(4096, 2165, 32, 32, 8, opened=False)
    assert predicted == {"data_packets": 1, "opening_packets": 0,
                         "bytes": head + 32 * pair + 4096 + frame}
    assert call_breakdown.wire(1 << 20, 2165, 32, 32, 8)["opening_packets"] == 8


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "6"], "multiples of 4 bytes"),
    (["--sizes", "lots"], "--sizes takes sizes such as 4K 64K 1M"),
    (["-n", "1"], "-n must be 2..64"),
    (["--calls", "1"], "--calls must be 3 or more"),
])
def test_bad_options_name_the_problem(argv, says, capsys):
    with pytest.raises(SystemExit):
        call_breakdown.parse_args(argv)
    assert says in capsys.readouterr().err
