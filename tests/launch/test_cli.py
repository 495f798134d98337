"""ina-run: the job's exit code, the embedded switch's address in the ranks' environment,
clear errors for a missing command or a malformed switch address (a missing launcher:
tests/control/test_controller.py), MPI never initialised by the launcher itself, and a rank that
fails: named (the first, by the moment it failed), the others told and stopped within a
bound, no process left; the ranks' lines prefixed with their rank; a Ctrl-C to the
terminal's process group ending the job at once, one line per rank. horovodrun's
options: hosts on this machine only, the setting options as the ranks' variables, the
unsupported ones refused by name, --verbose, and --start-timeout's bounds. The small
things: --elements in every rank's environment, an exported INA_SWITCH overridden with a
word, a script torchrun would take, a command that cannot run."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ina_collectives.errors import LaunchError
from ina_collectives.launch import cli as launch
from ina_collectives.launch import horovodrun
from ina_collectives.launch.ranks import describe_exit, exit_code_of
from ina_collectives.switch.embedded import embedded_switch
from tests.conftest import ROOT, _child_env

PRINT_SWITCH = "import os; print('switch=' + os.environ.get('INA_SWITCH', '?'))"


@pytest.mark.mpi
def test_embedded_switch_address_reaches_every_rank_and_exit_code_is_the_jobs(ina_run):
    proc = ina_run("-np", "2", "--", sys.executable, "-c", PRINT_SWITCH)
    assert proc.returncode == 0, proc.stderr
    # The launcher may interleave the two ranks' lines: find the addresses, not lines.
    seen = re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)
    assert len(seen) == 2 and len(set(seen)) == 1, proc.stdout
    # Its closing line, in words (the counters with --verbose).
    assert re.search(r"ina-run: the switch at 127\.0\.0\.1:\d+ returned no results",
                     proc.stderr), proc.stderr
    failing = ina_run("-np", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert failing.returncode != 0


@pytest.mark.mpi
def test_switch_none_and_an_address(ina_run, closed_udp_port):
    none = ina_run("-np", "1", "--switch", "none", "--", sys.executable, "-c", PRINT_SWITCH)
    assert none.returncode == 0 and "switch=\n" in none.stdout + "\n", none.stdout
    with embedded_switch() as switch:
        given = ina_run("-np", "1", "--switch", switch.address_text, sys.executable, "-c",
                        PRINT_SWITCH)
    assert given.returncode == 0, given.stderr
    assert f"switch={switch.address_text}" in given.stdout
    # Nothing listens on a port a closed socket had: ina-run names the address, and that
    # nothing listens there (the port unreachable is heard, not waited out).
    dead = f"127.0.0.1:{closed_udp_port}"
    missing = ina_run("-np", "1", "--switch", dead, sys.executable, "-c", PRINT_SWITCH)
    assert f"no aggregator listens at {dead} (port unreachable)" in missing.stderr, \
        missing.stderr


@pytest.mark.mpi  # these end at the arguments, but through ina-run: marked like the others
@pytest.mark.parametrize("args, words", [
    (["-np", "2"], "no command to run"),
    (["-np", "0", "true"], "-np must be at least 1"),
    (["-np", "2", "--switch", "127.0.0.1:notaport", "true"], "is not a number"),
])
def test_clear_errors(ina_run, args, words):
    proc = ina_run(*args)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_ina_run_never_initialises_mpi_itself(run_python):
    """The launcher starts MPI jobs; it must not be one (importing mpi4py.MPI runs
    MPI_Init, which aborts where MPI's network settings do not apply). Run it with that
    import made to fail: the embedded switch, the controller and the ranks all work."""
    code = "import sys\nfrom ina_collectives.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = run_python(code, "-np", "2", "--", sys.executable, "-c", PRINT_SWITCH,
                      block=("mpi4py.MPI",), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)) == 2, proc.stdout


def test_importing_the_launcher_side_leaves_mpi_uninitialised(run_python):
    """What ina-run, ina-switch and the controller import never imports mpi4py.MPI (whose
    import initialises MPI): checked in a fresh interpreter, without a launcher."""
    proc = run_python(
        "import sys\n"
        "import ina_collectives, ina_collectives.launch.cli, ina_collectives.switch\n"
        "import ina_collectives.control\n"
        "print(sorted(m for m in sys.modules if m.startswith('mpi4py')))\n"
        "print('mpi4py.MPI' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False", proc.stdout


# A rank of three that ends itself after one allreduce through the switch; the others go
# on calling. {end} is how it ends. Each rank prints its pid first, for the orphan check.
DYING_RANK = """\
import os, signal, sys, time
import numpy as np
import ina_collectives as ina
ina.init()
print(f"pid={{os.getpid()}}", flush=True)
x = np.ones(300_000, np.float32)
ina.allreduce(x)
if ina.rank() == {rank}:
    {end}
start = time.monotonic()
try:
    while True:
        ina.allreduce(x)
except ina.CollectiveTimeout as exc:
    print(f"rank {{ina.rank()}} after {{time.monotonic() - start:.1f}} s: {{exc}}", flush=True)
    raise
"""


def _alive(pids: list[int]) -> list[str]:
    """``ps`` lines of those of ``pids`` still running (zombies count as gone)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-p", ",".join(map(str, pids))],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1:2] != ["Z"]]


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines()
            if marker in line and line.split()[1:2] != ["Z"]]


