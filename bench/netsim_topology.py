"""An emulated cluster in network namespaces: one per worker, one for the switch.

    with EmulatedCluster(n=4, link_mbit=200, mtu=9000) as cluster:
        cluster.set_loss(0.001)
        cluster.run_ranks([...])            # mpiexec, each rank in its namespace

Worker i lives in ``<prefix>-w<i>`` with one interface, ``ina0`` (the same name in every
namespace, so that FI_TCP_IFACE and GLOO_SOCKET_IFNAME are one setting), 10.199.0.<i+1>/24,
joined by a veth to a bridge in ``<prefix>-sw``, which also holds the switch's address
10.199.0.254. Every link is shaped with tbf in both directions (the worker's egress is
its uplink, the switch port's egress its downlink), so every system's traffic crosses the
same links at the same rate. This kernel has no netem: loss is an nftables rule on the
bridge (prerouting = uplinks, postrouting = downlinks). No namespace gets a default
route; addresses exist only inside the namespaces. Everything is removed on exit, after
errors too (deleting a namespace deletes its veths).

``aggregators=N`` adds N - 1 more aggregator hosts, ``<prefix>-a<j>`` at
``aggregator_ip(j)`` (10.199.0.<254 - j>), each joined to the bridge by an unshaped veth
as the switch's own address is: a job striped across them (bench.netsim --switches).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Sequence

from pyroute2 import IPRoute, NetNS, netns

SUBNET = "10.199.0"
SWITCH_IP = f"{SUBNET}.254"
IFNAME = "ina0"


def worker_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def aggregator_ip(j: int) -> str:
    """Aggregator j's address: the switch's own for 0, below it for the others."""
    return f"{SUBNET}.{254 - j}"


class EmulatedCluster:
    def __init__(self, n: int, link_mbit: float, mtu: int = 9000, prefix: str | None = None,
                 aggregators: int = 1):
        if not 1 <= n <= 200:
            raise ValueError(f"n must be 1..200 workers, got {n}")
        if not 1 <= aggregators <= 50:
            raise ValueError(f"aggregators must be 1..50, got {aggregators}")
        if os.geteuid() != 0:
            raise PermissionError("the emulated cluster needs root (network namespaces, tc)")
        self.n, self.mtu = n, mtu
        self.prefix = prefix or f"inasim{os.getpid()}"
        self.switch_ns = f"{self.prefix}-sw"
        self.worker_ns = [f"{self.prefix}-w{i}" for i in range(n)]
        self.aggregator_ns = [self.switch_ns] + [f"{self.prefix}-a{j}"
                                                 for j in range(1, aggregators)]
        self.link_mbit = link_mbit
        self.loss = 0.0
        self._created: list[str] = []
        self._owner = os.getpid()  # a forked child (pyroute2 helpers) must not tear down
        # veth names live briefly in the host's namespace: unique per run, <= 15 chars.
        self._tag = f"ina{os.getpid() % 1_000_000}"

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        for name in [*self.aggregator_ns, *self.worker_ns]:
            netns.create(name)
            self._created.append(name)
        # Every host on the bridge: its namespace, the bridge's port for it, its address.
        # Workers first (their ports are shaped), then the extra aggregators (unshaped).
        hosts = ([(ns, f"s{i}", worker_ip(i)) for i, ns in enumerate(self.worker_ns)]
                 + [(ns, f"t{j}", aggregator_ip(j))
                    for j, ns in enumerate(self.aggregator_ns[1:], 1)])
        with IPRoute() as ipr:
            for ns, port, _ in hosts:  # a veth: one end in the switch, one in the host
                end, peer = f"{self._tag}{port}", f"{self._tag}h{port}"
                ipr.link("add", ifname=end, kind="veth", peer={"ifname": peer})
                ipr.link("set", index=ipr.link_lookup(ifname=end)[0],
                         net_ns_fd=self.switch_ns)
                ipr.link("set", index=ipr.link_lookup(ifname=peer)[0], net_ns_fd=ns)
        with NetNS(self.switch_ns) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            bridge = sw.link_lookup(ifname="br0")[0]
            for _, port, _ in hosts:
                index = sw.link_lookup(ifname=f"{self._tag}{port}")[0]
                sw.link("set", index=index, ifname=port, mtu=self.mtu)
                sw.link("set", index=index, master=bridge, state="up")
            sw.link("set", index=bridge, mtu=self.mtu, state="up")
            sw.addr("add", index=bridge, address=SWITCH_IP, prefixlen=24)
            sw.link("set", index=sw.link_lookup(ifname="lo")[0], state="up")
        for ns, port, address in hosts:
            with NetNS(ns) as host:
                index = host.link_lookup(ifname=f"{self._tag}h{port}")[0]
                host.link("set", index=index, ifname=IFNAME, mtu=self.mtu)
                host.link("set", index=index, state="up")
                host.addr("add", index=index, address=address, prefixlen=24)
                host.link("set", index=host.link_lookup(ifname="lo")[0], state="up")
        self.set_rate(self.link_mbit, first=True)

    def set_tcp_rto_min(self, ms: float) -> None:
        """TCP's smallest retransmission timeout on the workers' subnet route (Linux: 200
        ms by default). MPI's and gloo's messages use TCP across the same lossy links; a
        lost segment of a small message waits this long."""
        for ns in self.worker_ns:
            subprocess.run(["ip", "-n", ns, "route", "replace", "10.199.0.0/24", "dev",
                            IFNAME, "proto", "kernel", "scope", "link", "rto_min",
                            f"{ms:g}ms"], check=True, capture_output=True)

    def teardown(self) -> None:
        """Remove every namespace this cluster made (their links and rules go with them)."""
        if os.getpid() != self._owner:
            return
        for name in reversed(self._created):
            try:
                netns.remove(name)
            except OSError:
                pass
        self._created.clear()

    # -- shaping ------------------------------------------------------------------------------

    def _links(self) -> list[tuple[str, str]]:
        return ([(self.switch_ns, f"s{i}") for i in range(self.n)] +
                [(ns, IFNAME) for ns in self.worker_ns])

    def set_rate(self, link_mbit: float, first: bool = False) -> None:
        """Shape every link (both directions) to ``link_mbit`` with tbf."""
        rate_bytes = link_mbit * 1e6 / 8
        # burst: a few jumbo frames or 1 ms at the rate, whichever is more; queue: 10 ms
        # of data, at least 16 frames (a deep queue would only add latency).
        burst = int(max(4 * (self.mtu + 64), rate_bytes * 1e-3))
        limit = int(max(16 * (self.mtu + 64), rate_bytes * 0.01))
        for ns, ifname in self._links():
            with NetNS(ns) as handle:
                index = handle.link_lookup(ifname=ifname)[0]
                handle.tc("add" if first else "replace", "tbf", index=index, handle="1:",
                          rate=f"{int(link_mbit * 1000)}kbit", burst=burst, limit=limit)
        self.link_mbit = link_mbit

    def set_loss(self, probability: float) -> None:
        """Drop each IPv4 packet with ``probability`` on every uplink and every downlink."""
        if not 0 <= probability < 1:
            raise ValueError(f"loss must be in [0, 1), got {probability}")
        table = f"{self.prefix}_loss"
        self._nft(f"delete table bridge {table}", check=False)
        if probability > 0:
            cut = round(probability * 1_000_000)
            rule = f"ether type ip numgen random mod 1000000 < {cut} counter drop"
            self._nft(f"table bridge {table} {{\n"
                      f"  chain uplinks {{ type filter hook prerouting priority 0; {rule}; }}\n"
                      f"  chain downlinks {{ type filter hook postrouting priority 0; {rule}; }}\n"
                      f"}}\n")
        self.loss = probability

    def dropped(self) -> int:
        """Packets the loss rules have dropped so far."""
        out = subprocess.run(["ip", "netns", "exec", self.switch_ns, "nft", "list", "table",
                              "bridge", f"{self.prefix}_loss"], capture_output=True, text=True)
        return sum(int(word) for line in out.stdout.splitlines() if "counter packets" in line
                   for word in [line.split("counter packets")[1].split()[0]])

    def _nft(self, script: str, check: bool = True) -> None:
        proc = subprocess.run(["ip", "netns", "exec", self.switch_ns, "nft", "-f", "-"],
                              input=script, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"nft failed ({proc.returncode}): {proc.stderr.strip()}; is the "
                               f"nftables package installed? (apt-get install nftables)")

    # -- running -----------------------------------------------------------------------------

    def in_switch(self, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.switch_ns, *command]

    def in_aggregator(self, j: int, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.aggregator_ns[j], *command]

    def switch_at(self, j: int, *switch_args: str) -> Any:
        """The software switch (ina-switch ``switch_args``) in aggregator namespace j, on
        its address there: a context manager, as embedded_switch."""
        from ina_collectives.switch.embedded import embedded_switch

        return embedded_switch(*switch_args, host=aggregator_ip(j),
                               launcher=self.in_aggregator(j, []))

    def mpiexec_command(self, mpiexec: str, command: Sequence[str],
                        workers: Sequence[int] | None = None) -> list[str]:
        """One MPMD mpiexec line: rank r runs ``command`` in the namespace of worker
        ``workers[r]`` (default: every worker, rank i in namespace i)."""
        parts = [mpiexec]
        for r, i in enumerate(range(self.n) if workers is None else workers):
            if r:
                parts.append(":")
            parts += ["-n", "1", "ip", "netns", "exec", self.worker_ns[i], *command]
        return parts

    def run_job(self, mpiexec: str, command: Sequence[str], env: dict[str, str],
                limit: float, cwd: str | os.PathLike,
                workers: Sequence[int] | None = None) -> tuple[int | None, str]:
        """Run ``command`` as one mpiexec job over the workers' namespaces
        (``mpiexec_command``), its output merged; (exit code, output), or (None, output)
        if it ran past ``limit`` seconds: then its whole process group is killed."""
        from .mpi import run_group
        return run_group(self.mpiexec_command(mpiexec, command, workers), env, limit, cwd)

    def job_record(self, mpiexec: str, command: Sequence[str], env: dict[str, str],
                   limit: float, cwd: str | os.PathLike, record: Path, what: str) -> Any:
        """run_job, then the JSON the job wrote to ``record``; SystemExit naming ``what``
        and the job's last output if it ran past ``limit`` s, failed or wrote none."""
        code, output = self.run_job(mpiexec, command, env, limit, cwd)
        if code is None:
            raise SystemExit(f"{what}: no result within {limit:g} s:\n{output[-3000:]}")
        if code != 0 or not record.exists():
            raise SystemExit(f"{what} failed ({code}):\n{output[-3000:]}")
        return json.loads(record.read_text())

    @staticmethod
    def network_environment(first_worker: int = 0) -> dict[str, str]:
        """Variables that make MPICH and gloo use the emulated links, not shared memory;
        gloo's rendezvous at the job's first worker."""
        return {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                "FI_TCP_IFACE": IFNAME, "GLOO_SOCKET_IFNAME": IFNAME,
                "MASTER_ADDR": worker_ip(first_worker)}


def remove_stale_namespaces() -> None:
    """Delete the namespaces a killed run left (stale_namespaces)."""
    for name in stale_namespaces():
        subprocess.run(["ip", "netns", "delete", name], check=False)


def stale_namespaces(prefix: str = "inasim") -> list[str]:
    """Namespaces left by a run that was killed (its pid gone)."""
    stale = []
    for name in netns.listnetns():
        head = name.split("-")[0]
        if head.startswith(prefix) and head[len(prefix):].isdigit():
            if not os.path.exists(f"/proc/{head[len(prefix):]}"):
                stale.append(name)
    return stale
