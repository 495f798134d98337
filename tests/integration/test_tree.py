"""An aggregation tree on loopback (docs/trees.md): a root and two leaf switches, each a
real ina-switch process at its own 127.0.0.x address, and 4 mpiexec ranks, two under each
leaf. Every call through the tree is within the bound and the same bits on every rank;
loss at every level changes nothing; a leaf killed mid-run sends the calls to the ring,
and its restart brings them back to the tree."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ina_collectives import protocol as P
from ina_collectives import statskeys as S
from ina_collectives.launch.cli import free_udp_ports
from ina_collectives.switch import parse_status, send_faults
from ina_collectives.switch.embedded import embedded_switch
from tests.conftest import needs_p4_extra, needs_root
from tests.integration import mpirun, rank_cases
from tests.integration.test_ina import check_job

pytestmark = pytest.mark.mpi

N = 4
SILENCE = 1.0  # the ranks' silence bound in the restart tests (seconds)
HOSTS = {"spine": "127.0.0.1", "rack0": "127.0.0.2", "rack1": "127.0.0.3"}
CASES = [("float32", "sum", 1, 1), ("float32", "sum", P.MAX_ELEMENTS + 1, 2),
         ("float32", "average", 300_001, 3), ("float64", "sum", 40_000, 4),
         ("float16", "average", 20_001, 5)]


def write_tree(path: Path) -> Path:
    """A topology file: spine above rack0 (ranks 0, 1) and rack1 (ranks 2, 3)."""
    ports = free_udp_ports(3)
    text = ""
    for (name, host), port in zip(HOSTS.items(), ports):
        text += f'[[aggregator]]\nname = "{name}"\naddress = "{host}:{port}"\n'
        if name != "spine":
            ranks = [0, 1] if name == "rack0" else [2, 3]
            text += f'parent = "spine"\nranks = {ranks}\n'
        text += "\n"
    path.write_text(text)
    return path


def start(stack: contextlib.ExitStack, topology: Path, name: str):
    from ina_collectives.protocol.topology import Topology

    host, port = Topology.load(topology)[name].address
    return stack.enter_context(embedded_switch("--topology", str(topology), "--name", name,
                                               "--port", str(port), host=host))


@pytest.fixture
def tree(tmp_path):
    """The topology file and its three switches, running; {name: EmbeddedSwitch}."""
    topology = write_tree(tmp_path / "tree.toml")
    with contextlib.ExitStack() as stack:
        switches = {name: start(stack, topology, name) for name in HOSTS}
        yield topology, switches, stack


def final_status(switch) -> dict:
    switch.stop()
    return parse_status(switch.final_status)


def test_a_tree_of_two_racks_serves_every_call_within_the_bound(tree):
    """Every call goes through the tree (the leaves send each chunk's partial sum up
    once, the root's result comes down), within the bound of 4 ranks' sum, alike."""
    topology, switches, _ = tree
    params = {"cases": CASES, "rounds": 2,
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    results = mpirun.run(N, rank_cases.ina_cases, params,
                         env={"INA_TOPOLOGY": str(topology)}, timeout=180)
    check_job(results, CASES, N, rounds=2)
    # stats() names the tree and this rank's place in it, with the documented keys.
    documented = {path.rsplit(".", 1)[1] for path in S.documented(S.ALL, {S.TREE})
                  if path.startswith("switch.tree.")}
    for rank, r in enumerate(results):
        tree = r["stats"]["switch"]["tree"]
        assert set(tree) == documented, tree
        assert (tree["leaf"], tree["worker"], tree["workers"], tree["root"]) == (
            "rack0" if rank < 2 else "rack1", rank % 2, 2, "spine"), tree
        assert tree["leaves"] == {"rack0": [0, 1], "rack1": [2, 3]}, tree
    root = final_status(switches["spine"])
    for leaf in ("rack0", "rack1"):
        s = final_status(switches[leaf])
        # Each cell its two workers completed went up, and its result came down.
        assert s["sent_up"] > 0 and s["came_down"] == s["sent_up"], s
        assert s["parent"] == "%s:%d" % switches["spine"].addresses[0], s
        assert s["results"] + s["openings"] == s["sent_up"], s
    assert root["results"] + root["openings"] == s["sent_up"], root
    assert "joins" in root["control"] and root["control"]["joins"] == 2, root


def test_loss_at_every_level_gives_the_same_bound_and_identical_ranks(tree):
    """5% of the packets each way dropped at the root and at both leaves (and 5%
    duplicated at the root): recovered at each level, every call still through the tree,
    within the bound, the same on every rank."""
    topology, switches, _ = tree
    for name, switch in switches.items():
        extra = {"duplicate_out": 0.05} if name == "spine" else {}
        send_faults(switch.addresses[0], drop_in=0.05, drop_out=0.05, **extra)
    params = {"cases": CASES, "rounds": 2,
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0,
                           "retransmit_timeout": 0.01}}
    results = mpirun.run(N, rank_cases.ina_cases, params,
                         env={"INA_TOPOLOGY": str(topology)}, timeout=180)
    check_job(results, CASES, N, rounds=2)
    for leaf in ("rack0", "rack1"):
        s = final_status(switches[leaf])
        assert s["resent_up"] > 0, s  # (the recovery across the levels ran)


def killed_and_restarted(topology: Path, switches: dict, stack: contextlib.ExitStack,
                         tmp_path: Path, name: str, count: int, pause: float, down: float,
                         after: float, start_again: Callable[[], object] | None = None,
                         namespaces: list[str] | None = None) -> tuple[list, float, float]:
    """The ranks loop over MPI's own Allreduce, a library call of ``count`` float32 and an
    allreduce of a flag, ``pause`` s apart (rank_cases.restarts_among_mpi_calls); once the
    switch served one, aggregator ``name`` is SIGKILLed, started again ``down`` s later,
    and the job stopped ``after`` s after that. (results, when killed, when restarted)."""
    params = {"case": ("float32", "sum", count), "pause": pause, "dir": str(tmp_path),
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0,
                           "switch_silence": SILENCE, "timeout": 60}}
    pool = ThreadPoolExecutor(1)
    running = pool.submit(mpirun.run, N, rank_cases.restarts_among_mpi_calls, params,
                          env={"INA_TOPOLOGY": str(topology)}, timeout=170,
                          namespaces=namespaces)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "served").exists():
        assert not running.done() and time.monotonic() < deadline, "never served"
        time.sleep(0.05)
    time.sleep(0.3)
    killed = time.monotonic()
    switches[name].process.kill()
    switches[name].process.wait(5)
    time.sleep(down)
    if start_again is None:
        start(stack, topology, name)
    else:
        start_again()
    restarted = time.monotonic()
    time.sleep(after)
    (tmp_path / "stop").touch()
    results = running.result(timeout=150)
    for r in results:
        assert r["wrong"] == [], r["wrong"][:3]
        starts = r["starts"]
        # Each call ends by the silence bound, then the rejoin's join timeout, with slack
        # for a loaded machine; never by the 60 s deadline of a call held for an
        # aggregator that does not come.
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert max(gaps) < SILENCE + 3.0 + 5.0, (max(gaps), list(zip(
            starts, r["engines"]))[-30:])
    assert all(r["digest"] == results[0]["digest"] for r in results)
    return results, killed, restarted


@pytest.mark.parametrize("count, pause, down, after", [
    (16384, 0.01, 2.0, 4.0),      # 64 KiB calls 10 ms apart: killed between calls, mostly
    (2_000_000, 0.0, 4.0, 5.0),   # 8 MB calls back to back: killed mid-stream
], ids=["between-calls", "mid-stream"])
def test_a_leaf_killed_means_the_ring_and_its_restart_the_tree(tree, tmp_path, count,
                                                                pause, down, after):
    """rack1 is SIGKILLed and started again: rack0's ranks (whose partial sums the root
    holds, with nothing to tell them rack1 is dead) end the call within the silence bound
    as rack1's do, every call right and alike, on the ring while rack1 is down, and the
    tree serves again once rack1 does."""
    topology, switches, stack = tree
    ring_while_down_then_tree(*killed_and_restarted(
        topology, switches, stack, tmp_path, "rack1", count, pause, down, after))


def ring_while_down_then_tree(results: list, killed: float, restarted: float) -> None:
    """On every rank: a call left the tree while the leaf was down, every call from
    2.5 s after its restart went through the tree, and one outage as many returns."""
    for r in results:
        starts, engines = r["starts"], r["engines"]
        assert any(e != "ina" for s, e in zip(starts, engines) if killed < s < restarted), (
            "no call left the tree while rack1 was down")
        late = [e for s, e in zip(starts, engines) if s > restarted + 2.5]
        assert late and set(late) == {"ina"}, list(zip(starts, engines))[-20:]
        state = r["stats"]["switch"]
        assert state["outages"] == state["returns"] >= 1, state


@needs_root
def test_a_leaf_killed_on_emulated_racks_means_the_ring_and_its_restart_the_tree(tmp_path):
    """The same on the emulated racks the tree's figures come from (bench.cluster.netsim
    --racks 2: two racks of two worker namespaces behind uplinks at a quarter of the
    200 Mbit/s links, each rack's leaf in a namespace of its own, the root's behind the
    spine): rack1's leaf SIGKILLed between 64 KiB calls and started again 2 s later;
    every call right and alike, on the ring while it is down, the tree's again after."""
    pytest.importorskip("pyroute2", reason="the namespaces need pyroute2 (the bench extra)")
    from ina_collectives.testing.fabric import Fabric, aggregator_ip

    port = 47600  # + the aggregator's index, as bench.cluster.netsim's RACK_PORT
    with Fabric(N, link_mbit=200, aggregators=3, racks=2, uplink_mbit=50) as cluster, \
            contextlib.ExitStack() as stack:
        topology = tmp_path / "tree.toml"
        text = f'[[aggregator]]\nname = "spine"\naddress = "{aggregator_ip(0)}:{port}"\n\n'
        for r in range(2):
            text += (f'[[aggregator]]\nname = "rack{r}"\naddress = "{aggregator_ip(r + 1)}:'
                     f'{port + r + 1}"\nparent = "spine"\nranks = {[2 * r, 2 * r + 1]}\n\n')
        topology.write_text(text)

        def at(j: int, name: str):
            return stack.enter_context(cluster.switch_at(
                j, "--topology", str(topology), "--name", name, "--port", str(port + j)))

        switches = {"spine": at(0, "spine"), "rack0": at(1, "rack0"), "rack1": at(2, "rack1")}
        outcome = killed_and_restarted(
            topology, switches, stack, tmp_path, "rack1", 16384, 0.01, 2.0, 4.0,
            start_again=lambda: at(2, "rack1"), namespaces=list(cluster.worker_ns))
    ring_while_down_then_tree(*outcome)


