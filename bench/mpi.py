"""Run multi-rank pytest-benchmark modules: ``python -m bench.mpi -n 4 [PYTEST ARGS...]``.

Starts the embedded software switch (unless INA_SWITCH is set) so that the "ina" rows
go through it. Every rank runs pytest with the same fixed rounds (benchmark.pedantic),
so the ranks stay in step; rank 0 prints the table and writes --benchmark-json (default
bench/results/allreduce-<n>.json).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent


def run_group(command: Sequence[str], env: dict[str, str], limit: float,
              cwd: str | os.PathLike) -> tuple[int | None, str]:
    """``command`` (mpiexec and its ranks) in a session of its own, its output merged:
    (exit code, output), or (None, output) past ``limit`` seconds, when its whole process
    group is killed (the ranks too, not only mpiexec); the same on Ctrl-C."""
    proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    finally:
        if proc.poll() is None:  # (Ctrl-C while it ran: take the job down too)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    args, pytest_args = parser.parse_known_args()
    if not any(a.startswith("--benchmark-json") for a in pytest_args):
        (HERE / "results").mkdir(exist_ok=True)
        pytest_args.append(f"--benchmark-json={HERE / 'results' / f'allreduce-{args.n}.json'}")
    if not any(a.endswith(".py") or "::" in a for a in pytest_args):
        pytest_args.insert(0, str(HERE / "test_allreduce.py"))
    from ina_collectives.launch.ranks import find_mpiexec

    mpiexec = find_mpiexec()
    cmd = [str(mpiexec), "-n", str(args.n), sys.executable, "-m", "pytest", "-p",
           "no:cacheprovider", *pytest_args]
    from ina_collectives.switch.embedded import embedded_switch

    with contextlib.ExitStack() as stack:
        env = dict(os.environ)
        if not env.get("INA_SWITCH"):
            switch = stack.enter_context(embedded_switch())
            env["INA_SWITCH"] = switch.address_text
        return subprocess.call(cmd, cwd=HERE.parent, env=env)


if __name__ == "__main__":
    sys.exit(main())
