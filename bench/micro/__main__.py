"""Run the microbenchmarks: ``python -m bench.micro [-n N] [FILE ...] [PYTEST ARGS ...]``.

Without a file, every ``test_*.py`` of bench/micro/; without ``-n``, each at every rank
count its module declares (``RANKS = (2, 4)``, read from its source). One rank runs
pytest alone; several run it under mpiexec, with the embedded software switch started
(unless INA_SWITCH is set) so that the "ina" rows go through it. Every rank runs pytest
with the same fixed rounds (benchmark.pedantic), so the ranks stay in step; rank 0 prints
the table and writes --benchmark-json (default bench/results/<name>-<n>.json, or
<name>.json for a one-rank module; <name> the file's without ``test_``).

    python -m bench.micro                                # all of them (make bench)
    python -m bench.micro -n 2 bench/micro/test_call_cost.py
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import subprocess
import sys
from pathlib import Path

from bench import RESULTS
from ina_collectives.testing.jobs import ROOT, child_env, mpiexec_line

HERE = Path(__file__).resolve().parent


def declared_ranks(path: Path) -> tuple[int, ...]:
    """The module's ``RANKS``: a tuple of rank counts, read from its source."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "RANKS"):
            ranks = ast.literal_eval(node.value)
            if (isinstance(ranks, tuple) and ranks
                    and all(isinstance(r, int) and 1 <= r <= 64 for r in ranks)):
                return ranks
            break
    raise ValueError(f"{path} declares no RANKS = (n, ...) of 1..64 ranks")


def run(path: Path, n: int, pytest_args: list[str]) -> int:
    """pytest on ``path`` at ``n`` ranks; its exit code."""
    args = list(pytest_args)
    if not any(a.startswith("--benchmark-json") for a in args):
        RESULTS.mkdir(exist_ok=True)
        name = path.stem.removeprefix("test_")
        args.append(f"--benchmark-json={RESULTS / (name if n == 1 else f'{name}-{n}')}.json")
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(path), *args]
    with contextlib.ExitStack() as stack:
        env = child_env(keep_settings=True)
        if n == 1:
            return subprocess.call(pytest, cwd=ROOT, env=env)
        if not env.get("INA_SWITCH"):
            from ina_collectives.switch.embedded import embedded_switch

            env["INA_SWITCH"] = stack.enter_context(embedded_switch()).address_text
        from ina_collectives.launch.ranks import find_mpiexec

        return subprocess.call(mpiexec_line(find_mpiexec(), pytest, n=n), cwd=ROOT, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, help="ranks (default: each count the module "
                        "declares in RANKS)")
    args, rest = parser.parse_known_args(argv)
    if args.n is not None and not 1 <= args.n <= 64:
        parser.error(f"-n must be 1..64, got {args.n}")
    files = [Path(a) for a in rest if a.endswith(".py")]
    pytest_args = [a for a in rest if not a.endswith(".py")]
    if any(not f.is_file() for f in files):
        parser.error(f"no such file: {', '.join(str(f) for f in files if not f.is_file())}")
    try:
        plan = [(f.resolve(), n) for f in (files or sorted(HERE.glob("test_*.py")))
                for n in ((args.n,) if args.n else declared_ranks(f))]
    except ValueError as e:
        parser.error(str(e))
    if len(plan) > 1 and any(a.startswith("--benchmark-json") for a in pytest_args):
        parser.error("--benchmark-json names one file: give one module and -n")
    failed = [f"{path.name} at {n}" for path, n in plan if run(path, n, pytest_args) != 0]
    if failed:
        print(f"bench.micro: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
