"""The ranks of an ``ina-run`` job: started under mpiexec (each through ``rank.py``, which
records its pid and how it ended) or torchrun, supervised, and stopped within a bound
when one fails (``cli.py`` has the whole story in its docstring)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..errors import LaunchError
from ..settings import env_name
from .rank import INTERRUPTED


def find_mpiexec() -> str:
    """The mpiexec of the MPI that mpi4py uses (the mpich package puts it beside python)."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise LaunchError("no mpiexec beside the interpreter or on PATH: install MPICH's "
                          "wheel (pip install 'ina-collectives[mpich]') or put your MPI's "
                          "mpiexec on PATH")
    return found


# After the first rank fails: how long the others get to end by themselves (their waits
# raise at once, naming the failed rank), then SIGTERM, then SIGKILL STOP_KILL_AFTER later.
GRACE_SECONDS = 5.0
# Once the grace ran out: SIGUSR2 first (each rank prints what it waits for and its
# stacks: collectives/waiting.py), then SIGTERM this much later.
DUMP_SECONDS = 1.0
STOP_KILL_AFTER = 3.0
RANK_WRAPPER = Path(__file__).resolve().parent / "rank.py"


def describe_exit(rank: int, pid: Any, returncode: int) -> str:
    """``rank 1 (pid 1234) was killed by signal 9 (SIGKILL)`` or ``... exited with code 3``."""
    who = f"rank {rank}" + (f" (pid {pid})" if pid else "")
    if returncode < 0:
        try:
            name = f" ({signal.Signals(-returncode).name})"
        except ValueError:
            name = ""
        return f"{who} was killed by signal {-returncode}{name}"
    return f"{who} exited with code {returncode}"


def exit_code_of(returncode: int) -> int:
    """A rank's end as a shell reports it: its code, or 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


class RankWatch:
    """The ranks' pid, exit and raise records in a temporary folder (written by rank.py,
    which starts each rank, and by a Python rank's record_raises), and the marks ina-run
    leaves there: that a rank failed, which the survivors' bounded waits read
    (collectives/waiting.py), and that it passed a Ctrl-C on (rank.INTERRUPTED)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _records(self, suffix: str) -> dict[int, dict[str, Any]]:
        found = {}
        for path in self.folder.glob(f"rank*{suffix}"):
            try:
                record = json.loads(path.read_text())
                found[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written (it is renamed into place) or foreign
        return found

    def exits(self) -> dict[int, dict[str, Any]]:
        return self._records(".exit")

    def raised(self) -> dict[int, dict[str, Any]]:
        """The ranks whose process an exception is ending (recorded as it was raised)."""
        return self._records(".raised")

    def first_failure(self) -> dict[str, Any] | None:
        """The record of the rank that failed first, by the moment it failed: a raise
        recorded as it happened, or else a non-zero exit. (A rank that raised may end
        long after: its MPI_Finalize waits for the ranks that fail because of it.)"""
        failed = [r for r in self.exits().values() if r.get("returncode")]
        failed += self.raised().values()
        return min(failed, key=lambda r: (r.get("at", 0.0), r["rank"])) if failed else None

    def not_started(self, np_: int) -> list[int]:
        """The ranks of 0 .. np_ - 1 with neither a pid nor an exit record yet."""
        seen = set(self._records(".pid")) | set(self.exits())
        return [r for r in range(np_) if r not in seen]

    def running(self) -> dict[int, dict[str, Any]]:
        """Ranks started and not reported ended: {rank: pid record}."""
        ended = self.exits()
        return {r: rec for r, rec in self._records(".pid").items() if r not in ended}

    def mark_failed(self, message: str) -> None:
        self._mark("failed", message)

    def mark_interrupted(self, signum: int) -> None:
        """Tell the ranks' raise records that ina-run passed ``signum`` on: a
        KeyboardInterrupt then ends a rank without its traceback (ina-run says where)."""
        self._mark(INTERRUPTED, signal.Signals(signum).name)

    def _mark(self, name: str, text: str) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.folder / name)

    def answers_stacks(self, rank: int) -> bool:
        """Whether the rank's library installed its SIGUSR2 dump (rank<r>.stacks)."""
        return (self.folder / f"rank{rank}.stacks").exists()

    def signal_running(self, signum: int, ranks: Iterable[int] | None = None) -> list[int]:
        """Send ``signum`` to each running rank (of ``ranks``, if given); the ranks
        signalled. SIGKILL goes to the rank's process group (the rank and whatever it
        started) and its wrapper; other signals to the wrapper, which passes them on
        once (to the group if it is gone)."""
        hit = []
        chosen = None if ranks is None else set(ranks)
        for rank, record in sorted(self.running().items()):
            if chosen is not None and rank not in chosen:
                continue
            targets = [(record.get("wrapper"), os.kill), (record.get("pid"), os.killpg)]
            for target, send in targets:
                if not (isinstance(target, int) and target > 1):
                    continue
                try:
                    send(target, signum)
                except (ProcessLookupError, PermissionError):
                    continue
                hit.append(rank)
                if signum != signal.SIGKILL:
                    break
        return sorted(set(hit))

    def endings(self) -> list[str]:
        """One line per rank of this machine on how it ended, after an interrupt: where
        a KeyboardInterrupt stopped it, or its exit."""
        exits, raised = self.exits(), self.raised()
        lines = []
        for rank in sorted(set(exits) | set(raised) | set(self._records(".pid"))):
            record = raised.get(rank)
            if record is not None and record.get("raised") == "KeyboardInterrupt":
                lines.append(f"rank {rank} (pid {record.get('pid')}) stopped by Ctrl-C"
                             + (f" at {record['where']}" if record.get("where") else ""))
            elif rank in exits:
                lines.append(describe_exit(rank, exits[rank].get("pid"),
                                           exits[rank]["returncode"]))
        return lines


