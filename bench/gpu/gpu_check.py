"""``make gpu-check``: everything only a GPU runs, in one command, for the first machine
with one (nothing here has run on a GPU yet).

    python -m bench.gpu.gpu_check [--results bench/results] [--timeout 1200]

1. A CUDA device must be there: else one line says why not (no GPU, or torch's CPU
   build) and the exit code is 2.
2. The CUDA tests (``CUDA_TESTS``: tests/torch/test_cuda.py, and the staging path's CPU
   tests beside them) run under pytest with ``-rs``. Any failure fails the check, and so
   does any skip: on a GPU machine nothing there may skip.
3. ``bench.gpu.staging`` measures the staging path: pinned-window copies in and out, the
   first window's latency, a whole allreduce of a device tensor.
4. A summary: the device, the tests passed, the staging figures; also saved, with the
   benchmark's records, in RESULTS/gpu_check.json. Exit code 0 only if all of it passed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bench import RESULTS
from ina_collectives.testing.jobs import ROOT

CUDA_TESTS = ("tests/torch/test_cuda.py", "tests/torch/test_windows.py")


def why_no_gpu() -> str | None:
    """Why this machine cannot run the check, in one line; None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: pip install '.[torch]' (its CUDA build, from PyPI)"
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is the CPU build: install PyPI's, "
                f"which bundles CUDA (pip install --force-reinstall --index-url "
                f"https://pypi.org/simple torch=={torch.__version__.split('+')[0]})")
    return (f"no GPU here: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run make gpu-check on a machine with an "
            f"NVIDIA GPU and its driver")


def device_line() -> str:
    import torch
    index = torch.cuda.current_device()
    return (f"{torch.cuda.get_device_name(index)} (cuda:{index} of "
            f"{torch.cuda.device_count()}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda})")


@dataclasses.dataclass
class Outcomes:
    """What a pytest run's JUnit XML report says: test ids by outcome."""
    passed: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)  # failures and errors
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (id, why)

    def problems(self) -> list[str]:
        """What keeps the tests from passing the check ([] when nothing)."""
        found = []
        if self.failed:
            found.append(f"{len(self.failed)} CUDA test(s) failed: {', '.join(self.failed)}")
        if self.skipped:
            found.append(f"{len(self.skipped)} CUDA test(s) skipped, where nothing may skip "
                         f"on a GPU: " + "; ".join(f"{t} ({why})" for t, why in self.skipped))
        if not (self.passed or self.failed or self.skipped):
            found.append("no CUDA test ran")
        return found


def junit_outcomes(path: Path) -> Outcomes:
    """The outcome of each test case in pytest's ``--junitxml`` report at ``path``."""
    outcomes = Outcomes()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            outcomes.failed.append(name)
        elif "skipped" in kinds:
            outcomes.skipped.append((name, kinds["skipped"].get("message", "")))
        else:
            outcomes.passed.append(name)
    return outcomes


def run_tests(report: Path, timeout: float) -> tuple[Outcomes, list[str]]:
    """The CUDA tests under pytest, their output on this terminal; their outcomes, and
    what went wrong beyond them (a crash or a timeout of pytest itself)."""
    command = [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={report}", *CUDA_TESTS]
    print("$", " ".join(command), flush=True)
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return Outcomes(), [f"the CUDA tests did not finish in {timeout:g} s"]
    if not report.exists():
        return Outcomes(), [f"pytest exited with code {code} and wrote no report"]
    outcomes = junit_outcomes(report)
    extra = [] if code in (0, 1) or outcomes.problems() else [
        f"pytest exited with code {code}"]
    return outcomes, extra


def run_staging(path: Path, timeout: float) -> tuple[list[dict], list[str]]:
    """bench.gpu.staging on the GPU; its records, and what went wrong."""
    command = [sys.executable, "-m", "bench.gpu.staging", "--json", str(path)]
    print("$", " ".join(command), flush=True)
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return [], [f"the staging benchmark did not finish in {timeout:g} s"]
    if code != 0 or not path.exists():
        return [], [f"the staging benchmark failed (exit code {code})"]
    return json.loads(path.read_text()), []


def summary(device: str, outcomes: Outcomes, records: list[dict],
            problems: list[str]) -> str:
    """What the check measured, for the terminal."""
    from bench.gpu.staging import HEADER, row
    lines = [f"gpu-check on {device}",
             f"CUDA tests: {len(outcomes.passed)} passed, {len(outcomes.failed)} failed, "
             f"{len(outcomes.skipped)} skipped ({', '.join(CUDA_TESTS)})"]
    if records:
        lines += ["staging (bench.gpu.staging; GB/s, and ms for setup and windows):", HEADER,
                  *(row(r) for r in records)]
    lines += [f"FAILED: {p}" for p in problems] or ["PASSED: every CUDA test ran and passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.gpu_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the reports go (the tests' JUnit XML, staging.json, "
                        "gpu_check.json)")
    p.add_argument("--timeout", type=float, default=1200.0, metavar="SECONDS",
                   help="bound on the tests, and again on the benchmark")
    args = p.parse_args(argv)
    why = why_no_gpu()
    if why is not None:
        print(f"gpu-check: {why}", file=sys.stderr)
        return 2
    device = device_line()
    print(f"gpu-check on {device}", flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    outcomes, trouble = run_tests(args.results / "gpu_check_tests.xml", args.timeout)
    records, bench_trouble = run_staging(args.results / "staging.json", args.timeout)
    problems = outcomes.problems() + trouble + bench_trouble
    (args.results / "gpu_check.json").write_text(json.dumps(
        {"device": device, "passed": outcomes.passed, "failed": outcomes.failed,
         "skipped": outcomes.skipped, "staging": records, "problems": problems}, indent=1))
    print(summary(device, outcomes, records, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
