"""What ina-run starts as each rank: ``python rank.py DIR COMMAND...``.

It runs COMMAND as its child and writes the child's exit to ``DIR/rank<r>.exit`` (JSON:
rank, pid, returncode as subprocess gives it, negative for a signal, and the wall-clock
time), so that ina-run can say which rank failed first and how; ``DIR/rank<r>.pid``
holds the child's pid (and process group) while it runs. Then it exits with the child's
code, or 128 + N if signal N killed it.

The child gets everything the launcher gave this process (environment, file
descriptors: the PMI connection is one), runs in its own process group, and dies with
this process (PR_SET_PDEATHSIG), so a launcher that kills this process leaves no
orphan. The signals a launcher forwards (SIGINT, SIGTERM, ...) are passed to the child
once. If DIR cannot be written (a rank on another host), the command runs unreported.

Run by path, not as ``-m``: it imports nothing but the standard library (importing the
package would cost each rank NumPy's import time before the command even starts).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Hydra run with -disable-auto-cleanup sends SIGUSR1 to the processes it started when a
# rank ends without MPI_Finalize (tests end ranks with os._exit(0)): passed on, it would
# kill healthy ranks (Python's default action); ina-run's own watch handles failures.
IGNORED = (signal.SIGUSR1,)
PR_SET_PDEATHSIG = 1


def rank_of(environ: os._Environ[str] | dict[str, str]) -> int:
    """The rank the launcher gave this process (Hydra: PMI_RANK; PMIx; Open MPI)."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return -1


def torch_environment(environ: os._Environ[str] | dict[str, str], rank: int
                      ) -> dict[str, str]:
    """The launcher's environment plus torch.distributed's env:// variables (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; ina-run sets MASTER_ADDR and MASTER_PORT),
    so that init_process_group("ina") works unchanged in an MPI rank. Set ones stay."""
    env = dict(environ)
    size = next((environ[v] for v in ("PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE")
                 if environ.get(v, "").isdigit()), None)
    if size is None or rank < 0:
        return env
    # The rank among its host's (Hydra: MPI_LOCALRANKID; all on this machine otherwise).
    local = environ.get("MPI_LOCALRANKID", "")
    local_size = environ.get("MPI_LOCALNRANKS", "")
    for name, value in (("RANK", rank), ("WORLD_SIZE", size),
                        ("LOCAL_RANK", local if local.isdigit() else rank),
                        ("LOCAL_WORLD_SIZE", local_size if local_size.isdigit() else size)):
        env.setdefault(name, str(value))
    return env


def _write(path: str, record: dict) -> None:
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # DIR is not here (another host) or gone: the run goes on unreported


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL when this wrapper dies, even by SIGKILL; the
    signals this wrapper ignores back to their defaults."""
    for s in IGNORED:
        signal.signal(s, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the wrapper died before prctl took effect
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: rank.py DIR COMMAND...", file=sys.stderr)
        return 2
    folder, command = argv[0], argv[1:]
    rank = rank_of(os.environ)
    base = os.path.join(folder, f"rank{rank}")
    me = os.getpid()
    # Signals that arrive before the child exists are held back and passed on after.
    pending: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)
        elif child.poll() is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    for s in FORWARDED:
        signal.signal(s, forward)
    for s in IGNORED:
        signal.signal(s, signal.SIG_IGN)
    try:
        child = subprocess.Popen(command, close_fds=False, process_group=0,
                                 env=torch_environment(os.environ, rank),
                                 preexec_fn=lambda: _die_with_parent(me))
    except OSError as exc:
        print(f"ina-run: rank {rank}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        _write(base + ".exit", {"rank": rank, "pid": None, "returncode": 127,
                                "time": time.time(), "error": str(exc)})
        return 127
    _write(base + ".pid", {"rank": rank, "pid": child.pid, "wrapper": me})
    for signum in pending:
        forward(signum, None)
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    _write(base + ".exit", {"rank": rank, "pid": child.pid, "returncode": code,
                            "time": time.time()})
    # A signal becomes 128 + N, as a shell reports it: a rank that ends by a signal makes
    # Hydra kill the whole job at once, even with -disable-auto-cleanup, and ina-run
    # gives the others a grace period instead (the record above keeps the signal).
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