def describe_failure(record: dict[str, Any]) -> str:
    """A failure record in words: a raise (``rank 1 (pid 1234) raised ValueError: ...
    at train.py:12 in step``) or an exit (describe_exit)."""
    if "raised" in record:
        who = f"rank {record['rank']}" + (f" (pid {record['pid']})" if record.get("pid")
                                           else "")
        return (f"{who} raised {record['raised']}"
                + (f" at {record['where']}" if record.get("where") else ""))
    return describe_exit(record["rank"], record.get("pid"), record["returncode"])


# The signals ina-run passes on to the ranks (Ctrl-C, kill, a closed terminal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The prefix of a command that runs it in a session of its own and ends it (SIGTERM) if
# ina-run dies. A terminal's Ctrl-C is a SIGINT to its foreground process group: it then
# reaches ina-run alone, which passes it on in order (the ranks; the job's teardown on
# the switch; the switch), where mpiexec's proxies and the embedded switch would each
# die of it midway (Hydra's "assert (!closed) failed", a teardown refused).
_DETACH = ("import ctypes, os, signal, sys; os.setsid(); "
           "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0); "
           "os.getppid() == int(sys.argv[1]) or os._exit(128 + signal.SIGTERM); "
           "os.execvp(sys.argv[2], sys.argv[2:])")


def detached() -> list[str]:
    """The prefix that runs a command (appended to it) detached from ina-run's terminal
    and bound to ina-run's life (see _DETACH); it execs the command: same pid."""
    return [sys.executable, "-I", "-S", "-c", _DETACH, str(os.getpid())]


def run_ranks(np_: int, command: Sequence[str], env: dict[str, str],
              mpiexec: str | None = None, grace: float = GRACE_SECONDS, *,
              start_timeout: float | None = None, verbose: bool = False,
              hosts: Sequence[str] = (), prefix: bool = True) -> int:
    """mpiexec -n np_ COMMAND, each rank started through rank.py, which
    records its pid and how it ended. Returns the job's exit code.

    Hydra runs with -disable-auto-cleanup: ina-run does the cleanup itself, so that it
    knows which rank failed first. When a rank fails (an exception that ends it, a
    non-zero exit or a signal), ina-run names the first, tells the others' bounded waits
    (they raise CollectiveTimeout naming it), gives them ``grace`` seconds to end, then
    sends SIGTERM to those still running and SIGKILL STOP_KILL_AFTER seconds later; the
    exit code is the failed rank's (1 for an exception, 128 + N for signal N).

    mpiexec runs in a session of its own (detached), so a Ctrl-C, SIGTERM or SIGHUP
    reaches ina-run alone, which passes it to each rank once (through mpiexec where
    ranks run on other hosts), with the same bounds; a second one stops them at once.
    Then it says in one line per rank how each ended (a KeyboardInterrupt: where).

    ``start_timeout`` (seconds, default unbounded): every rank must have started by
    then; if not, ina-run names the ranks missing, stops the job (SIGTERM, then SIGKILL
    STOP_KILL_AFTER later) and returns 2. ``verbose`` prints the mpiexec command.
    ``hosts``: mpiexec's options placing the ranks on other hosts (cli.hydra_hosts); the
    launching machine's address among them (-localhost) is torch's MASTER_ADDR then.
    ``prefix``: each line of a rank's output starts with ``[rank] `` (rank.py)."""
    launcher = mpiexec or find_mpiexec()
    with tempfile.TemporaryDirectory(prefix="ina-run-ranks-") as folder:
        watch = RankWatch(Path(folder))
        env = dict(env, **{env_name("run_dir"): folder})
        if "MASTER_PORT" not in env:  # torch.distributed's env:// rendezvous, rank 0's host
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                here = (hosts[list(hosts).index("-localhost") + 1] if "-localhost" in hosts
                        else "127.0.0.1")
                env.update(MASTER_ADDR=here, MASTER_PORT=str(s.getsockname()[1]))
        line = [launcher, "-disable-auto-cleanup", *hosts, "-n", str(np_), sys.executable,
                str(RANK_WRAPPER), *(["--prefix"] if prefix else []), folder, *command]
        if verbose:
            say(f"mpiexec command: {shlex.join(line)}")
        start_by = None if start_timeout is None else time.monotonic() + start_timeout
        received: list[int] = []

        def note(signum: int, _frame: object) -> None:
            received.append(signum)  # (acted on by _supervise, within its 50 ms tick)

        previous = {s: signal.signal(s, note) for s in STOP_SIGNALS}
        process = None
        try:
            process = subprocess.Popen([*detached(), *line], env=env)
            return _supervise(process, watch, grace, received, np_, start_by,
                              remote=bool(hosts))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            watch.signal_running(signal.SIGKILL)  # none should be left; none may be


