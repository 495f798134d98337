"""Run a case of tests/integration/rank_cases.py as a real mpiexec job and collect every
rank's result."""
from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench.mpi import run_group
from ina_collectives.launch.ranks import find_mpiexec

ROOT = Path(__file__).resolve().parents[2]


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
    (tests/integration/fabric.py); the ranks still reach each other over shared memory."""
    with tempfile.TemporaryDirectory(prefix="ina-test-") as out:
        rank = [sys.executable, "-m", module, case, json.dumps(params or {}), out]
        cmd = [mpiexec(), *(["-disable-auto-cleanup"] if survive_dead_ranks else [])]
        if namespaces is None:
            cmd += ["-n", str(n), *rank]
        else:
            assert len(namespaces) == n, (namespaces, n)
            for r, ns in enumerate(namespaces):
                cmd += [*([":"] if r else []), "-n", "1", "ip", "netns", "exec", ns, *rank]
        # The caller's INA_* settings stay out: a test's job gets the settings it names.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("INA_")}
        full_env.update(env or {})
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
        # (in a session of its own, the whole group killed past the bound or on Ctrl-C)
        returncode, output = run_group(cmd, full_env, timeout, ROOT)
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
