"""What each rank starts as (launch/rank.py) and what ina-run reads of it: the rank's
output lines, whole and prefixed with its rank; an exception recorded as it is raised,
with where; the first failure chosen by the moment each rank failed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from ina_collectives.launch import rank as wrapper
from ina_collectives.launch.ranks import RankWatch, describe_failure


def _relayed(*pieces: bytes, pause: float = 0.0, hold: float = 5.0,
             interrupted=None) -> bytes:
    """What relay() writes for ``pieces`` written one by one into its pipe."""
    source_r, source_w = os.pipe()
    sink_r, sink_w = os.pipe()
    thread = threading.Thread(target=wrapper.relay,
                              args=(source_r, sink_w, b"[3] ", hold, interrupted))
    thread.start()
    for piece in pieces:
        os.write(source_w, piece)
        time.sleep(pause)
    os.close(source_w)
    thread.join(10)
    assert not thread.is_alive()
    os.close(sink_w)
    out = b""
    while chunk := os.read(sink_r, 1 << 16):
        out += chunk
    os.close(source_r)
    os.close(sink_r)
    return out


def test_each_line_gets_the_rank_and_lines_stay_whole():
    # A line written in pieces goes out whole, once its end came; \r ends a line too (a
    # progress bar's redraw keeps the prefix), and a \r\n cut between reads is one end.
    assert _relayed(b"one\ntw", b"o\nthree", b" still\n", pause=0.05) == \
        b"[3] one\n[3] two\n[3] three still\n"
    assert _relayed(b"10%\r20%\r", b"\n", pause=0.05) == b"[3] 10%\r[3] 20%\r\n"
    assert _relayed(b"a\r", b"\nb\n", pause=0.05) == b"[3] a\r\n[3] b\n"
    # An unfinished last line goes out at the end; one that waits longer than the hold
    # (a prompt) goes out as it stands, and its end follows without a second prefix.
    assert _relayed(b"x\nno end") == b"[3] x\n[3] no end"
    assert _relayed(b"Password: ", b"ok\nnext\n", pause=0.4, hold=0.1) == \
        b"[3] Password: ok\n[3] next\n"



STARTUP_TRACEBACK = (b"Traceback (most recent call last):\n"
                     b'  File "/home/u/train.py", line 2, in <module>\n'
                     b"    import torch\n"
                     b'  File "/venv/lib/python3.11/site-packages/torch/__init__.py", line 9\n'
                     b'  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load\n'
                     b"KeyboardInterrupt\n")


def test_a_ctrl_c_traceback_after_ina_run_passed_one_on_is_one_line():
    """A Ctrl-C during start-up (torch still importing, before the package's excepthook)
    reaches the rank's stderr as a traceback: after ina-run passed on a Ctrl-C it goes
    out as one line naming the program's line; other tracebacks, and any before a
    Ctrl-C, go out whole."""
    one = _relayed(b"starting\n", STARTUP_TRACEBACK, b"after\n", interrupted=lambda: True)
    assert one == (b"[3] starting\n[3] KeyboardInterrupt (ina-run passed on a Ctrl-C) at "
                   b"/home/u/train.py:2; its traceback left out\n[3] after\n"), one
    assert _relayed(STARTUP_TRACEBACK, interrupted=lambda: False) == b"".join(
        b"[3] " + line for line in STARTUP_TRACEBACK.splitlines(keepends=True))
    other = STARTUP_TRACEBACK.replace(b"KeyboardInterrupt", b"ValueError: bad")
    assert _relayed(other, interrupted=lambda: True) == b"".join(
        b"[3] " + line for line in other.splitlines(keepends=True))
    # (A traceback cut off by the end of the output goes out as far as it came.)
    cut = b"".join(STARTUP_TRACEBACK.splitlines(keepends=True)[:3])
    assert _relayed(cut, interrupted=lambda: True) == b"".join(
        b"[3] " + line for line in cut.splitlines(keepends=True))


def _rank_process(tmp_path, code: str, rank: int = 1, interrupted: bool = False
                  ) -> tuple[subprocess.CompletedProcess, dict]:
    """``code`` in a Python whose raises are recorded in tmp_path (as rank ``rank``
    under ina-run); its output and record."""
    if interrupted:
        (tmp_path / wrapper.INTERRUPTED).write_text("SIGINT")
    script = tmp_path / "job.py"
    # (Ctrl-C as at a terminal: a shell's background job starts with SIGINT ignored)
    script.write_text("import signal, sys\nfrom ina_collectives.launch.rank import "
                      "record_raises\nsignal.signal(signal.SIGINT, "
                      "signal.default_int_handler); record_raises(sys.argv[1])\n"
                      f"{code}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PMIX_RANK", "RANK")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=dict(env, PMI_RANK=str(rank)))
    path = tmp_path / f"rank{rank}.raised"
    return proc, json.loads(path.read_text()) if path.exists() else {}


def test_an_exception_that_ends_a_rank_is_recorded_as_it_is_raised(tmp_path):
    """The record (written before the exit's handlers, where MPI_Finalize would wait)
    names the exception and the program's own line; the traceback is printed as ever."""
    code = ("import atexit, time\natexit.register(time.sleep, 0.5)\n"
            "def step():\n    raise ValueError('bad batch\\nsecond line')\nstep()")
    before = time.monotonic()
    proc, record = _rank_process(tmp_path, code)
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr
    assert record["rank"] == 1 and record["returncode"] == 1, record
    assert record["raised"] == "ValueError: bad batch", record
    assert record["where"] == f"{tmp_path / 'job.py'}:7 in step", record
    assert before < record["at"] < time.monotonic() - 0.4  # before the atexit's 0.5 s
    assert describe_failure(record) == (f"rank 1 (pid {record['pid']}) raised ValueError: "
                                        f"bad batch at {tmp_path / 'job.py'}:7 in step")


def test_where_names_the_line_that_called_into_a_library(tmp_path):
    """An exception raised inside the standard library (or this package) is placed at the
    program's line that called it."""
    _, record = _rank_process(tmp_path, "import json\njson.loads('{')")
    assert record["raised"].startswith("JSONDecodeError: "), record
    assert record["where"] == f"{tmp_path / 'job.py'}:5 in <module>", record


def test_a_ctrl_c_passed_on_by_ina_run_ends_a_rank_without_its_traceback(tmp_path):
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGINT)"
    proc, record = _rank_process(tmp_path, code, rank=2, interrupted=True)
    assert proc.returncode == -2 and proc.stderr == "", proc.stderr
    assert record["raised"] == "KeyboardInterrupt" and record["returncode"] == 130, record
    # Not passed on by ina-run (a rank interrupted alone): the traceback stays.
    alone = tmp_path / "alone"
    alone.mkdir()
    proc, record = _rank_process(alone, code, rank=2)
    assert "KeyboardInterrupt" in proc.stderr and record["returncode"] == 130


def test_outside_ina_run_nothing_is_installed():
    assert wrapper.record_raises("") is False


def _record(folder, rank: int, suffix: str, **fields) -> None:
    (folder / f"rank{rank}{suffix}").write_text(json.dumps({"rank": rank, **fields}))


def test_the_first_failure_is_the_first_by_the_moment_it_happened(tmp_path):
    """Rank 1 raised first, but MPI_Finalize held its exit: ranks 0 and 2, which failed
    because of it, ended before it. ina-run names rank 1, by its raise's moment."""
    watch = RankWatch(tmp_path)
    for rank in range(3):
        _record(tmp_path, rank, ".pid", pid=100 + rank, wrapper=200 + rank)
    assert watch.first_failure() is None
    _record(tmp_path, 2, ".exit", pid=102, returncode=1, at=10.5)
    _record(tmp_path, 0, ".exit", pid=100, returncode=0, at=10.1)  # not a failure
    assert watch.first_failure()["rank"] == 2
    _record(tmp_path, 1, ".raised", pid=101, returncode=1, at=10.2, raised="OSError: x",
            where="train.py:3 in main")
    _record(tmp_path, 2, ".raised", pid=102, returncode=1, at=10.4,
            raised="CollectiveTimeout: gave up")
    first = watch.first_failure()
    assert first["rank"] == 1 and describe_failure(first) == (
        "rank 1 (pid 101) raised OSError: x at train.py:3 in main")
    assert sorted(watch.running()) == [1]
    # After a Ctrl-C: one line per rank, how each ended.
    _record(tmp_path, 1, ".raised", pid=101, returncode=130, at=11.0,
            raised="KeyboardInterrupt", where="train.py:9 in <module>")
    assert watch.endings() == ["rank 0 (pid 100) exited with code 0",
                               "rank 1 (pid 101) stopped by Ctrl-C at train.py:9 in <module>",
                               "rank 2 (pid 102) exited with code 1"]


@pytest.mark.parametrize("prefix", [True, False])
def test_the_wrapper_prefixes_its_ranks_output_unless_told_not_to(tmp_path, prefix):
    env = dict(os.environ, PMI_RANK="4")
    proc = subprocess.run(
        [sys.executable, str(wrapper.__file__), *(["--prefix"] if prefix else []),
         str(tmp_path), sys.executable, "-c",
         "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 3
    assert (proc.stdout, proc.stderr) == (("[4] out\n", "[4] err\n") if prefix
                                          else ("out\n", "err\n"))
    record = json.loads((tmp_path / "rank4.exit").read_text())
    assert record["returncode"] == 3 and record["at"] <= time.monotonic()
