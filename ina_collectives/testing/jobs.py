"""The launcher the tests and the benchmarks share: a job in a process group of its own
with a bound, mpiexec's command line, and the environment a child is given.

    env = child_env({"INA_SWITCH": "127.0.0.1:47474"})
    code, output = run_group(mpiexec_line(find_mpiexec(), command, n=2), env, limit=120)

A child imports this checkout (``ROOT``, first on PYTHONPATH) and gets only the INA_*
settings its caller names: a test's job does not inherit the settings of the shell that
runs the suite, unless asked (``keep_settings``, as a benchmark that passes the user's on).
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

# The checkout this package is imported from (with an editable install, the repository:
# bench/ and tests/ sit there beside ina_collectives/).
ROOT = Path(__file__).resolve().parents[2]


def child_env(env: Mapping[str, str] | None = None, *, keep_settings: bool = False,
              root: str | os.PathLike = ROOT) -> dict[str, str]:
    """This process's environment for a child: ``root`` first on PYTHONPATH, the INA_*
    settings left out unless ``keep_settings``, then ``env`` over it."""
    full = {k: v for k, v in os.environ.items()
            if keep_settings or not k.startswith("INA_")}
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), full.get("PYTHONPATH", "")) if p)
    full.update(env or {})
    return full


def mpiexec_line(mpiexec: str, command: Sequence[str], n: int | None = None,
                 namespaces: Sequence[str] | None = None,
                 options: Sequence[str] = ()) -> list[str]:
    """mpiexec running ``command`` on ``n`` ranks; or, with ``namespaces``, one rank per
    namespace (rank r in network namespace ``namespaces[r]``, an MPMD line of
    ``ip netns exec``). ``options`` go to mpiexec itself."""
    if (n is None) == (namespaces is None):
        raise ValueError("give the ranks either as n or as namespaces, not both")
    if n is not None and n < 1 or namespaces is not None and not namespaces:
        raise ValueError(f"a job needs a rank at least, got n={n} namespaces={namespaces}")
    line = [str(mpiexec), *options]
    if namespaces is None:
        return line + ["-n", str(n), *command]
    for r, ns in enumerate(namespaces):
        line += [*([":"] if r else []), "-n", "1", "ip", "netns", "exec", ns, *command]
    return line


STACKS_SECONDS = 2.0  # for the ranks' stacks to reach the output, before the kill


def descendants(root: int) -> list[int]:
    """The processes below ``root`` (its children, theirs ...), as /proc shows them now:
    Hydra puts its proxy and each rank in a session of its own."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def ask_for_stacks(root: int) -> int:
    """SIGUSR2 to each Python process below ``root`` (a job's ranks: their answer is what
    they wait for and their stacks); how many were asked."""
    asked = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0", 1)[0])
            if program.startswith(b"python"):
                os.kill(pid, signal.SIGUSR2)
                asked += 1
        except (OSError, ProcessLookupError):
            continue
    return asked


def run_group(command: Sequence[str], env: Mapping[str, str], limit: float,
              cwd: str | os.PathLike = ROOT) -> tuple[int | None, str]:
    """``command`` (mpiexec and its ranks, say) in a session of its own, its output
    merged: (exit code, output), or (None, output) past ``limit`` seconds, when its whole
    process group is killed (the ranks too, not only mpiexec); the same on Ctrl-C."""
    if not limit > 0:
        raise ValueError(f"a job's limit must be a positive number of seconds, got {limit}")
    proc = subprocess.Popen(list(command), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # Where each rank is stuck (its waits and stacks, collectives/waiting.py) before
        # the kill: SIGUSR2 to the job's Python processes (not to mpiexec's own).
        if ask_for_stacks(proc.pid):
            try:
                proc.wait(STACKS_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    finally:
        if proc.poll() is None:  # (Ctrl-C while it ran: take the job down too)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output
