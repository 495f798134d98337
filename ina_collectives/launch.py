"""``ina-run``: start (or reach) the aggregator, run the ranks with mpiexec, clean up.

    ina-run -np 4 -- python train.py                  # embedded software switch
    ina-run -np 4 --switch 10.0.0.1:47474 -- python train.py
    ina-run -np 4 --switch none -- python train.py    # ring only

The ranks find the aggregator through INA_SWITCH. The exit code is the job's; the
embedded switch is stopped whatever happens (errors, Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence


class LaunchError(RuntimeError):
    """ina-run cannot start the job: the launcher, the command or the switch is missing."""


def find_mpiexec() -> str:
    """The mpiexec of the MPI that mpi4py uses (the mpich package puts it beside python)."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise LaunchError("no mpiexec beside the interpreter or on PATH: pip install mpich "
                          "(or install ina-collectives, which depends on it)")
    return found


def run_ranks(np_: int, command: Sequence[str], env: dict[str, str],
              mpiexec: str | None = None) -> int:
    """mpiexec -n np_ COMMAND; Ctrl-C and SIGTERM are passed to the launcher, which stops
    the ranks. Returns the launcher's exit code."""
    launcher = mpiexec or find_mpiexec()
    process = subprocess.Popen([launcher, "-n", str(np_), *command], env=env)

    def forward(signum: int, _frame: object) -> None:
        if process.poll() is None:
            process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if process.poll() is None:
            process.kill()
            process.wait()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ina-run", description="Run an MPI job whose allreduces go through an "
        "in-network aggregator (by default an embedded software switch).")
    parser.add_argument("-np", "-n", dest="np", type=int, required=True,
                        help="number of ranks")
    parser.add_argument("--switch", default="embedded",
                        help="'embedded' (start a software switch on loopback), HOST:PORT "
                             "of a running aggregator, or 'none' (ring only)")
    parser.add_argument("--switch-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for the embedded ina-switch (repeatable), "
                             "e.g. --switch-arg=--drop-in=0.01")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program each rank runs (after an optional --)")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run: ina-run -np N -- python train.py")
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        mpiexec = find_mpiexec()
        env = dict(os.environ)
        if args.switch == "none":
            env["INA_SWITCH"] = ""
            return run_ranks(args.np, args.command, env, mpiexec)
        if args.switch != "embedded":
            from .transport import parse_address
            parse_address(args.switch)  # a clear error for a malformed address
            env["INA_SWITCH"] = args.switch
            return run_ranks(args.np, args.command, env, mpiexec)
        from .embedded import embedded_switch
        with embedded_switch(*args.switch_arg) as switch:
            env["INA_SWITCH"] = switch.address_text
            print(f"ina-run: embedded ina-switch on {switch.address_text}", file=sys.stderr,
                  flush=True)
            code = run_ranks(args.np, args.command, env, mpiexec)
            switch.stop()
            print(f"ina-run: {switch.final_status}", file=sys.stderr, flush=True)
            return code
    except (LaunchError, ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"ina-run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