# -- several trees: a root per tree, every leaf under each ---------------------------------

def free_pair(host: str) -> int:
    """A UDP port p with p + 1 free as well, on ``host``."""
    import socket

    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free UDP ports")


def write_two_trees(path: Path, mbit: tuple[float, float] | None = None) -> Path:
    """spine0 and spine1, each the root of a tree over rack0 (ranks 0, 1) and rack1
    (ranks 2, 3); a leaf serves tree t at its port + t. ``mbit``: each root's rate."""
    spines = free_udp_ports(2)
    text = "".join(f'[[aggregator]]\nname = "spine{t}"\naddress = "127.0.0.{1 + 3 * t}:'
                   f'{spines[t]}"\n' + (f"mbit = {mbit[t]}\n" if mbit else "") + "\n"
                   for t in range(2))
    for r, host in enumerate(("127.0.0.2", "127.0.0.3")):
        text += (f'[[aggregator]]\nname = "rack{r}"\naddress = "{host}:{free_pair(host)}"\n'
                 f'parent = ["spine0", "spine1"]\nranks = {[2 * r, 2 * r + 1]}\n\n')
    path.write_text(text)
    return path


@pytest.fixture
def two_trees(tmp_path):
    topology = write_two_trees(tmp_path / "trees.toml")
    with contextlib.ExitStack() as stack:
        switches = {name: start(stack, topology, name)
                    for name in ("spine0", "spine1", "rack0", "rack1")}
        yield topology, switches, stack