def _signal_ranks(watch: RankWatch, signum: int) -> None:
    """Send ``signum`` to the ranks still running, saying which."""
    hit = watch.signal_running(signum)
    if hit:
        print(f"ina-run: sent {signal.Signals(signum).name} to rank(s) "
              f"{', '.join(map(str, hit))}", file=sys.stderr, flush=True)


def _supervise(process: subprocess.Popen, watch: RankWatch, grace: float,
               received: list[int], np_: int = 0, start_by: float | None = None,
               remote: bool = False) -> int:
    failure: dict[str, Any] | None = None
    stop_at: float | None = None  # when the ranks still running get SIGTERM
    stage = 0  # 0 running, 1 grace, 2 SIGTERM sent, 3 SIGKILL sent
    late_start = False  # some rank had not started by start_by
    handled = 0  # how many of the signals received were acted on
    passed: set[int] = set()  # the ranks the first signal was passed to
    dumped = False  # SIGUSR2 sent: the ranks' stacks, before SIGTERM
    while True:
        try:
            code = process.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            code = None
        now = time.monotonic()
        if len(received) > handled:
            if handled == 0:
                signum = received[0]
                watch.mark_interrupted(signum)
                if remote and code is None:  # Hydra passes it to every host's ranks
                    process.send_signal(signum)
                name = signal.Signals(signum).name
                print(f"ina-run: {name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}: "
                      f"passed to the ranks; they get {grace:g} s to end, then SIGTERM "
                      f"(again: at once)", file=sys.stderr, flush=True)
                if stage == 0:
                    stage, stop_at = 1, now + grace
            elif stage in (1, 2):  # again: no more waiting
                stop_at, dumped = now, True
            handled = len(received)
        if received and not remote and stage == 1:  # to each rank once, as they start
            fresh = [r for r in watch.running() if r not in passed]
            if fresh:
                watch.signal_running(received[0], fresh)
                passed.update(fresh)
        if start_by is not None and stage == 0:
            missing = watch.not_started(np_)
            if not missing:
                start_by = None
            elif now >= start_by:
                # A rank that never started leaves no grace to wait out: stop them all.
                late_start, start_by = True, None
                message = (f"ina-run: rank(s) {', '.join(map(str, missing))} of {np_} did "
                           f"not start within the start timeout; stopping the job")
                watch.mark_failed(message)
                print(message, file=sys.stderr, flush=True)
                _signal_ranks(watch, signal.SIGTERM)
                if code is None:
                    process.send_signal(signal.SIGTERM)  # mpiexec, still starting ranks
                stage, stop_at = 2, now + STOP_KILL_AFTER
        if failure is None and not received and not late_start:
            failure = watch.first_failure()
            if failure is not None:
                what = describe_failure(failure)
                watch.mark_failed(f"ina-run: {what}")
                others = sorted(r for r in watch.running() if r != failure["rank"])
                print(f"ina-run: {what}" + (
                    f"; the other ranks ({', '.join(map(str, others))}) get {grace:g} s to "
                    f"end, then SIGTERM" if others else ""), file=sys.stderr, flush=True)
                if stage == 0:
                    stage, stop_at = 1, now + grace
        if code is not None:
            break
        if stage == 1 and not dumped and stop_at is not None and now >= stop_at:
            # The grace ran out: where each rank still running is stuck, then SIGTERM.
            dumped = True
            asked = [r for r in watch.running() if watch.answers_stacks(r)]
            if asked and watch.signal_running(signal.SIGUSR2, asked):
                print("ina-run: the ranks still running were asked for their stacks "
                      "(SIGUSR2); SIGTERM follows", file=sys.stderr, flush=True)
                stop_at = now + DUMP_SECONDS
                continue
        if stage in (1, 2) and stop_at is not None and now >= stop_at:
            _signal_ranks(watch, signal.SIGTERM if stage == 1 else signal.SIGKILL)
            stage, stop_at = stage + 1, now + STOP_KILL_AFTER
        elif stage == 3 and stop_at is not None and now >= stop_at:
            process.kill()  # the launcher itself did not end with its ranks
            stop_at = None
    if received:
        for line in watch.endings():
            print(f"ina-run: {line}", file=sys.stderr, flush=True)
        return 128 + received[0]
    if late_start:
        return 2
    if failure is not None:
        return exit_code_of(failure["returncode"])
    if code != 0:  # the launcher failed without a rank's record (or a rank elsewhere)
        late = watch.first_failure()
        if late is not None:
            print(f"ina-run: {describe_failure(late)}", file=sys.stderr, flush=True)
            return exit_code_of(late["returncode"])
    return code


