"""What ina-run starts as each rank: ``python rank.py [--prefix] DIR COMMAND...``.

It runs COMMAND as its child and writes the child's exit to ``DIR/rank<r>.exit`` (JSON:
rank, pid, returncode as subprocess gives it, negative for a signal, and ``at``, the
moment on this machine's monotonic clock), so that ina-run can say which rank failed
first and how; ``DIR/rank<r>.pid`` holds the child's pid (and process group) while it
runs. Then it exits with the child's code, or 128 + N if signal N killed it. A Python
rank that initialises ina_collectives also records an exception that ends it, at the
moment it is raised (``DIR/rank<r>.raised``: record_raises), before its exit, which
MPI's finalisation can hold up until the other ranks end.

With ``--prefix``, each line the child writes to stdout or stderr goes out as one write
with ``[r] `` before it (as ``mpiexec -prepend-rank`` would, but whole lines: Hydra's
prefixes each chunk it forwards, so two ranks' lines could mix mid-line). A line left
unfinished for HOLD_SECONDS (a prompt, a progress bar) goes out as it stands.

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
import re
import select
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from typing import Any, Callable

# (SIGUSR2: ina-run's ask, before it stops a rank for time, for what the rank waits for
# and its stacks: collectives/waiting.py, dump_on_signal.)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)
# Hydra run with -disable-auto-cleanup sends SIGUSR1 to the processes it started when a
# rank ends without MPI_Finalize (tests end ranks with os._exit(0)): passed on, it would
# kill healthy ranks (Python's default action); ina-run's own watch handles failures.
IGNORED = (signal.SIGUSR1,)
PR_SET_PDEATHSIG = 1
# How long the start of a line waits for its end before it goes out as it stands.
HOLD_SECONDS = 1.0
# After the child ended: how long its output may take to drain (a process it started
# may still hold the pipes).
DRAIN_SECONDS = 1.0
# ina-run writes it into DIR when it passes a Ctrl-C (or SIGTERM) on to the ranks.
INTERRUPTED = "interrupted"


def rank_of(environ: os._Environ[str] | dict[str, str]) -> int:
    """The rank the launcher gave this process (Hydra: PMI_RANK; PMIx; Open MPI;
    torchrun: RANK)."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
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


# -- a raise recorded when it happens (in the rank's own process) --------------------------

