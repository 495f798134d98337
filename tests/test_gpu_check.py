"""``make gpu-check`` (bench/gpu/gpu_check.py) where no GPU is: it says so in one line and
fails; its reading of pytest's report, its verdict (a skip fails it) and its summary of
the staging benchmark, run here on the CPU."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from bench.gpu import gpu_check, staging
from tests.conftest import ROOT


@pytest.mark.parametrize("cuda", [None, "12.8"])
def test_without_a_gpu_it_says_why_in_one_line_and_fails(monkeypatch, capsys, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran something"))
    assert gpu_check.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    if cuda is None:
        assert err.startswith(f"gpu-check: this torch ({torch.__version__}) is the CPU "
                              f"build: install PyPI's, which bundles CUDA"), err
    else:
        assert err.startswith("gpu-check: no GPU here: torch.cuda.is_available() is False "
                              "(torch "), err
        assert "built for CUDA 12.8" in err, err


def test_the_outcomes_come_from_pytests_report_and_a_skip_fails_the_check(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\n"
        "def test_gpu(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_error(broken): pass\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "test_some.py"], cwd=tmp_path,
                   capture_output=True, check=False)
    got = gpu_check.junit_outcomes(report)
    assert got.passed == ["test_some::test_ok"]
    assert got.failed == ["test_some::test_bad", "test_some::test_error"]
    assert got.skipped == [("test_some::test_gpu", "needs a CUDA GPU")]
    problems = got.problems()
    assert problems[0] == "2 CUDA test(s) failed: test_some::test_bad, test_some::test_error"
    assert problems[1] == ("1 CUDA test(s) skipped, where nothing may skip on a GPU: "
                           "test_some::test_gpu (needs a CUDA GPU)")
    assert gpu_check.Outcomes(passed=["t"]).problems() == []
    assert gpu_check.Outcomes().problems() == ["no CUDA test ran"]


def test_the_cuda_tests_it_runs_exist():
    assert all((ROOT / t).is_file() for t in gpu_check.CUDA_TESTS), gpu_check.CUDA_TESTS


def test_the_staging_benchmark_runs_and_the_summary_shows_its_figures(tmp_path, capsys):
    """bench.gpu.staging on the CPU (its code, not the CUDA path's figures) into the summary."""
    path = tmp_path / "staging.json"
    assert staging.main(["--device", "cpu", "--sizes", "64K", "--repeats", "1",
                         "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["dtype"], r["bytes"], r["windows"]) for r in records] == [
        ("float32", 64 << 10, 1), ("bfloat16", 64 << 10, 1)]
    assert all(r[k] > 0 for r in records for k in ("in_gbs", "out_gbs", "per_window_ms",
                                                  "allreduce_gbs", "plain_in_gbs"))
    text = gpu_check.summary("a GPU", gpu_check.Outcomes(passed=["a", "b"]), records,
                             [])
    lines = text.splitlines()
    assert lines[:2] == ["gpu-check on a GPU", "CUDA tests: 2 passed, 0 failed, 0 skipped "
                         f"({', '.join(gpu_check.CUDA_TESTS)})"]
    assert lines[3] == staging.HEADER and lines[4] == staging.row(records[0])
    assert lines[-1] == "PASSED: every CUDA test ran and passed"
    assert gpu_check.summary("a GPU", gpu_check.Outcomes(), [], ["no CUDA test ran"]
                             ).splitlines()[-1] == "FAILED: no CUDA test ran"


def test_a_size_is_bytes_or_a_number_with_a_unit():
    assert [staging.size_bytes(s) for s in ("4096", "64K", "4M", "1G")] == [
        4096, 64 << 10, 4 << 20, 1 << 30]
    for bad in ("", "M", "4X", "-1M", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="a number with K, M or G"):
            staging.size_bytes(bad)