def say(text: str) -> None:
    print(f"ina-run: {text}", file=sys.stderr, flush=True)


_RANK_LINE = re.compile(rb"^\[\d+\] ")


def _torchrun_errors(stream: Any, received: list[int],
                     failed: Callable[[], bool] = lambda: False) -> None:
    """torchrun's standard error, passed on line by line, whole. Once ina-run has passed
    a Ctrl-C (or SIGTERM, SIGHUP) on, or once a rank has failed (``failed``), torchrun's
    own lines are left out: its agent's log of the signal or of the failure, and its
    SignalException or ChildFailedError block. The ranks' lines, which carry their
    ``[r] `` prefix, still pass, and ina-run says in one line how the job ended."""
    for raw in iter(stream.readline, b""):
        if (received or failed()) and not _RANK_LINE.match(raw):
            continue
        sys.stderr.write(raw.decode(errors="replace"))
        sys.stderr.flush()
    stream.close()


def run_torchrun(np_: int, command: Sequence[str], env: dict[str, str], *,
                 verbose: bool = False, prefix: bool = True) -> int:
    """torchrun --nproc-per-node np_ COMMAND on this machine: the ranks are torch's, not
    MPI's (backend "ina" then reaches its peers through gloo groups over torch's store).
    torchrun supervises them: one failing ends the others. Each rank starts through
    rank.py, as under mpiexec (``prefix``: ``[rank] `` before each line of its output).
    torchrun runs detached from the terminal: a Ctrl-C, SIGTERM or SIGHUP reaches it
    once, from ina-run. Returns torchrun's exit code."""
    with socket.socket() as s:  # the rendezvous port: free now, torchrun binds it next
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ina-run-ranks-") as folder:
        watch = RankWatch(Path(folder))
        env = dict(env, **{env_name("run_dir"): folder})
        line = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np_),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python",
                sys.executable, str(RANK_WRAPPER), *(["--prefix"] if prefix else []),
                folder, *command]
        if verbose:
            say(f"torchrun command: {shlex.join(line)}")
        received: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            if not received:
                watch.mark_interrupted(signum)
            received.append(signum)
            if process.poll() is None:
                process.send_signal(signum)

        # (with the ranks' prefixes, torchrun's standard error passes through a thread
        # that tells its own lines from the ranks': see _torchrun_errors)
        process = subprocess.Popen([*detached(), *line], env=env,
                                   stderr=subprocess.PIPE if prefix else None)
        relay = None
        if prefix:
            relay = threading.Thread(
                target=_torchrun_errors,
                args=(process.stderr, received, lambda: watch.first_failure() is not None),
                name="torchrun stderr", daemon=True)
            relay.start()
        previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
        try:
            code = process.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if process.poll() is None:
                process.kill()
                process.wait()
            if relay is not None:
                relay.join(5)
        if received:
            for ending in watch.endings():
                say(ending)
            return 128 + received[0]
        failure = watch.first_failure() if code else None
        if failure is not None:  # (torchrun's own account of it left out: _torchrun_errors)
            say(f"{describe_failure(failure)}; torchrun stopped the other ranks")
        return code
