"""A rank function as a real job, every rank's result collected: the test's side (``run``,
an mpiexec job launched by ina_collectives/testing/jobs.py; ``rank_args``, the line any
other launcher starts) and the rank's (``main``: ``python -m tests.integration.mpirun``).

A rank function (the cases of rank_cases.py, torch_cases.py, ddp_cases.py) is a
module-level function of (comm, params) that every rank runs: a test passes the function
itself, ``run(2, rank_cases.ina_cases, params)``, and each rank imports it by the path the
function object gives (its module and qualified name). Its return value, or the exception
it raised (``error``, with the traceback), is pickled to OUTDIR/rank<r>.pkl for the test
to check.
"""
from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from ina_collectives.launch.ranks import find_mpiexec
from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line, run_group

RankFunction = Callable[[Any, dict], Any]
RANK_MODULE = "tests.integration.mpirun"   # what each rank runs (main)


def mpiexec() -> str:
    return find_mpiexec()


class JobFailed(AssertionError):
    pass


def error(exc: BaseException) -> dict[str, Any]:
    """What a rank reports of an exception: its type's name, its message, and the names
    of the types it is an instance of."""
    return {"error": type(exc).__name__, "message": str(exc),
            "types": [t.__name__ for t in type(exc).__mro__]}


def _find(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def rank_path(case: RankFunction) -> tuple[str, str]:
    """The module and the qualified name each rank imports ``case`` by; ValueError for a
    function no rank could import by them (a lambda, a nested function, one of
    ``__main__``, one its module's name no longer reaches)."""
    module = getattr(case, "__module__", None)
    qualname = getattr(case, "__qualname__", None)
    if (not callable(case) or not module or not qualname or module == "__main__"
            or "<" in qualname):
        raise ValueError(f"a rank imports its function by module and name: {case!r} is no "
                         f"module-level function of (comm, params)")
    try:
        found = _find(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"a rank could not import {module}.{qualname}: {exc}") from exc
    if found is not case:
        raise ValueError(f"{module}.{qualname} names {found!r}, not {case!r}")
    return module, qualname


def rank_args(case: RankFunction, params: dict[str, Any] | None, outdir: str | os.PathLike,
              *, torchrun: bool = False) -> list[str]:
    """Python's arguments for one rank of ``case`` (after the interpreter; torchrun takes
    them as they are): ``-m tests.integration.mpirun [--torchrun] MODULE QUALNAME PARAMS
    OUTDIR``. ``torchrun``: the ranks are torchrun's (RANK, WORLD_SIZE), with no MPI job."""
    module, qualname = rank_path(case)
    return ["-m", RANK_MODULE, *(["--torchrun"] if torchrun else []), module, qualname,
            json.dumps(params or {}), str(outdir)]


def run(n: int, case: RankFunction, params: dict[str, Any] | None = None, *,
        env: dict[str, str] | None = None, timeout: float = 120.0,
        survive_dead_ranks: bool = False,
        namespaces: Sequence[str] | None = None) -> list[Any]:
    """Run the rank function ``case`` on ``n`` ranks; returns each rank's return value (or
    raised exception as ``{"error": type name, "message": str}``), indexed by rank; a rank
    that died leaves None. ``survive_dead_ranks`` keeps Hydra from killing the job when a
    rank dies. ``namespaces``: rank r runs in network namespace ``namespaces[r]``
    (tests/integration/fabric.py); the ranks still reach each other over shared memory.
    The caller's INA_* settings stay out: a test's job gets the settings it names."""
    if namespaces is not None and len(namespaces) != n:
        raise ValueError(f"{n} ranks need {n} namespaces, got {list(namespaces)}")
    name = rank_path(case)[1]
    with tempfile.TemporaryDirectory(prefix="ina-test-") as out:
        rank = [sys.executable, *rank_args(case, params, out)]
        cmd = mpiexec_line(mpiexec(), rank, n=n if namespaces is None else None,
                           namespaces=namespaces,
                           options=["-disable-auto-cleanup"] if survive_dead_ranks else [])
        returncode, output = run_group(cmd, child_env(env), timeout, ROOT)
        if returncode is None:
            raise JobFailed(f"{name} on {n} ranks did not finish in {timeout:g} s:\n{output}")
        results = []
        for rank in range(n):
            path = Path(out, f"rank{rank}.pkl")
            if not path.exists():
                if survive_dead_ranks:
                    results.append({"dead": True, "output": output})
                    continue
                raise JobFailed(f"{name}: rank {rank} left no result (exit {returncode}):"
                                f"\n{output}")
            results.append(pickle.loads(path.read_bytes()))
        if returncode != 0 and not survive_dead_ranks and not any(
                isinstance(r, dict) and r.get("abandoned") for r in results):
            raise JobFailed(f"{name}: mpiexec exited {returncode}:\n{output}")
        return results


def cases(*entries: tuple) -> dict[str, Any]:
    """The params of ``several`` for one job that runs several rank functions in turn:
    each entry ``(name, function, params[, env])``; ``env``: INA_* (or other) variables
    set while that function runs, as its own job would have had them. A function whose
    result says ``abandoned`` (it left messages posted) must come last."""
    listed = []
    for name, case, params, *env in entries:
        module, qualname = rank_path(case)
        listed.append([name, module, qualname, params or {}, env[0] if env else {}])
    names = [entry[0] for entry in listed]
    if len(set(names)) != len(names):
        raise ValueError(f"two cases of one job share a name: {names}")
    return {"cases": listed}


def several(comm: Any, params: dict) -> dict[str, Any]:
    """The rank function of one job that runs several (``cases``): each in turn, its
    environment set as its entry says (and put back after), its result (or its error and
    traceback) under its name. After a case that raised, the ranks may disagree on where
    they are: the cases after it are not run, and say so under their names."""
    out: dict[str, Any] = {}
    failed = None
    for name, module, qualname, case_params, env in params["cases"]:
        if failed is not None:
            out[name] = {"error": "NotRun", "message": f"not run: case {failed!r} of the "
                         f"same job raised before it", "types": ["NotRun"]}
            continue
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            out[name] = _find(module, qualname)(comm, case_params)
        except BaseException as exc:
            out[name] = error(exc) | {"traceback": traceback.format_exc()}
            failed = name
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    if any(isinstance(r, dict) and r.get("abandoned") for r in out.values()):
        out["abandoned"] = True
    return out


def case_result(result: dict[str, Any], name: str, rank: int | None = None) -> Any:
    """Case ``name``'s result in one rank's result of ``several``: an AssertionError that
    names the case (and rank) if it raised or was not run."""
    got = result[name]
    if isinstance(got, dict) and "traceback" in got or (
            isinstance(got, dict) and got.get("error") == "NotRun"):
        where = f" on rank {rank}" if rank is not None else ""
        raise AssertionError(f"case {name!r}{where} failed: {got.get('message')}\n"
                             f"{got.get('traceback', '')}")
    return got


class TorchrunRank:
    """What the rank functions use of an MPI communicator, for ranks torchrun started."""

    def __init__(self) -> None:
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def main(argv: Sequence[str] | None = None) -> None:
    """One rank (``rank_args``): the function's result, or its error and traceback,
    pickled to OUTDIR/rank<r>.pkl. Its communicator: MPI.COMM_WORLD, or under torchrun
    a ``TorchrunRank``."""
    args = list(sys.argv[1:] if argv is None else argv)
    torchrun = args[:1] == ["--torchrun"]
    module, qualname, params_text, outdir_text = args[1:] if torchrun else args
    params, outdir = json.loads(params_text), Path(outdir_text)
    if torchrun:
        comm: Any = TorchrunRank()
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    try:
        result = _find(module, qualname)(comm, params)
    except BaseException as exc:
        result = error(exc) | {"traceback": traceback.format_exc()}
    tmp = outdir / f".rank{comm.rank}.pkl"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(outdir / f"rank{comm.rank}.pkl")
    if isinstance(result, dict) and result.get("abandoned"):
        # Messages of the timed-out call are still posted: MPI_Finalize could wait on them
        # forever, so leave without it, but only once every rank has left its result (the
        # launcher kills a job whose rank exits without finalizing).
        deadline = time.monotonic() + 60
        expected = result.get("ranks_alive", comm.size)
        while (time.monotonic() < deadline and
               len(list(outdir.glob("rank*.pkl"))) < expected):
            time.sleep(0.05)
        sys.stdout.flush()
        if result.get("kill"):
            os.kill(result["kill"], 9)
        os._exit(0)


if __name__ == "__main__":
    main()