def where_raised(tb: Any, package: str) -> str:
    """``file:line in function`` of the innermost frame of ``tb`` in the program's own
    code: outside ``package`` (a folder), the standard library and installed packages,
    the line that called into them (where a Ctrl-C stopped a rank waiting in a call);
    else the innermost frame; '' without frames."""
    frames = traceback.extract_tb(tb)
    libraries = tuple(os.path.join(os.path.realpath(sysconfig.get_path(name)), "")
                      for name in ("stdlib", "platstdlib", "purelib", "platlib"))

    def own(filename: str, caller_own: bool) -> bool:
        if filename.endswith((".pyx", ".pxd", ".pxi")) or filename.startswith("<frozen"):
            return False  # a compiled module's source (_fast/x.pyx), the import system
        if not os.path.isabs(filename):  # python -c's <string>, an exec'd text: the
            return caller_own  # program's, unless a library called it (a dataclass's
            #                    generated __init__ is <string> too)
        path = os.path.realpath(filename)
        return not path.startswith((package, *libraries))

    owned, caller_own = [], True
    for f in frames:
        caller_own = own(f.filename, caller_own)
        if caller_own:
            owned.append(f)
    frame = (owned or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else ""


def record_raises(folder: str) -> bool:
    """Under ina-run (``folder``: the rank's run folder, INA_INTERNAL_RUN_DIR): an exception that
    ends this process is written to ``folder/rank<r>.raised`` as it reaches the top
    (sys.excepthook), before the exit's MPI_Finalize, which waits for the other ranks:
    ina-run then names the rank that raised first, not one that failed because of it.
    After a Ctrl-C that ina-run passed on (its INTERRUPTED mark in ``folder``), the
    KeyboardInterrupt's traceback is left out: ina-run says where each rank stopped, in
    one line. Installed once per process; whether it is installed now."""
    rank = rank_of(os.environ)
    previous = sys.excepthook
    if not folder or rank < 0 or getattr(previous, "ina_run_folder", None) == folder:
        return False
    me = os.getpid()
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if os.getpid() != me:  # a process this rank forked: not the rank
            previous(kind, value, tb)
            return
        interrupt = issubclass(kind, KeyboardInterrupt)
        text = str(value).strip().splitlines()
        _write(os.path.join(folder, f"rank{rank}.raised"), {
            "rank": rank, "pid": me, "returncode": 128 + signal.SIGINT if interrupt else 1,
            "at": time.monotonic(), "where": where_raised(tb, package),
            "raised": kind.__name__ + (f": {text[0][:200]}" if text else "")})
        if interrupt and os.path.exists(os.path.join(folder, INTERRUPTED)):
            return
        previous(kind, value, tb)

    hook.ina_run_folder = folder  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True


# -- the child's output, a rank prefix on each line ------------------------------------------

def _write_all(sink: int, data: bytes) -> bool:
    """Write all of ``data``; False once the sink is gone (its reader ended)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(sink, view):]
        except BrokenPipeError:
            return False
    return True


TRACEBACK = b"Traceback (most recent call last):"


class _Interrupted:
    """A filter of a rank's stderr lines: after ina-run passed on a Ctrl-C
    (``interrupted()``), a Python traceback that ends in KeyboardInterrupt (a Ctrl-C
    during start-up, before the package's excepthook, record_raises, is in) becomes one
    line saying where the program was; any other traceback goes out whole."""

    def __init__(self, interrupted: Callable[[], bool]):
        self.interrupted = interrupted
        self.block: list[bytes] | None = None  # a traceback's lines, held

    def lines(self, line: bytes) -> list[bytes]:
        """What goes out for ``line``: nothing while a traceback is held, then it."""
        if self.block is None:
            if line.rstrip(b"\r\n") != TRACEBACK or not self.interrupted():
                return [line]
            self.block = [line]
            return []
        if line[:1] in (b" ", b"\t"):
            self.block.append(line)
            return []
        block, self.block = self.block + [line], None
        if not line.startswith(b"KeyboardInterrupt"):
            return block
        return [b"KeyboardInterrupt (ina-run passed on a Ctrl-C) at " + _program_frame(block)
                + b"; its traceback left out\n"]

    def flush(self) -> list[bytes]:
        block, self.block = self.block or [], None
        return block


def _program_frame(block: list[bytes]) -> bytes:
    """The deepest frame of a traceback's lines in the program's own files (not the
    standard library's, a package's or frozen code), as file:line."""
    frames = [m.groups() for m in (re.match(rb'\s*File "([^"]+)", line (\d+)', line)
                                   for line in block) if m]
    stdlib = sysconfig.get_paths()["stdlib"].encode()
    own = [f for f in frames if not (f[0].startswith((b"<", stdlib))
                                     or b"site-packages" in f[0])]
    file, line = (own or frames or [(b"?", b"?")])[-1]
    return file + b":" + line


def relay(source: int, sink: int, prefix: bytes, hold: float = HOLD_SECONDS,
          interrupted: Callable[[], bool] | None = None) -> None:
    """Copy ``source`` to ``sink`` until end of file, ``prefix`` at the start of every
    line (ended by \\n or \\r: a progress bar's redraws keep it); the lines of each read
    in one write. The start of a line waits for its end up to ``hold`` seconds.
    ``interrupted``: a stderr's, whether ina-run passed on a Ctrl-C (_Interrupted)."""
    held = b""        # the start of a line, not ended yet
    at_start = True   # whether the next byte out starts a line
    alive = True      # whether the sink still takes output
    tracebacks = _Interrupted(interrupted) if interrupted is not None else None
    while True:
        ready, _, _ = select.select([source], [], [], hold if held else None)
        if not ready:  # a line unfinished for a while (a prompt): out as it stands
            alive = alive and _write_all(sink, (prefix if at_start else b"") + held)
            held, at_start = b"", False
            continue
        try:
            data = os.read(source, 1 << 16)
        except OSError:
            data = b""
        if not data:
            break
        text = held + data
        # The lines up to the last end of line (a \r last may be the first half of \r\n).
        body = text[:-1] if text.endswith(b"\r") else text
        end = max(body.rfind(b"\n"), body.rfind(b"\r")) + 1
        held = text[end:]
        if end and alive:
            lines = text[:end].splitlines(keepends=True)
            if tracebacks is not None and at_start:
                lines = [out for line in lines for out in tracebacks.lines(line)]
            if lines:
                alive = _write_all(sink, b"".join(
                    (prefix if i or at_start else b"") + line
                    for i, line in enumerate(lines)))
            at_start = True
    if tracebacks is not None and alive:
        for line in tracebacks.flush():
            alive = alive and _write_all(sink, prefix + line)
    if held and alive:
        _write_all(sink, (prefix if at_start else b"") + held)


def main(argv: list[str]) -> int:
    prefix = bool(argv) and argv[0] == "--prefix"
    argv = argv[1:] if prefix else argv
    if len(argv) < 2:
        print("usage: rank.py [--prefix] DIR COMMAND...", file=sys.stderr)
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
    pipes = subprocess.PIPE if prefix and rank >= 0 else None
    try:
        child = subprocess.Popen(command, close_fds=False, process_group=0,
                                 env=torch_environment(os.environ, rank),
                                 stdout=pipes, stderr=pipes,
                                 preexec_fn=lambda: _die_with_parent(me))
    except OSError as exc:
        print(f"ina-run: rank {rank}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        _write(base + ".exit", {"rank": rank, "pid": None, "returncode": 127,
                                "at": time.monotonic(), "error": str(exc)})
        return 127
    relays = []
    if pipes is not None:
        marked = os.path.join(folder, INTERRUPTED)
        for source, sink in ((child.stdout, 1), (child.stderr, 2)):
            assert source is not None
            relays.append(threading.Thread(target=relay, daemon=True, args=(
                source.fileno(), sink, f"[{rank}] ".encode(), HOLD_SECONDS,
                (lambda: os.path.exists(marked)) if sink == 2 else None)))
            relays[-1].start()
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
                            "at": time.monotonic()})
    drained_by = time.monotonic() + DRAIN_SECONDS
    for thread in relays:
        thread.join(max(0.0, drained_by - time.monotonic()))
    # A signal becomes 128 + N, as a shell reports it: a rank that ends by a signal makes
    # Hydra kill the whole job at once, even with -disable-auto-cleanup, and ina-run
    # gives the others a grace period instead (the record above keeps the signal).
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