def test_a_rank_s_end_is_described_and_coded_as_a_shell_reports_it():
    """The words and the exit code ina-run gives for a failed rank: a code as it is, a
    signal as 128 + N with its name (the job below runs the signal's case end to end)."""
    assert describe_exit(1, 1234, 3) == "rank 1 (pid 1234) exited with code 3"
    assert describe_exit(2, None, -9) == "rank 2 was killed by signal 9 (SIGKILL)"
    assert describe_exit(0, 7, -99) == "rank 0 (pid 7) was killed by signal 99"
    assert [exit_code_of(c) for c in (3, -9, -15, 0)] == [3, 137, 143, 0]


# (Two jobs: a rank killed by a signal, and one that raises. A rank's exit code takes the
# signal's path through the rank wrapper, and its words and code are the test above.)
@pytest.mark.mpi
@pytest.mark.parametrize("end, words, code", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by signal 9 (SIGKILL)", 128 + 9),
    ("raise RuntimeError('on purpose')",
     "raised RuntimeError: on purpose at {script}:9 in <module>", 1),
])
def test_a_failed_rank_is_named_and_the_others_stop_within_the_bound(ina_run, tmp_path,
                                                                        end, words, code):
    """Rank 1 of 3 dies (SIGKILL), or raises, after an allreduce through the embedded
    switch: ina-run names it, the others raise CollectiveTimeout naming it at once (not
    after INA_TIMEOUT, 300 s here), are stopped within the grace period, and the job is
    removed from the switch; ina-run exits with 128 + 9, or Python's 1. The raising rank
    is named every time: it is recorded as it raises, where its exit waits in
    MPI_Finalize for the others, which end first (they used to be named, after 300 s).
    Each rank's lines carry its rank."""
    script = tmp_path / "rank.py"
    script.write_text(DYING_RANK.format(rank=1, end=end))
    start = time.monotonic()
    proc = ina_run("-np", "3", "--", sys.executable, str(script), timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == code, proc.stderr
    pid = re.search(r"ina-run: rank 1 \(pid (\d+)\) " + re.escape(words.format(script=script)),
                    proc.stderr)
    assert pid, proc.stderr
    assert len(re.findall(r"^ina-run: rank \d", proc.stderr, re.M)) == 1, proc.stderr
    for rank in range(3):  # each line of a rank's output starts with its rank
        assert f"[{rank}] pid=" in proc.stdout, proc.stdout
    if "raise" in end:
        assert "[1] RuntimeError: on purpose\n" in proc.stderr, proc.stderr
    # The others learn it from their bounded waits, named: well before INA_TIMEOUT.
    for rank in (0, 2):
        told = re.search(rf"rank {rank} after ([\d.]+) s: .*ina-run: rank 1 \(pid",
                         proc.stdout)
        assert told and float(told.group(1)) < 5, proc.stdout
    # The job is removed from the switch (its final status: no job left).
    assert re.search(r"ina-run: the switch at 127\.0\.0\.1:\d+ ", proc.stderr), proc.stderr
    assert "still installed" not in proc.stderr, proc.stderr
    assert took < 30, (took, proc.stderr)
    pids = [int(p) for p in re.findall(r"pid=(\d+)", proc.stdout)]
    assert len(pids) == 3 and int(pid.group(1)) in pids, proc.stdout
    assert not _alive(pids), _alive(pids)
    assert not _leftovers(str(script)), _leftovers(str(script))


LOOPING_RANK = """\
import numpy as np
import ina_collectives as ina
ina.init()
x = np.ones(300_000, np.float32)
ina.allreduce(x)
print(f"ready {ina.rank()}", flush=True)
while True:
    ina.allreduce(x)
"""


def _interrupted(args: list[str], ranks: int) -> tuple[int, str, float]:
    """ina-run ARGS in a process group of its own, as a terminal runs it; once its
    ``ranks`` ranks printed "ready", a Ctrl-C to the whole group: (exit code, output,
    seconds from the signal to the exit). Bounded: 90 s to start, 60 s to end."""
    proc = subprocess.Popen([sys.executable, "-m", "ina_collectives.launch", *args],
                            cwd=ROOT, env=_child_env(None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while sum("] ready " in line for line in lines) < ranks:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    return proc.returncode, "".join(lines), took


@pytest.mark.mpi
def test_ctrl_c_ends_the_job_at_once_with_one_line_per_rank(tmp_path):
    """A terminal's Ctrl-C is SIGINT to its whole foreground process group. It reaches
    ina-run alone (mpiexec and the embedded switch run in sessions of their own), which
    passes it to each rank once, tears the job down on the switch while it runs, then
    stops the switch: exit 130, 0.8 to 1.8 s after the signal as measured on a loaded
    2-core machine (bound 10 s here), with one line per rank saying where it stopped, no
    Hydra assert, no P4Runtime error, no false timeout, no KeyboardInterrupt traceback."""
    script = tmp_path / "loop.py"
    script.write_text(LOOPING_RANK)
    code, output, took = _interrupted(["-np", "3", "--", sys.executable, str(script)], 3)
    assert code == 130, output
    assert took < 10, (took, output)
    for noise in ("assert (!closed)", "CRITICAL", "arbitration", "Traceback",
                  "CollectiveTimeout", "did not"):
        assert noise not in output, (noise, output)
    stopped = re.findall(r"^ina-run: rank (\d) \(pid \d+\) stopped by Ctrl-C at (.*)$",
                         output, re.M)
    assert sorted(r for r, _ in stopped) == ["0", "1", "2"], output
    assert {where for _, where in stopped} == {f"{script}:8 in <module>"}, output
    assert len(re.findall(r"^ina-run: rank \d", output, re.M)) == 3, output
    # The job left the switch before it stopped (its final status: no job left).
    assert re.search(r"ina-run: the switch at 127\.0\.0\.1:\d+ ", output), output
    assert "still installed" not in output, output
    assert not _leftovers(str(script)), _leftovers(str(script))


TORCH_LOOPING_RANK = """import time
import torch
import torch.distributed as dist
import ina_collectives.torch.distributed  # registers backend "ina"
dist.init_process_group("ina")
x = torch.ones(1000)
print(f"ready {dist.get_rank()}", flush=True)
while True:
    dist.all_reduce(x)
    time.sleep(0.01)
"""


@pytest.mark.mpi
def test_ctrl_c_under_torchrun_ends_the_job_with_one_line_per_rank_and_no_traceback(
        tmp_path):
    """The same under --launcher torchrun: torchrun's own lines after the signal (its
    agent's log, its SignalException traceback) are left out, the ranks' lines (with
    their prefix) pass: exit 130 (1.45 s once here), one line per rank."""
    script = tmp_path / "loop.py"
    script.write_text(TORCH_LOOPING_RANK)
    code, output, _ = _interrupted(["--launcher", "torchrun", "-np", "2", "--",
                                    sys.executable, str(script)], 2)
    assert code == 130, output
    for noise in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert noise not in output, (noise, output)
    stopped = re.findall(r"^ina-run: rank (\d) \(pid \d+\) stopped by Ctrl-C at (.*)$",
                         output, re.M)
    assert sorted(r for r, _ in stopped) == ["0", "1"], output
    # (in the all_reduce or in the sleep after it)
    assert {where for _, where in stopped} <= {f"{script}:9 in <module>",
                                               f"{script}:10 in <module>"}, output


@pytest.mark.mpi
def test_a_rank_that_raises_under_torchrun_is_named_in_one_line_without_torchruns_block(
        ina_run, tmp_path, closed_udp_port):
    """Under --launcher torchrun, a job whose ranks cannot reach the switch they require
    (AggregatorUnavailable) ends with ina-run's one line naming the first rank that
    raised, what and where, and none of torchrun's own lines (its ChildFailedError
    block); the ranks' own output passes with their prefix."""
    script = tmp_path / "train.py"
    # (the script names the switch itself: ina-run would refuse a dead one at launch)
    script.write_text("import os\n"
                      f"os.environ['INA_SWITCH'] = '127.0.0.1:{closed_udp_port}'\n"
                      "os.environ['INA_REQUIRE_SWITCH'] = '1'\n"
                      "import torch\n"
                      "import torch.distributed as dist\n"
                      "import ina_collectives.torch.distributed  # backend 'ina'\n"
                      "dist.init_process_group('ina')\n"
                      "dist.all_reduce(torch.ones(100_000))\n")
    proc = ina_run("--launcher", "torchrun", "-np", "2", "--switch", "none", "--",
                   sys.executable, str(script), timeout=120)
    assert proc.returncode == 1, proc.stderr
    named = re.findall(r"^ina-run: rank \d \(pid \d+\) raised AggregatorUnavailable: .* at "
                       rf"{re.escape(str(script))}:\d+ .*; torchrun stopped the other ranks$",
                       proc.stderr, re.M)
    assert len(named) == 1, proc.stderr
    for noise in ("ChildFailedError", "torch.distributed.elastic", "Root Cause"):
        assert noise not in proc.stderr, (noise, proc.stderr)
    assert re.search(r"^\[\d\] .*AggregatorUnavailable", proc.stderr, re.M), proc.stderr


@pytest.mark.mpi
def test_ranks_stuck_outside_the_library_get_sigterm_then_sigkill(ina_run, tmp_path):
    """Survivors that never call into the library (one ignores SIGTERM) are stopped by
    ina-run itself: SIGTERM after the grace period, SIGKILL 3 s later; no process left."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "rank = int(os.environ['PMI_RANK'])\n"
        "print(f'pid={os.getpid()}', flush=True)\n"
        "if rank == 2:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(1 if rank == 0 else 600)\n"
        "if rank == 0:\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    start = time.monotonic()
    proc = ina_run("-np", "3", "--switch", "none", "--", sys.executable, str(script),
                   timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 128 + 11, proc.stderr
    assert "ina-run: rank 0 (pid" in proc.stderr and "SIGSEGV" in proc.stderr, proc.stderr
    assert "sent SIGTERM to rank(s) 1, 2" in proc.stderr, proc.stderr
    assert "sent SIGKILL to rank(s) 2" in proc.stderr, proc.stderr
    assert took < 20, (took, proc.stderr)
    pids = [int(p) for p in re.findall(r"pid=(\d+)", proc.stdout)]
    assert len(pids) == 3 and not _alive(pids), (pids, proc.stdout)
    assert not _leftovers(str(script))


@pytest.mark.mpi
def test_a_rank_stuck_past_the_grace_leaves_what_it_waits_for_and_its_stacks(ina_run,
                                                                           tmp_path):
    """Rank 0 raises; rank 1, which initialised the library, is stuck in its own code (a
    sleep) and ends only by signal: before SIGTERM, ina-run asks it for its stacks
    (SIGUSR2), and its stderr says what it waits for (nothing of the library's) and holds
    its Python stack, naming the line it is stuck on."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, sys, time\n"
        "import numpy as np\n"
        "import ina_collectives as ina\n"
        "ina.init()\n"
        "ina.allreduce(np.ones(1000, np.float32))\n"
        "if ina.rank() == 0:\n"
        "    raise RuntimeError('on purpose')\n"
        "time.sleep(600)\n")
    proc = ina_run("-np", "2", "--switch", "none", "--", sys.executable, str(script),
                   timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "asked for their stacks (SIGUSR2); SIGTERM follows" in proc.stderr, proc.stderr
    assert "ina_collectives: rank 1 (pid" in proc.stderr, proc.stderr
    assert "not waiting in ina_collectives" in proc.stderr, proc.stderr
    assert re.search(rf'File "{re.escape(str(script))}", line 8 in <module>', proc.stderr), \
        proc.stderr
    assert "sent SIGTERM to rank(s) 1" in proc.stderr, proc.stderr
    assert not _leftovers(str(script))


# -- horovodrun's options ----------------------------------------------------------------

def _refused(capsys, *argv: str) -> str:
    """parse_args(argv) must exit 2; its message."""
    with pytest.raises(SystemExit) as ended:
        launch.parse_args(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("hosts, slots", [
    ("localhost:2", 2),
    ("localhost:1,127.0.0.1:1", 2),
    (f"{socket.gethostname()}:4", 4),
    ("127.0.1.1:3", 3),
    ("localhost", 1),          # no :slots, one slot (as mpiexec's host lists)
])
def test_hosts_on_this_machine_are_accepted(hosts, slots):
    args = launch.parse_args(["-np", "1", "-H", hosts, "python", "train.py"])
    assert args.host_slots == slots and args.command == ["python", "train.py"]


def test_a_hostfile_as_horovodrun_reads_it(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2\n\n127.0.0.1:1\n"
                        f"{socket.gethostname()} slots = 1\n")
    args = launch.parse_args(["-np", "4", "--hostfile", str(hostfile), "true"])
    assert args.host_slots == 4


def test_other_hosts_run_through_mpiexecs_bootstrap(capsys, tmp_path):
    """Other machines' ranks: mpiexec places them (-hosts), its bootstrap starts them
    (-launcher, -launcher-exec) and its proxies call back to --address; without an
    address the hosts reach, the embedded switch cannot serve them: refused, saying so."""
    args = launch.parse_args(["-np", "4", "-H", "localhost:1,node7:4,10.254.0.9:2",
                              "--address", "10.0.0.1", "--bootstrap-exec", "ssh -p 2222",
                              "true"])
    assert args.remote_hosts == ["10.254.0.9", "node7"] and args.host_slots == 7
    assert launch.hydra_hosts(args) == [
        "-hosts", "localhost:1,node7:4,10.254.0.9:2", "-launcher", "ssh",
        "-launcher-exec", "ssh -p 2222", "-localhost", "10.0.0.1"]
    assert launch.hydra_hosts(launch.parse_args(["-np", "1", "-H", "localhost:2",
                                                 "true"])) == []
    err = _refused(capsys, "-np", "2", "-H", "localhost:1,node7:4,10.254.0.9:2", "true")
    assert "-H names other hosts (10.254.0.9, node7): give --address" in err, err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nworker-2 slots=8\n")
    err = _refused(capsys, "-np", "2", "--hostfile", str(hostfile), "--launcher",
                   "torchrun", "--address", "10.0.0.1", "true")
    assert "--launcher torchrun starts ranks on this machine" in err, err
    err = _refused(capsys, "-np", "2", "--hostfile", str(hostfile), "--p4runtime",
                   "10.0.0.2:9559", "--p4info", "x", "--device-config", "y", "true")
    assert "give them in --workers" in err, err
    args = launch.parse_args(["-np", "2", "--hostfile", str(hostfile), "--switch",
                              "10.0.0.2:47474", "true"])
    assert args.remote_hosts == ["worker-2"]


def test_too_few_slots_or_bad_hosts_are_refused(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    err = _refused(capsys, "-np", "3", "-H", "localhost:2", "true")
    assert "-np 3 asks for more ranks than the hosts' 2 slot(s)" in err, err
    err = _refused(capsys, "-np", "1", "-H", "localhost:two", "true")
    assert "slots must be a whole number" in err, err
    hostfile.write_text("localhost max_slots=2\n")
    err = _refused(capsys, "-np", "1", "--hostfile", str(hostfile), "true")
    assert "expected 'host slots=N'" in err, err
    err = _refused(capsys, "-np", "1", "--hostfile", str(tmp_path / "missing"), "true")
    assert "cannot read" in err, err


@pytest.mark.parametrize("option", [
    ["--gloo"], ["-p", "2222"], ["--ssh-port", "2222"], ["--network-interface", "eth0"],
    ["--timeline-filename", "t.json"], ["--autotune"], ["--hierarchical-allreduce"],
    ["--min-np", "2"],
])
def test_unsupported_horovodrun_options_are_refused_by_name(capsys, option):
    err = _refused(capsys, "-np", "2", *option, "python", "train.py")
    assert f"{option[0]} (a horovodrun option) is not supported by ina-run" in err, err


def test_the_command_keeps_its_own_options():
    """Options after the command are the program's, even horovodrun-looking ones."""
    args = launch.parse_args(["-np", "2", "python", "train.py", "-p", "3", "--gloo"])
    assert args.command == ["python", "train.py", "-p", "3", "--gloo"]


def test_setting_options_become_the_ranks_variables(capsys):
    """Both Horovod's variable (what scripts read) and ours (which wins over an INA_*
    one already in the environment), in each one's unit."""
    args = launch.parse_args(["-np", "2", "--mpi", "--fusion-threshold-mb", "32",
                              "--cycle-time-ms", "5", "--stall-check-warning-time-seconds",
                              "30", "--stall-check-shutdown-time-seconds", "90",
                              "--log-level", "trace", "true"])
    assert horovodrun.environment(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 << 20), "INA_FUSION_THRESHOLD": str(32 << 20),
        "HOROVOD_CYCLE_TIME": "5", "INA_CYCLE_TIME": "0.005",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "INA_STALL_WARNING_TIME": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90", "INA_STALL_SHUTDOWN_TIME": "90",
        "HOROVOD_LOG_LEVEL": "TRACE", "INA_LOG_LEVEL": "DEBUG"}
    from ina_collectives.settings import Settings
    settings = Settings.load(environ=horovodrun.environment(args))
    assert (settings.fusion_threshold, settings.cycle_time, settings.log_level) == (
        32 << 20, 0.005, "DEBUG")
    assert horovodrun.environment(launch.parse_args(["-np", "1", "true"])) == {}
    assert "--cycle-time-ms must be > 0" in _refused(capsys, "-np", "1", "--cycle-time-ms",
                                                     "0", "true")
    assert "--log-level must be one of" in _refused(capsys, "-np", "1", "--log-level",
                                                    "LOUD", "true")
    assert "--start-timeout must be > 0" in _refused(capsys, "-np", "1", "--start-timeout",
                                                     "-1", "true")


def test_help_names_the_horovodrun_options_taken_and_refused(capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("-H", "--hostfile", "--verbose", "--start-timeout", "--fusion-threshold-mb",
                   "--cycle-time-ms", "--gloo", "--ssh-port", "--network-interface",
                   "--timeline-filename", "--autotune"):
        assert option in text, option
    assert "It refuses, naming them" in text


def test_ranks_that_do_not_start_within_the_start_timeout_stop_the_job(tmp_path, capsys):
    """A launcher that starts rank 0 of 2 and never rank 1: at --start-timeout ina-run
    names rank 1, stops rank 0 and returns 2, without waiting for the job."""
    fake = tmp_path / "mpiexec"
    # Given "-disable-auto-cleanup -n N python rank.py DIR COMMAND": rank 0 only.
    fake.write_text('#!/bin/sh\nshift 3\nPMI_RANK=0 exec "$@"\n')
    fake.chmod(0o755)
    marker = str(tmp_path / "never-started-rank")
    start = time.monotonic()
    code = launch.run_ranks(2, ["sh", "-c", f"sleep 60 # {marker}"], dict(os.environ),
                            str(fake), start_timeout=1.0)
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rank(s) 1 of 2 did not start within the start timeout" in err, err
    assert 1.0 <= took < 6, took
    assert not _leftovers(marker), _leftovers(marker)


@pytest.mark.mpi
def test_start_timeout_bounds_the_embedded_switch_start(ina_run):
    proc = ina_run("-np", "2", "--start-timeout", "0.001", "--", sys.executable, "-c",
                   PRINT_SWITCH)
    assert proc.returncode == 2, proc.stderr
    assert "ina-switch did not start within" in proc.stderr, proc.stderr
    assert "(--start-timeout 0.001 s)" in proc.stderr, proc.stderr
    assert "switch=" not in proc.stdout


# One os.write per rank: print() writes its pieces separately, and mpiexec forwards
# the two ranks' output as it comes, so pieces of the two lines could interleave.
PRINT_SETTINGS = ("import os; os.write(1, (' '.join(['rank', os.environ['PMI_RANK'], *(f'{k}='"
                  " + os.environ.get(k, '?') for k in ('INA_SWITCH', "
                  "'HOROVOD_FUSION_THRESHOLD', 'INA_CYCLE_TIME'))]) + '\\n').encode())")


@pytest.mark.mpi
def test_horovodrun_command_line_runs_two_ranks_here(ina_run):
    """What a Horovod user types: -np 2 -H localhost:2 with --verbose, --start-timeout
    and setting options. Both ranks run beside the embedded switch with the settings;
    --verbose says the hosts, the switch, the ranks' variables and the mpiexec command."""
    proc = ina_run("-np", "2", "-H", "localhost:2", "--verbose", "--start-timeout", "60",
                   "--fusion-threshold-mb", "32", "--cycle-time-ms", "5", "--",
                   sys.executable, "-c", PRINT_SETTINGS)
    assert proc.returncode == 0, proc.stderr
    ranks = re.findall(r"rank (\d) INA_SWITCH=(127\.0\.0\.1:\d+) "
                       rf"HOROVOD_FUSION_THRESHOLD={32 << 20} INA_CYCLE_TIME=0\.005",
                       proc.stdout)
    assert sorted(r for r, _ in ranks) == ["0", "1"], proc.stdout
    address = ranks[0][1]
    assert "ina-run: mpiexec " in proc.stderr and "hosts: localhost (2 slot(s))" in \
        proc.stderr, proc.stderr
    assert f"embedded ina-switch on {address}" in proc.stderr, proc.stderr
    assert re.search(r"ina-run: 2 rank\(s\), environment for them: .*"
                     rf"INA_SWITCH={re.escape(address)}", proc.stderr), proc.stderr
    assert re.search(r"ina-run: mpiexec command: \S*mpiexec -disable-auto-cleanup -n 2 ",
                     proc.stderr), proc.stderr


SEVERAL_COMMUNICATORS = """
import json, sys, numpy as np
from mpi4py import MPI
import ina_collectives as ina
from ina_collectives.mpi import Intracomm
ina.init(switch_min_bytes=0)
x = np.ones(4096, np.float32)
out = {"world": float(ina.allreduce(x)[0])}
comms = {"dup": Intracomm(MPI.COMM_WORLD.Dup(), switch_min_bytes=0),
         "self": Intracomm(MPI.COMM_SELF, switch_min_bytes=0)}
for name, comm in comms.items():
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    out[name] = float(y[0])
engines = {"world": ina.stats()["engines"],
           **{name: comm.ina_stats()["engines"] for name, comm in comms.items()}}
with open(f"{sys.argv[1]}/rank{MPI.COMM_WORLD.Get_rank()}.json", "w") as f:
    json.dump({"sums": out, "engines": engines}, f)
"""


@pytest.mark.mpi
def test_every_communicator_of_an_installed_job_uses_the_switch(ina_run, tmp_path):
    """Under ina-run the job is installed for COMM_WORLD's ranks; a Dup of it and
    COMM_SELF join the switch as jobs of their own instead of falling back to the ring
    (they used to fail: the installed job's ports were taken, or too many)."""
    proc = ina_run("-np", "2", "--", sys.executable, "-c", SEVERAL_COMMUNICATORS,
                   str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["sums"] == {"world": 2.0, "dup": 2.0, "self": 1.0}, result
        assert result["engines"] == {"world": {"ina": 1}, "dup": {"ina": 1},
                                     "self": {"ina": 1}}, result


# -- the small things ---------------------------------------------------------------------

def test_elements_reach_every_rank_through_the_environment(capsys):
    """--elements K is the ranks' INA_SWITCH_ELEMENTS whatever the path (mpiexec passes
    the environment to the ranks of every host, which join the switch themselves);
    without it the ranks size their packets. A P4 target's K is its build's."""
    args = launch.parse_args(["-np", "2", "-H", "localhost:1,node7:1", "--address",
                              "10.0.0.1", "--elements", "320", "true"])
    env = launch.ranks_environment(args, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "INA_SWITCH_ELEMENTS": "320"}
    assert "INA_SWITCH_ELEMENTS" not in launch.ranks_environment(
        launch.parse_args(["-np", "2", "true"]), {})
    assert "--elements must be 1 or more" in _refused(capsys, "-np", "1", "--elements", "-5",
                                                      "true")
    err = _refused(capsys, "-np", "1", "--elements", "64", "--p4runtime", "h:9559",
                   "--p4info", "x", "--device-config", "y", "true")
    assert "a P4 target's K is its build's" in err, err


@pytest.mark.parametrize("given, switch, words", [
    ("10.0.0.5:47474", [], "INA_SWITCH=10.0.0.5:47474 is overridden: the ranks get the "
                           "address of the switch ina-run starts; to use the one at "
                           "10.0.0.5:47474: --switch 10.0.0.5:47474"),
    ("", [], "to use no switch: --switch none"),
    ("10.0.0.5:47474", ["--switch", "10.0.0.6:47474"], None),  # the one named wins, quietly
    (None, [], None),
])
def test_an_exported_switch_that_ina_run_overrides_is_named_once(capsys, given, switch,
                                                                 words):
    args = launch.parse_args(["-np", "1", *switch, "true"])
    launch.warn_overridden_switch(args, {} if given is None else {"INA_SWITCH": given})
    err = capsys.readouterr().err
    if words is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("ina-run: warning: ") and \
            words in err, err


def test_a_script_torchrun_would_take_runs_and_a_command_that_cannot_is_named(tmp_path):
    """A .py file first: torchrun runs it with Python, and so does ina-run (under
    mpiexec where it is not executable); what cannot run here fails before anything
    starts, saying why."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert launch.runnable([str(script), "--lr", "1"], "torchrun") == [
        sys.executable, str(script), "--lr", "1"]
    assert launch.runnable([str(script)], "mpiexec") == [sys.executable, str(script)]
    script.chmod(0o755)
    assert launch.runnable([str(script)], "mpiexec") == [str(script)]
    assert launch.runnable(["python3", "x.py"], "torchrun") == ["python3", "x.py"]
    tool = tmp_path / "tool.sh"
    tool.write_text("echo hi\n")
    for command, words in (([str(tool)], "it is not an executable file (chmod +x it, or "
                                         f"name its interpreter: -- bash {tool})"),
                           ([str(tmp_path / "gone")], "no such file"),
                           (["no-such-program-here"], "no such command on PATH")):
        with pytest.raises(LaunchError, match=re.escape(words)):
            launch.runnable(command, "mpiexec")


def test_without_the_p4_extra_the_usual_path_is_said_only_with_verbose(monkeypatch, capsys):
    """No P4Runtime: the ranks join the embedded switch themselves, the usual case for
    most users: ina-run says so only with --verbose."""
    monkeypatch.setattr(launch, "p4_extra_installed", lambda: False)
    seen = {}

    def ranks(args, env, mpiexec):
        seen["switch"] = env["INA_SWITCH"]
        return 0

    monkeypatch.setattr(launch, "start_ranks", ranks)
    for verbose in ([], ["--verbose"]):
        args = launch.parse_args(["-np", "1", *verbose, "true"])
        args.start_by = None
        assert launch.run_embedded(args, {}, "mpiexec") == 0
        err = capsys.readouterr().err
        assert ("the p4 extra is not installed" in err) == bool(verbose), err
        assert seen["switch"].startswith("127.0.0.1:") and seen["switch"] in err


def test_a_misspelt_variable_is_said_once_by_ina_run_not_again_by_a_rank(caplog):
    """ina-run says it before the ranks start; under ina-run (INA_INTERNAL_RUN_DIR set) rank 0
    leaves it at debug level, where without ina-run it says it itself."""
    import logging

    from ina_collectives import settings
    caplog.set_level(logging.DEBUG, logger="ina_collectives")
    for environ, level in (({"INA_SWITCH_ELEMNTS": "1"}, logging.WARNING),
                           ({"INA_SWITCH_ELEMNTS": "1", "PMI_RANK": "0",
                             "INA_INTERNAL_RUN_DIR": "/tmp/x"}, logging.DEBUG),
                           ({"INA_SWITCH_ELEMNTS": "1", "PMI_RANK": "0"}, logging.WARNING)):
        settings._warned.discard("INA_SWITCH_ELEMNTS")
        caplog.clear()
        assert settings.warn_unknown_variables(environ) == ["INA_SWITCH_ELEMNTS"]
        assert [r.levelno for r in caplog.records] == [level], caplog.records
        assert "did you mean INA_SWITCH_ELEMENTS?" in caplog.records[0].getMessage()
