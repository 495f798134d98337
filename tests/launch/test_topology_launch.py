"""ina-run --topology FILE: the file read and checked for -np ranks before anything
starts, and every refusal one line naming it, exit 2, no process started (a cycle, a
rank with no aggregator, an embedded switch off loopback, the options it cannot take);
--switch running probes the file's switches and names each that does not answer; the
ranks get INA_TOPOLOGY, absolute, and no INA_SWITCH; the embedded switches start at the
file's addresses with --topology FILE --name NAME, root first, and are stopped after."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ina_collectives.launch import cli as launch
from ina_collectives.switch.embedded import embedded_switch
from tests.conftest import needs_p4_extra


def tree(root: str, leaves: list[tuple[str, str, list[int]]]) -> str:
    """A topology file's text: ``root`` (an address) named spine, and each leaf as
    (name, address, ranks) under it."""
    text = f'[[aggregator]]\nname = "spine"\naddress = "{root}"\n\n'
    for name, address, ranks in leaves:
        text += (f'[[aggregator]]\nname = "{name}"\naddress = "{address}"\n'
                 f'parent = "spine"\nranks = {ranks}\n\n')
    return text


def leftovers(marker: str) -> list[str]:
    """The live processes whose command line holds ``marker``."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines()
            if marker in line and line.split()[1:2] != ["Z"]]


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_launcher(monkeypatch):
    """ina-run with mpiexec taken as found and the ranks' start recorded, not run: what
    start_ranks was given (its environment), in a list."""
    started = []
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "mpiexec")
    monkeypatch.setattr(launch, "start_ranks",
                        lambda args, env, mpiexec: started.append(dict(env)) or 0)
    for name in ("INA_SWITCH", "INA_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)
    return started


def refused_at_launch(capsys, *argv: str) -> str:
    """ina-run ARGV must end with exit 2 and one line, its error; that line."""
    code = launch.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ina-run: error: "), err
    return lines[0]


@pytest.mark.parametrize("text, np, words", [
    (tree("127.0.0.1:47480", [("a", "127.0.0.1:47481", [0])]).replace(
        'name = "spine"\naddress = "127.0.0.1:47480"',
        'name = "spine"\naddress = "127.0.0.1:47480"\nparent = "a"'), 1,
     "the parents form a cycle: spine -> a -> spine"),
    (tree("127.0.0.1:47480", [("rack0", "127.0.0.1:47481", [0]),
                              ("rack1", "127.0.0.1:47482", [1])]), 3,
     "no aggregator serves rank(s) 2 of the job's 3"),
    (tree("127.0.0.1:47480", [("rack0", "127.0.0.1:47481", [0]),
                              ("rack1", "10.0.0.2:47482", [1])]), 2,
     "aggregator 'rack1' at 10.0.0.2:47482 is not on loopback (127.0.0.0/8), where ina-run "
     "starts the embedded switches; a switch on another host must be started there "
     "(ina-switch --topology FILE --name NAME), and then every switch of the file by you: "
     "give --switch running"),
])
def test_a_tree_refused_at_launch_is_named_and_nothing_starts(tmp_path, capsys, no_launcher,
                                                              monkeypatch, text, np, words):
    monkeypatch.setattr(launch, "find_mpiexec", lambda: pytest.fail("mpiexec was looked for"))
    path = tmp_path / "job.toml"
    path.write_text(text)
    line = refused_at_launch(capsys, "-np", str(np), "--topology", str(path), "true")
    assert line == f"ina-run: error: {path}: {words}", line
    assert no_launcher == [] and not leftovers(str(path)), leftovers(str(path))


def test_a_missing_or_malformed_file_is_named(tmp_path, capsys, no_launcher):
    line = refused_at_launch(capsys, "-np", "1", "--topology", str(tmp_path / "gone.toml"),
                             "true")
    assert f"topology file {tmp_path / 'gone.toml'}: No such file" in line, line
    (tmp_path / "bad.toml").write_text("[[aggregator]\n")
    line = refused_at_launch(capsys, "-np", "1", "--topology", str(tmp_path / "bad.toml"),
                             "true")
    assert line.startswith(f"ina-run: error: {tmp_path / 'bad.toml'}: not TOML"), line
    assert no_launcher == []


@pytest.mark.parametrize("options, words", [
    (["--aggregators", "2"], "--topology and --aggregators: the file names the aggregators, "
                             "one switch each"),
    (["--switch", "127.0.0.1:47474"], "--topology and --switch 127.0.0.1:47474: the file "
                                      "names the aggregators; --switch is 'embedded'"),
    (["--switch", "none"], "--topology and --switch none"),
    (["--p4runtime", "h:9559", "--p4info", "x", "--device-config", "y"],
     "--topology and --p4runtime: a tree of P4 targets names them in the file"),
    (["--address", "10.0.0.1"], "--topology and --address: the embedded switches bind the "
                                "file's addresses"),
    (["-H", "localhost:1,node7:1"], "--topology's embedded switches listen on loopback, "
                                    "which they cannot reach"),
])
def test_what_topology_cannot_be_combined_with_is_refused(capsys, options, words):
    with pytest.raises(SystemExit) as ended:
        launch.parse_args(["-np", "2", "--topology", "tree.toml", *options, "true"])
    assert ended.value.code == 2
    assert words in capsys.readouterr().err
    # Running switches on other hosts are the way there.
    launch.parse_args(["-np", "2", "-H", "localhost:1,node7:1", "--topology", "tree.toml",
                       "--switch", "running", "true"])


def test_switch_running_is_for_a_topology(capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(["-np", "2", "--switch", "running", "true"])
    assert "--switch running is for --topology" in capsys.readouterr().err


def test_the_help_says_the_option(capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--topology FILE run the job on an aggregation tree" in text, text
    assert "With --topology: 'embedded' or 'running' (the file's switches run already)" in text


def test_running_switches_are_probed_and_the_ranks_get_the_tree_not_a_switch(
        tmp_path, capsys, monkeypatch, no_launcher):
    """--switch running: each aggregator answers its probe, then the ranks start with
    INA_TOPOLOGY (the file's absolute path) and without INA_SWITCH, an exported one
    left out and said. (Plain switches stand in for the file's: a probe is the same.)"""
    with embedded_switch() as spine, embedded_switch() as rack0, embedded_switch() as rack1:
        (tmp_path / "tree.toml").write_text(tree(spine.address_text, [
            ("rack0", rack0.address_text, [0]), ("rack1", rack1.address_text, [1])]))
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("INA_SWITCH", "127.0.0.1:47474")
        code = launch.main(["-np", "2", "--topology", "tree.toml", "--switch", "running",
                            "--verbose", "true"])
    err = capsys.readouterr().err
    assert code == 0, err
    [env] = no_launcher
    assert env["INA_TOPOLOGY"] == str(tmp_path / "tree.toml") and "INA_SWITCH" not in env
    assert (f"ina-run: warning: INA_SWITCH=127.0.0.1:47474 is left out: the ranks take "
            f"their aggregators from --topology {tmp_path / 'tree.toml'}") in err, err
    assert "the tree of" in err and "spine <- rack0 (ranks 0), rack1 (ranks 1)" in err, err
    assert "all 3 aggregators of the tree answered their probes" in err, err


def test_running_switches_that_do_not_answer_are_each_named(tmp_path, capsys, no_launcher):
    """An unreachable parent (and leaf) fails at launch and is named, with its place."""
    spine, rack1 = closed_port(), closed_port()
    path = tmp_path / "tree.toml"
    with embedded_switch() as rack0:
        path.write_text(tree(f"127.0.0.1:{spine}", [("rack0", rack0.address_text, [0, 1]),
                                                    ("rack1", f"127.0.0.1:{rack1}", [2])]))
        line = refused_at_launch(capsys, "-np", "3", "--topology", str(path), "--switch",
                                 "running", "--control-timeout", "1", "true")
    assert (f"aggregator 'spine' at 127.0.0.1:{spine} (parent of rack0, rack1) does not "
            f"answer (no aggregator listens at 127.0.0.1:{spine} (port unreachable)); "
            f"aggregator 'rack1' at 127.0.0.1:{rack1} (serving rank 2, under spine) does "
            f"not answer") in line, line
    assert "rack0" not in line.split("; ")[-1] and "'rack0' at" not in line, line
    assert f"the switches of {path} run already" in line, line
    assert no_launcher == []


def test_an_exported_tree_gives_way_to_the_switch_ina_run_gives(capsys):
    """Without --topology the ranks get INA_SWITCH from ina-run; an exported
    INA_TOPOLOGY would make their settings refuse both: it is left out, and said."""
    args = launch.parse_args(["-np", "1", "true"])
    assert launch.ranks_environment(args, {"INA_TOPOLOGY": "/t.toml", "PATH": "/bin"}) == {
        "PATH": "/bin"}
    launch.warn_overridden_switch(args, {"INA_TOPOLOGY": "/t.toml"})
    err = capsys.readouterr().err
    assert err == ("ina-run: warning: INA_TOPOLOGY=/t.toml is left out: the ranks get "
                   "INA_SWITCH from ina-run; to use its tree: --topology /t.toml\n"), err
    args = launch.parse_args(["-np", "1", "--topology", "/t.toml", "true"])
    assert launch.ranks_environment(args, {"INA_TOPOLOGY": "/u.toml"}) == {
        "INA_TOPOLOGY": "/u.toml"}  # (run_topology sets the file's path)
    launch.warn_overridden_switch(args, {"INA_TOPOLOGY": "/u.toml"})
    assert "INA_TOPOLOGY=/u.toml is overridden by --topology /t.toml" in capsys.readouterr().err


def test_an_embedded_switch_that_cannot_start_is_named_and_none_is_left(tmp_path, capsys,
                                                                        no_launcher):
    """The root's port taken: its ina-switch fails, named with its place, and nothing
    is left running."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        path = tmp_path / "tree.toml"
        path.write_text(tree(f"127.0.0.1:{port}", [("rack0", "127.0.0.1:1", [0]),
                                                   ("rack1", "127.0.0.1:2", [1])]))
        line = refused_at_launch(capsys, "-np", "2", "--topology", str(path), "true")
    assert line.startswith(f"ina-run: error: aggregator 'spine' at 127.0.0.1:{port} "
                           f"(parent of rack0, rack1): "), line
    assert no_launcher == [] and not leftovers(str(path)), leftovers(str(path))


def _switches_of(path: str) -> dict[str, list[str]]:
    """The live ina-switch processes started for ``path``: their arguments, by --name."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().rstrip("\0").split("\0")
        except (OSError, ValueError):
            continue
        if "ina_collectives.switch" in args and path in args:
            found[args[args.index("--name") + 1]] = args
    return found


def test_the_embedded_switches_listen_at_the_files_addresses_root_first(tmp_path, capsys,
                                                                        monkeypatch):
    """Two leaves under a root, each on a loopback address of its own: ina-run starts
    three ina-switch processes with --topology FILE --name NAME at the file's addresses,
    root first; while the ranks would run each answers its probe there; afterwards none
    is left. A leaf whose port is taken fails the launch, naming it, and the switches
    started before it are stopped."""
    spine, rack0, rack1 = launch.free_udp_ports(3)
    addresses = {"spine": ("127.0.0.1", spine), "rack0": ("127.0.0.2", rack0),
                 "rack1": ("127.0.0.3", rack1)}
    path = tmp_path / "tree.toml"
    path.write_text(tree("127.0.0.1:%d" % spine, [("rack0", "127.0.0.2:%d" % rack0, [0, 1]),
                                                  ("rack1", "127.0.0.3:%d" % rack1, [2])]))
    seen = {}

    def ranks(args, env, mpiexec):
        seen["env"] = dict(env)
        seen["switches"] = _switches_of(str(path))
        seen["silent"] = {name: launch.silent_aggregator(address, 2.0)
                          for name, address in addresses.items()}
        return 0

    monkeypatch.setattr(launch, "find_mpiexec", lambda: "mpiexec")
    monkeypatch.setattr(launch, "start_ranks", ranks)
    monkeypatch.delenv("INA_SWITCH", raising=False)
    code = launch.main(["-np", "3", "--topology", str(path), "true"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert seen["silent"] == {"spine": None, "rack0": None, "rack1": None}, seen
    assert seen["env"]["INA_TOPOLOGY"] == str(path) and "INA_SWITCH" not in seen["env"]
    assert set(seen["switches"]) == set(addresses), seen["switches"]
    for name, (host, port) in addresses.items():
        args = " ".join(seen["switches"][name])
        assert f"--host {host}" in args and args.endswith(f"--port {port} --topology {path} "
                                                          f"--name {name}"), args
    assert re.search(rf"embedded ina-switch per aggregator of {re.escape(str(path))}: "
                     rf"spine on 127\.0\.0\.1:{spine}, rack0 on 127\.0\.0\.2:{rack0}, "
                     rf"rack1 on 127\.0\.0\.3:{rack1}", err), err
    assert all(f"ina-run: {name}: the switch at" in err for name in addresses), err
    assert not leftovers(str(path)), leftovers(str(path))
    # The last leaf's port taken: named; the root and the first leaf, started, stopped.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.3", rack1))
        line = refused_at_launch(capsys, "-np", "3", "--topology", str(path), "true")
    assert line.startswith(f"ina-run: error: aggregator 'rack1' at 127.0.0.3:{rack1} "
                           f"(serving rank 2, under spine): "), line
    assert not leftovers(str(path)), leftovers(str(path))
    assert os.path.isabs(seen["env"]["INA_TOPOLOGY"])


PRINT_AGGREGATORS = ("import os; os.write(1, ('rank ' + os.environ['PMI_RANK'] + ' topology='"
                     " + os.environ.get('INA_TOPOLOGY', '-') + ' switch=' + "
                     "os.environ.get('INA_SWITCH', '-') + '\\n').encode())")


@pytest.mark.mpi
def test_ranks_under_mpiexec_get_the_tree_and_no_switch(ina_run, tmp_path):
    """Through mpiexec and rank.py: each rank's environment holds INA_TOPOLOGY, the
    file's absolute path, and no INA_SWITCH, even with one exported; the switches are
    stopped after, each said in a line."""
    spine, rack0, rack1 = launch.free_udp_ports(3)
    path = tmp_path / "tree.toml"
    path.write_text(tree(f"127.0.0.1:{spine}", [("rack0", f"127.0.0.2:{rack0}", [0]),
                                                ("rack1", f"127.0.0.3:{rack1}", [1])]))
    proc = ina_run("-np", "2", "--topology", str(path), "--", sys.executable, "-c",
                   PRINT_AGGREGATORS, env={"INA_SWITCH": "127.0.0.1:47474"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"rank (\d) topology=(\S+) switch=(\S+)", proc.stdout)) == [
        ("0", str(path), "-"), ("1", str(path), "-")], proc.stdout
    for name in ("spine", "rack0", "rack1"):
        assert f"ina-run: {name}: the switch at" in proc.stderr, proc.stderr
    assert not leftovers(str(path)), leftovers(str(path))


ALLREDUCE_THROUGH_THE_TREE = """
import sys
import numpy as np
from mpi4py import MPI
import ina_collectives as ina
comm = MPI.COMM_WORLD
ina.init(comm, switch_min_bytes=0, ring_min_bytes=0)
x = np.arange(200_000, dtype=np.float32) * (comm.rank + 1)
y = ina.allreduce(x)
want = np.arange(200_000, dtype=np.float64) * sum(range(1, comm.size + 1))
error = float(np.max(np.abs(y - want) / np.maximum(want, 1)))
s = ina.stats()
print(f"rank {comm.rank} ina={s['engines'].get('ina', 0)} worker={s['switch']['tree']['worker']} "
      f"error={error:.2e}", flush=True)
ina.finalize()
"""


@pytest.mark.mpi
@needs_p4_extra
def test_a_tree_of_p4runtime_targets_is_installed_run_and_torn_down(ina_run, tmp_path):
    """Every aggregator of the file names its P4Runtime target (here three software
    switches serving P4Runtime, as P4 switches would): ina-run installs the root's job
    (the leaves its workers) and each leaf's (its ranks and its parent), the ranks join
    nothing and every call goes through the tree, and every job is torn down after."""
    from ina_collectives.control import schema as C
    from ina_collectives.switch import parse_status

    p4info = tmp_path / "ina.p4info.txt"
    p4info.write_text(C.p4info_text(64, 64, 32, 32))
    with contextlib.ExitStack() as stack:
        switches = {name: stack.enter_context(embedded_switch(
            "--max-elements", "64", host=host, p4runtime=True))
            for name, host in (("spine", "127.0.0.1"), ("rack0", "127.0.0.2"),
                               ("rack1", "127.0.0.3"))}
        text = ""
        for name, s in switches.items():
            text += (f'[[aggregator]]\nname = "{name}"\naddress = "{s.host}:{s.port}"\n'
                     f'p4runtime = "{s.p4runtime_address}"\n')
            if name != "spine":
                text += f'parent = "spine"\nranks = {[0, 1] if name == "rack0" else [2, 3]}\n'
            text += "\n"
        path = tmp_path / "tree.toml"
        path.write_text(text)
        proc = ina_run("-np", "4", "--topology", str(path), "--p4info", str(p4info),
                       "--device-config", str(p4info), "--target", "bmv2", "--", sys.executable,
                       "-c", ALLREDUCE_THROUGH_THE_TREE, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "installed on the tree of" in proc.stderr, proc.stderr
        lines = sorted(re.findall(r"rank (\d) ina=(\d+) worker=(\d) error=(\S+)",
                                  proc.stdout))
        assert [(r, e, w) for r, e, w, _ in lines] == [
            (str(r), "1", str(r % 2)) for r in range(4)], proc.stdout
        assert all(float(err) < 1e-5 for *_, err in lines), lines
        for name in ("rack0", "rack1"):
            switches[name].stop()
            status = parse_status(switches[name].final_status)
            assert status["sent_up"] > 0 and status["came_down"] == status["sent_up"], status
            assert status["p4runtime_jobs"] == 0, status   # torn down


@needs_p4_extra
def test_an_installed_trees_target_that_does_not_answer_is_named_and_nothing_stays(
        tmp_path, capsys, no_launcher):
    """A leaf's P4Runtime target that does not answer: ina-run exits 2 naming the
    aggregator, its place and its target; the root's job, installed first, is torn down
    again, and no rank starts."""
    from ina_collectives.control import schema as C
    from ina_collectives.switch import parse_status

    p4info = tmp_path / "ina.p4info.txt"
    p4info.write_text(C.p4info_text(64, 64, 32, 32))
    dead = f"127.0.0.1:{closed_port()}"
    with embedded_switch("--max-elements", "64", p4runtime=True) as root:
        path = tmp_path / "tree.toml"
        path.write_text(f'[[aggregator]]\nname = "spine"\naddress = "{root.host}:{root.port}"'
                        f'\np4runtime = "{root.p4runtime_address}"\n\n'
                        f'[[aggregator]]\nname = "rack0"\naddress = "127.0.0.2:47474"\n'
                        f'p4runtime = "{dead}"\nparent = "spine"\nranks = [0, 1]\n')
        line = refused_at_launch(capsys, "-np", "2", "--topology", str(path), "--p4info",
                                 str(p4info), "--device-config", str(p4info), "--target",
                                 "bmv2", "--control-timeout", "2", "true")
        root.stop()
        status = parse_status(root.final_status)
    assert line.startswith(f"ina-run: error: aggregator 'rack0' (serving ranks 0, 1, under "
                           f"spine) at {dead}: "), line
    assert status["p4runtime_jobs"] == 0, status   # the root's job, torn down
    assert no_launcher == []
