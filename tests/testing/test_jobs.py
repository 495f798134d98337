"""ina_collectives/testing/jobs.py: a job's whole process group killed past its bound
(the ranks too, not only their launcher), the children's environment, mpiexec's lines."""
from __future__ import annotations

import os
import sys
import time

import pytest

from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line, run_group


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_job_past_its_bound_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The launcher starts a child that outlives it, as mpiexec's ranks would.
    script = (f"import subprocess, sys, time; "
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
              f"time.sleep(60)")
    start = time.monotonic()
    code, output = run_group([sys.executable, "-c", script], child_env(), limit=3)
    assert code is None and "started" in output, output
    assert time.monotonic() - start < 20
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the job's child outlived its bound"


def test_a_job_within_its_bound_gives_its_code_and_merged_output():
    code, output = run_group([sys.executable, "-c", "import sys; print('out'); "
                              "print('err', file=sys.stderr); sys.exit(3)"], child_env(), 30)
    assert code == 3 and "out" in output and "err" in output


def test_a_bound_must_be_positive():
    with pytest.raises(ValueError, match="positive number of seconds"):
        run_group(["true"], child_env(), 0)


def test_the_childs_environment_imports_this_checkout_without_the_callers_settings(
        monkeypatch):
    monkeypatch.setenv("INA_SWITCH", "10.0.0.1:47474")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env({"INA_JOB": "7"})
    assert "INA_SWITCH" not in env and env["INA_JOB"] == "7"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert child_env(keep_settings=True)["INA_SWITCH"] == "10.0.0.1:47474"
    assert (ROOT / "ina_collectives" / "testing" / "jobs.py").is_file()


def test_mpiexec_lines_plain_and_one_rank_per_namespace():
    assert mpiexec_line("mpiexec", ["prog", "a"], n=2) == ["mpiexec", "-n", "2", "prog", "a"]
    assert mpiexec_line("mpiexec", ["prog"], namespaces=["x", "y"],
                        options=["-disable-auto-cleanup"]) == [
        "mpiexec", "-disable-auto-cleanup", "-n", "1", "ip", "netns", "exec", "x", "prog",
        ":", "-n", "1", "ip", "netns", "exec", "y", "prog"]
    for bad in ({}, {"n": 2, "namespaces": ["x", "y"]}, {"n": 0}, {"namespaces": []}):
        with pytest.raises(ValueError):
            mpiexec_line("mpiexec", ["prog"], **bad)
