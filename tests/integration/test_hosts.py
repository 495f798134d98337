"""ina-run across hosts: network namespaces stand in for machines. Two "hosts" of two
ranks each, whose ranks mpiexec starts through its bootstrap (here ``ip netns exec``
instead of ssh), a switch in a third namespace, and a stranger in a fourth whose packet
posing as a worker of the job is dropped and counted; every call is served by the
switch. At the two MTUs clusters run, 1500 and 9000, with no setting beyond the README's:
each rank sizes its packets to its route's MTU, and the job takes the smallest."""
from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import subprocess
import sys
import time

import pytest

from ina_collectives import protocol as P
from ina_collectives.switch import parse_status
from ina_collectives.switch.embedded import embedded_switch
from tests.conftest import ROOT, needs_root
from tests.inputs import check_within_bound, make_input
from tests.integration import mpirun, rank_cases

pytestmark = [pytest.mark.mpi, needs_root]

SUBNET = "10.195.0"
_instances = itertools.count()
BOOTSTRAP = """#!/bin/sh
# mpiexec's "ssh" for hosts that are network namespaces: [OPTIONS] HOST COMMAND...
while [ "${1#-}" != "$1" ]; do shift; done
host="$1"; shift
exec ip netns exec "$host" sh -c "$*"
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(params=[1500, 9000], ids=["mtu1500", "mtu9000"])
def hosts(request, tmp_path):
    """Namespaces a, b (the hosts), s (the switch), x (a stranger) on a bridge of the root
    namespace, which is the launching machine (.1); their addresses .2 .. .5; every link
    at the MTU of the test's parameter."""
    mtu = request.param
    # (each instance its own names: a namespace's deletion finishes asynchronously)
    tag = f"inh{os.getpid() % 100000}{next(_instances)}"
    names = {role: f"{tag}{role}" for role in "absx"}
    bridge = f"{tag}br"
    try:
        _ip("link", "add", bridge, "mtu", str(mtu), "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (role, ns) in enumerate(names.items(), start=2):
            _ip("netns", "add", ns)
            _ip("link", "add", f"{ns}v", "mtu", str(mtu), "type", "veth", "peer", "name",
                "eth0", "mtu", str(mtu), "netns", ns)
            _ip("link", "set", f"{ns}v", "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        script = tmp_path / "netns-bootstrap"
        script.write_text(BOOTSTRAP)
        script.chmod(0o755)
        yield names, script, mtu
    finally:
        for ns in names.values():
            subprocess.run(["ip", "link", "del", f"{ns}v"], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)


def test_a_job_on_two_hosts_is_served_by_a_switch_on_a_third(hosts, tmp_path):
    from tests.control.test_controller import ina_packet

    names, bootstrap, mtu = hosts
    switch_ip = f"{SUBNET}.4"
    # The last case takes many packets (K of a 64 KiB datagram would have taken 5).
    cases = [("float32", "sum", 3000, 1), ("float64", "average", 700, 2),
             ("float32", "sum", 70_000, 3)]
    params = {"cases": cases, "dir": str(tmp_path),
              "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    hosts_arg = f"{names['a']}:2,{names['b']}:2"
    with embedded_switch(host=switch_ip, launcher=["ip", "netns", "exec", names["s"]]) as sw:
        ranks = subprocess.Popen(
            [sys.executable, "-m", "ina_collectives.launch", "-np", "4", "-H", hosts_arg,
             "--switch", sw.address_text, "--require-switch",
             "--address", f"{SUBNET}.1", "--bootstrap-exec", str(bootstrap), "--verbose",
             "--", sys.executable,
             *mpirun.rank_args(rank_cases.across_hosts, params, tmp_path)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (tmp_path / "joined").exists():
                assert ranks.poll() is None, ranks.communicate()[0]
                assert time.monotonic() < deadline, "the ranks never made their first calls"
                time.sleep(0.05)
            # The stranger sends a data packet of the job as worker 0 from its own address.
            job = int(re.search(r"job (\d+): 4 workers", "\n".join(sw.lines)).group(1))
            packet = ina_packet(job, 0, 0, range(64)).hex()
            subprocess.run(["ip", "netns", "exec", names["x"], sys.executable, "-c",
                            "import socket, sys; s = socket.socket(socket.AF_INET, "
                            "socket.SOCK_DGRAM); s.sendto(bytes.fromhex(sys.argv[1]), "
                            f"('{switch_ip}', {sw.port}))", packet],
                           check=True, timeout=30)
            (tmp_path / "stray").write_text("")
            output, _ = ranks.communicate(timeout=120)
        finally:
            if ranks.poll() is None:
                ranks.kill()
                ranks.wait()
        sw.stop()
    assert ranks.returncode == 0, output
    assert f"-hosts {hosts_arg} -launcher ssh -launcher-exec {bootstrap}" in output, output
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    assert all("error" not in r for r in results), results
    # Two ranks in each host's namespace, neither of them the launcher's.
    here = os.readlink("/proc/self/ns/net")
    spaces = [r["netns"] for r in results]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3] and here not in spaces, spaces
    # Every rank sized its packets to the path: the largest K whose datagram fits the MTU.
    k = P.elements_for_mtu(mtu)
    for r in results:
        assert (r["stats"]["switch"]["elements"], r["stats"]["switch"]["path_mtu"]) == (
            k, mtu), r["stats"]["switch"]
    for i, case in enumerate(cases * 2):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, 4, k=k)
    for r in results:  # every call through the switch
        assert r["stats"]["engines"] == {"ina": 2 * len(cases)}, r["stats"]
    status = parse_status(sw.final_status)
    assert status["control"]["joins"] == 4, status
    assert status["drops"].get("unknown_worker") == 1, status


def test_the_readmes_torchrun_recipe_on_two_hosts(hosts, tmp_path):
    """The README's torchrun recipe, on each host: INA_SWITCH set, one torchrun per host,
    backend "ina"; every all_reduce is served by the switch, with packets sized to the
    MTU. No GLOO_SOCKET_IFNAME: the hostname resolves to 127.0.0.1 in every namespace
    here, and the backend's gloo groups bind the address of the route to MASTER_ADDR
    instead (collectives.peers.gloo_address); before, rank 0 waited for the timeout."""
    names, _, mtu = hosts
    switch_ip, master = f"{SUBNET}.4", f"{SUBNET}.2"
    cases = [("float32", "sum", 3000, 1), ("float32", "average", 70_000, 3)]
    params = json.dumps({"cases": cases})
    with embedded_switch(host=switch_ip, launcher=["ip", "netns", "exec", names["s"]]) as sw:
        env = dict(os.environ, PYTHONPATH=str(ROOT), INA_SWITCH=sw.address_text,
                   INA_REQUIRE_SWITCH="1",
                   INA_SWITCH_MIN_BYTES="0", INA_RING_MIN_BYTES="0")
        nodes = [subprocess.Popen(
            ["ip", "netns", "exec", names[host], sys.executable, "-m",
             "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", master, "--master-port", "29500",
             "-m", "tests.integration.test_hosts", params, str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for node, host in enumerate("ab")]
        outputs = []
        try:
            for node in nodes:
                outputs.append(node.communicate(timeout=120)[0])
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                    node.wait()
        sw.stop()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    spaces = [r["netns"] for r in results]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3], spaces
    k = P.elements_for_mtu(mtu)
    for i, case in enumerate(cases):
        per_rank = [r["results"][i] for r in results]
        assert len({x.tobytes() for x in per_rank}) == 1, f"{case}: ranks differ"
        check_within_bound(per_rank[0], *case, 4, k=k)
    for r in results:
        assert r["stats"]["engines"] == {"ina": len(cases)}, r["stats"]
        assert r["stats"]["switch"]["elements"] == k, r["stats"]["switch"]


def torch_rank(params: dict, out: str) -> None:
    """One rank of the torchrun recipe: init_process_group("ina") from torchrun's
    environment, an all_reduce per case, its results, stats() and network namespace."""
    import torch
    import torch.distributed as dist

    import ina_collectives
    import ina_collectives.torch.distributed  # noqa: F401 - registers backend "ina"

    dist.init_process_group("ina")
    rank = dist.get_rank()
    results = []
    for dtype, op, count, seed in params["cases"]:
        t = torch.from_numpy(make_input(dtype, op, count, seed, rank))
        dist.all_reduce(t, op=dist.ReduceOp.AVG if op == "average" else dist.ReduceOp.SUM)
        results.append(t.numpy())
    stats = ina_collectives.stats()
    dist.destroy_process_group()
    record = {"results": results, "stats": stats, "netns": os.readlink("/proc/self/ns/net")}
    path = os.path.join(out, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(record, f)
    os.rename(path + ".part", path)


if __name__ == "__main__":
    torch_rank(json.loads(sys.argv[1]), sys.argv[2])