def test_two_roots_make_two_trees_and_each_call_stripes_across_them(two_trees):
    """Each leaf runs a shard per tree (port, port + 1), each under its own root: the
    ranks have two aggregators, and a large call's shares go through both trees."""
    topology, switches, _ = two_trees
    params = {"cases": CASES, "rounds": 2,
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    results = mpirun.run(N, rank_cases.ina_cases, params,
                         env={"INA_TOPOLOGY": str(topology)}, timeout=180)
    check_job(results, CASES, N, rounds=2)
    for r in results:
        switch = r["stats"]["switch"]
        assert switch["tree"]["roots"] == ["spine0", "spine1"], switch["tree"]
        assert [a["serving"] for a in switch["aggregators"]] == [True, True], switch
        assert switch["striped_calls"] > 0, switch
    for t in range(2):
        root = final_status(switches[f"spine{t}"])
        assert root["results"] > 0, (t, root)


def test_the_roots_rates_split_the_first_call_then_the_measured_ones(tmp_path):
    """Roots of 300 and 100 Mbit/s (the file's mbit): before any call the trees' shares
    are 3:1; the calls then measure them (on loopback both trees run alike), and every
    call is within the bound on both trees."""
    topology = write_two_trees(tmp_path / "trees.toml", mbit=(300, 100))
    cases = [("float32", "sum", 300_001, 7), ("float32", "sum", 300_001, 8)]
    with contextlib.ExitStack() as stack:
        for name in ("spine0", "spine1", "rack0", "rack1"):
            start(stack, topology, name)
        results = mpirun.run(N, rank_cases.shares_before_and_after,
                             {"cases": cases, "settings": {"switch_min_bytes": 0,
                                                           "ring_min_bytes": 0}},
                             env={"INA_TOPOLOGY": str(topology)}, timeout=180)
    check_job(results, cases, N)
    for r in results:
        switch = r["stats"]["switch"]
        assert r["before"] == [0.75, 0.25], r["before"]
        assert switch["tree"]["mbit"] == [300.0, 100.0], switch["tree"]
        assert all(a["elements_per_second"] > 0 for a in switch["aggregators"]), switch
        assert switch["striped_calls"] == len(cases), switch


def test_a_root_killed_mid_run_moves_its_shares_and_its_restart_brings_them_back(
        two_trees, tmp_path):
    """spine1 is SIGKILLed mid-run: its tree's share of the call it died in goes to the
    other tree (or the ring), every result right and alike, the calls after it through
    spine0's tree alone; once spine1 runs again, both trees serve."""
    topology, switches, stack = two_trees
    results, _, _ = killed_and_restarted(topology, switches, stack, tmp_path, "spine1",
                                         300_000, 0.01, 2.0, 4.0)
    for r in results:
        state = r["stats"]["switch"]
        # The call spine1 died in: its share streamed again through spine0's tree (or,
        # failing that, the ring); the calls after it, through spine0's tree alone, until
        # spine1's tree served again.
        assert state["standby_takeovers"] + r["stats"]["engines"].get("ring", 0) >= 1, state
        assert [a["serving"] for a in state["aggregators"]] == [True, True], state
        # Counted per tree: spine1's failed (once, unless the load made a silence more)
        # and served again as often.
        tree1 = state["aggregators"][1]
        assert tree1["outages"] >= 1 and tree1["returns"] == tree1["outages"], state
        assert r["engines"][-1] == "ina", r["engines"][-10:]
    assert all(r["digest"] == results[0]["digest"] for r in results)


@needs_p4_extra
def test_a_tree_a_controller_installed_serves_every_call(tmp_path):
    """The tree installed through P4Runtime, as a tree of P4 switches is (docs/trees.md,
    A tree of P4 switches), here on three software switches serving P4Runtime: the
    root's job has the two leaves as its workers, each leaf's job its two ranks and a
    parent entry. The ranks (INA_TOPOLOGY with INA_JOB) join nothing: each probes its leaf
    as its worker id there, from its installed port. Every call goes through the tree,
    within the bound, alike on every rank; each leaf's sums went up and came down."""
    from ina_collectives.control import Controller, JobSpec, Parent, Worker
    from ina_collectives.control import schema as C
    from ina_collectives.protocol.topology import Topology

    k, slots, job_id = 64, 8, 4242
    topology = write_tree(tmp_path / "tree.toml")
    p4info = tmp_path / "ina.p4info.txt"
    p4info.write_text(C.p4info_text(k, 64, P.DEFAULT_BLOCK, 32))
    ports = free_udp_ports(N)
    tree = Topology.load(topology)
    with contextlib.ExitStack() as stack:
        switches = {}
        for name in HOSTS:
            host, port = tree[name].address
            switches[name] = stack.enter_context(embedded_switch(
                "--port", str(port), "--max-elements", str(k), host=host, p4runtime=True))
        leaves = [tree["rack0"], tree["rack1"]]
        jobs = {"spine": JobSpec(job_id, [Worker(*a.address) for a in leaves], slots)}
        for i, leaf in enumerate(leaves):
            jobs[leaf.name] = JobSpec(job_id, [Worker("127.0.0.1", ports[r])
                                               for r in leaf.ranks],
                                      slots, parent=Parent(*tree["spine"].address, i))
        for name, job in jobs.items():
            with Controller(switches[name].p4runtime_address, p4info, p4info,
                            push="always", timeout=10) as c:
                c.configure(job)
        env = {"INA_TOPOLOGY": str(topology), "INA_JOB": str(job_id),
               "INA_WORKER_PORTS": ",".join(map(str, ports)), "INA_SWITCH_ELEMENTS": str(k),
               "INA_SWITCH_SLOTS": str(slots)}
        params = {"cases": CASES, "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
        results = mpirun.run(N, rank_cases.ina_cases, params, env=env, timeout=180)
        check_job(results, CASES, N, k=k)
        for rank, r in enumerate(results):
            assert r["stats"]["switch"]["tree"]["worker"] == rank % 2, r["stats"]["switch"]
        for leaf in leaves:
            s = final_status(switches[leaf.name])
            assert s["sent_up"] > 0 and s["came_down"] == s["sent_up"], s
            assert s["parent"] == "installed" and s["control"].get("joins", 0) == 0, s
        root = final_status(switches["spine"])
        assert root["results"] + root["openings"] == s["sent_up"], root
