"""Run a case of tests/integration/rank_cases.py as a real mpiexec job and collect every
rank's result (the job launched by ina_collectives/testing/jobs.py)."""
from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ina_collectives.launch.ranks import find_mpiexec
from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line, run_group


def mpiexec() -> str:
    return find_mpiexec()


class JobFailed(AssertionError):
    pass


def run(n: int, case: str, params: dict[str, Any] | None = None, *,
        env: dict[str, str] | None = None, timeout: float = 120.0,
        survive_dead_ranks: bool = False, module: str = "tests.integration.rank_cases",
        namespaces: Sequence[str] | None = None) -> list[Any]:
    """Run ``case`` on ``n`` ranks; returns each rank's return value (or raised exception
    as ``{"error": type name, "message": str}``), indexed by rank; a rank that died leaves
    None. ``survive_dead_ranks`` keeps Hydra from killing the job when a rank dies.
    ``module`` holds the case (tests.integration.torch_cases registers its cases beside
    these). ``namespaces``: rank r runs in network namespace ``namespaces[r]``
    (tests/integration/fabric.py); the ranks still reach each other over shared memory.
    The caller's INA_* settings stay out: a test's job gets the settings it names."""
    if namespaces is not None and len(namespaces) != n:
        raise ValueError(f"{n} ranks need {n} namespaces, got {list(namespaces)}")
    with tempfile.TemporaryDirectory(prefix="ina-test-") as out:
        rank = [sys.executable, "-m", module, case, json.dumps(params or {}), out]
        cmd = mpiexec_line(mpiexec(), rank, n=n if namespaces is None else None,
                           namespaces=namespaces,
                           options=["-disable-auto-cleanup"] if survive_dead_ranks else [])
        returncode, output = run_group(cmd, child_env(env), timeout, ROOT)
        if returncode is None:
            raise JobFailed(f"{case} on {n} ranks did not finish in {timeout:g} s:\n{output}")
        results = []
        for rank in range(n):
            path = Path(out, f"rank{rank}.pkl")
            if not path.exists():
                if survive_dead_ranks:
                    results.append({"dead": True, "output": output})
                    continue
                raise JobFailed(f"{case}: rank {rank} left no result (exit {returncode}):"
                                f"\n{output}")
            results.append(pickle.loads(path.read_bytes()))
        if returncode != 0 and not survive_dead_ranks and not any(
                isinstance(r, dict) and r.get("abandoned") for r in results):
            raise JobFailed(f"{case}: mpiexec exited {returncode}:\n{output}")
        return results
