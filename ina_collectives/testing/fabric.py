"""The namespace fabric: workers and aggregators in network namespaces, for the tests'
switch scenarios and the benchmarks' emulated cluster alike.

    with Fabric(n=4, link_mbit=200, mtu=9000) as fabric:       # the emulated cluster
        fabric.set_loss(0.001)
        code, output = fabric.run_job(mpiexec, command, env, limit=600)
    with Fabric(n=4, bridge=False, management=True) as fabric:  # BMv2 on ports p0..p3

Worker i lives in ``<prefix>-w<i>`` with one interface, ``ina0`` (the same name in every
namespace, so that FI_TCP_IFACE and GLOO_SOCKET_IFNAME are one setting), at
``worker_ip(i)`` with the fixed MAC ``worker_mac(i)``, joined by a veth to port ``p<i>``
in the switch's namespace ``<prefix>-sw``. There, with ``bridge`` (the default), a bridge
joins the ports and holds the switch's address ``SWITCH_IP`` and MAC ``SWITCH_MAC``;
without it the ports stay bare for a switch that takes them itself (BMv2). The workers
reach the switch's address through a static neighbour entry (BMv2 answers no ARP).

``aggregators=N`` adds N - 1 aggregator hosts, ``<prefix>-a<j>`` at ``aggregator_ip(j)``,
each on bridge port ``t<j>`` by an unshaped veth, as the switch's own address is (a job
striped across them). ``management`` adds a veth from this namespace (``MGMT_HOST``) to
the switch's (``MGMT_SWITCH``), for a controller here to reach a P4Runtime server there.

``racks=R`` splits the workers into R racks of n / R (worker i in rack i // (n / R)):
each rack a bridge of its own (``br1`` .. ``brR``) holding its workers' ports and rack
aggregator r's port ``t<r+1>`` (so ``aggregators`` must be R + 1), joined to the spine
bridge ``br0`` (the switch's own address, aggregator 0) by one veth, the rack's uplink
(``u<r+1>`` on the rack's side, ``v<r+1>`` on the spine's), shaped to ``uplink_mbit``
both ways. Every packet between racks crosses two uplinks; within a rack, none.

``link_mbit`` shapes every worker's link with tbf in both directions (the worker's
egress is its uplink, the switch port's egress its downlink), so every system's traffic
crosses the same links at the same rate. This kernel has no netem: loss is an nftables
rule on each worker's interface (egress = uplink, ingress = downlink), of every IPv4
packet or of one UDP port's. No namespace gets a default route; addresses exist only
inside the namespaces. Everything is removed on exit, after errors too (deleting a
namespace deletes its veths), and ``__enter__`` first removes what a killed run left.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from pyroute2 import IPRoute, NetNS, netns

from .jobs import ROOT, mpiexec_line, run_group

SUBNET = "10.199.0"
SWITCH_IP = f"{SUBNET}.254"
SWITCH_MAC = "02:1a:00:00:00:fe"
MGMT_HOST, MGMT_SWITCH = "10.197.0.1", "10.197.0.2"
IFNAME = "ina0"
PREFIX = "inafab"
LOSS_TABLE = "inaloss"


def worker_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def worker_mac(i: int) -> str:
    return f"02:1a:00:00:{(i + 1) >> 8:02x}:{(i + 1) & 0xff:02x}"


def aggregator_ip(j: int) -> str:
    """Aggregator j's address: the switch's own for 0, below it for the others."""
    return f"{SUBNET}.{254 - j}"


@contextmanager
def in_namespace(namespace: str) -> Iterator[None]:
    """Sockets made inside belong to network namespace ``namespace`` and stay there
    (setns for this thread, then back)."""
    netns.pushns(namespace)
    try:
        yield
    finally:
        netns.popns()


def stale_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces of fabrics whose process is gone (a killed run)."""
    stale = []
    for name in netns.listnetns():
        head = name.split("-")[0]
        if head.startswith(prefix) and head[len(prefix):].isdigit():
            if not os.path.exists(f"/proc/{head[len(prefix):]}"):
                stale.append(name)
    return stale


def remove_stale() -> None:
    """Delete the namespaces a killed run left (stale_namespaces)."""
    for name in stale_namespaces():
        try:
            netns.remove(name)
        except OSError:
            pass


class Fabric:
    _made = 0

    def __init__(self, n: int, *, link_mbit: float | None = None, mtu: int = 1500,
                 bridge: bool = True, aggregators: int = 1, management: bool = False,
                 prefix: str | None = None, burst_bytes: int | None = None,
                 racks: int = 0, uplink_mbit: float | None = None):
        if not 1 <= n <= 200:
            raise ValueError(f"n must be 1..200 workers, got {n}")
        if not 1 <= aggregators <= 50:
            raise ValueError(f"aggregators must be 1..50, got {aggregators}")
        if aggregators > 1 and not bridge:
            raise ValueError("more aggregators need the bridge (bridge=True)")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be 576..65535, got {mtu}")
        if link_mbit is not None and not link_mbit > 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        if burst_bytes is not None and burst_bytes < mtu + 64:
            raise ValueError(f"burst_bytes must hold a frame ({mtu + 64} bytes at MTU "
                             f"{mtu}), got {burst_bytes}")
        if racks and not (racks >= 2 and bridge and n % racks == 0
                          and aggregators == racks + 1):
            raise ValueError(f"racks={racks}: at least 2, n ({n}) a multiple of it, the "
                             f"bridge, and aggregators = racks + 1 (one per rack and the "
                             f"spine's), got {aggregators}")
        if (uplink_mbit is not None) != bool(racks) or (uplink_mbit is not None
                                                         and not uplink_mbit > 0):
            raise ValueError("uplink_mbit goes with racks, and must be positive")
        self.racks, self.uplink_mbit = racks, uplink_mbit
        self.burst_bytes = burst_bytes
        if os.geteuid() != 0:
            raise PermissionError("the namespace fabric needs root (network namespaces, tc)")
        Fabric._made += 1
        self.n, self.mtu, self.bridge, self.management = n, mtu, bridge, management
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{Fabric._made}"
        self.switch_ns = f"{self.prefix}-sw"
        self.worker_ns = [f"{self.prefix}-w{i}" for i in range(n)]
        self.aggregator_ns = [self.switch_ns] + [f"{self.prefix}-a{j}"
                                                 for j in range(1, aggregators)]
        self.link_mbit = link_mbit
        self.loss = 0.0
        self._created: list[str] = []
        self._owner = os.getpid()  # a forked child (pyroute2 helpers) must not tear down
        # veth names live briefly in this namespace: unique per fabric, <= 15 chars.
        self._tag = f"fb{os.getpid() % 100_000}{Fabric._made % 100:02d}"

    # -- lifetime ------------------------------------------------------------------------

    def __enter__(self) -> "Fabric":
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace this fabric made (their links and rules go with them)
        and the management veth's end here."""
        if os.getpid() != self._owner:
            return
        if self.management:
            with IPRoute() as ipr:
                for index in ipr.link_lookup(ifname=f"{self._tag}m"):
                    try:
                        ipr.link("del", index=index)
                    except OSError:
                        pass
        for name in reversed(self._created):
            try:
                netns.remove(name)
            except OSError:
                pass
        self._created.clear()

    def _hosts(self) -> list[tuple[str, str, str, str | None]]:
        """(namespace, its port in the switch's namespace, address, MAC) of every host:
        the workers, then the extra aggregators."""
        return ([(ns, f"p{i}", worker_ip(i), worker_mac(i))
                 for i, ns in enumerate(self.worker_ns)]
                + [(ns, f"t{j}", aggregator_ip(j), None)
                   for j, ns in enumerate(self.aggregator_ns[1:], 1)])

    def rack_of(self, worker: int) -> int:
        """The rack a worker is in (0 without racks)."""
        return worker // (self.n // self.racks) if self.racks else 0

    def _bridge_of(self, port: str) -> str:
        """The bridge a port joins: the spine's (br0) without racks; else its rack's."""
        if not self.racks:
            return "br0"
        if port.startswith("p"):
            return f"br{self.rack_of(int(port[1:])) + 1}"
        return f"br{int(port[1:])}"  # t<j>: rack j - 1's aggregator

    def _build(self) -> None:
        tag, hosts = self._tag, self._hosts()
        for name in [*self.aggregator_ns, *self.worker_ns]:
            netns.create(name)
            self._created.append(name)
        with IPRoute() as ipr:
            for ns, port, _, _ in hosts:  # a veth: one end in the switch, one in the host
                end, peer = f"{tag}{port}", f"{tag}h{port}"
                ipr.link("add", ifname=end, kind="veth", peer={"ifname": peer})
                ipr.link("set", index=ipr.link_lookup(ifname=end)[0],
                         net_ns_fd=self.switch_ns)
                ipr.link("set", index=ipr.link_lookup(ifname=peer)[0], net_ns_fd=ns)
            if self.management:
                ipr.link("add", ifname=f"{tag}m", kind="veth", peer={"ifname": f"{tag}n"})
                ipr.link("set", index=ipr.link_lookup(ifname=f"{tag}n")[0],
                         net_ns_fd=self.switch_ns)
                here = ipr.link_lookup(ifname=f"{tag}m")[0]
                ipr.addr("add", index=here, address=MGMT_HOST, prefixlen=30)
                ipr.link("set", index=here, state="up")
        with NetNS(self.switch_ns) as sw:
            sw.link("set", index=sw.link_lookup(ifname="lo")[0], state="up")
            if self.management:
                mgmt = sw.link_lookup(ifname=f"{tag}n")[0]
                sw.link("set", index=mgmt, ifname="mgmt", state="up")
                sw.addr("add", index=mgmt, address=MGMT_SWITCH, prefixlen=30)
            bridges: dict[str, int] = {}
            if self.bridge:
                for name in ["br0"] + [f"br{r + 1}" for r in range(self.racks)]:
                    sw.link("add", ifname=name, kind="bridge")
                    bridges[name] = sw.link_lookup(ifname=name)[0]
                    sw.link("set", index=bridges[name], mtu=self.mtu)
                sw.link("set", index=bridges["br0"], address=SWITCH_MAC)
            for r in range(1, self.racks + 1):  # each rack's uplink to the spine
                sw.link("add", ifname=f"u{r}", kind="veth", peer={"ifname": f"v{r}"})
                for end, bridge in ((f"u{r}", f"br{r}"), (f"v{r}", "br0")):
                    index = sw.link_lookup(ifname=end)[0]
                    sw.link("set", index=index, mtu=self.mtu, master=bridges[bridge])
                    sw.link("set", index=index, state="up")
            for _, port, _, _ in hosts:
                index = sw.link_lookup(ifname=f"{tag}{port}")[0]
                sw.link("set", index=index, ifname=port, mtu=self.mtu)
                if self.bridge:
                    sw.link("set", index=index, master=bridges[self._bridge_of(port)])
                sw.link("set", index=index, state="up")
            for index in bridges.values():
                sw.link("set", index=index, state="up")
            if self.bridge:
                sw.addr("add", index=bridges["br0"], address=SWITCH_IP, prefixlen=24)
        for ns, port, address, mac in hosts:
            with NetNS(ns) as host:
                index = host.link_lookup(ifname=f"{tag}h{port}")[0]
                host.link("set", index=index, ifname=IFNAME, mtu=self.mtu,
                          **({"address": mac} if mac else {}))
                host.link("set", index=index, state="up")
                host.addr("add", index=index, address=address, prefixlen=24)
                host.link("set", index=host.link_lookup(ifname="lo")[0], state="up")
                if mac:  # a worker
                    host.neigh("add", dst=SWITCH_IP, lladdr=SWITCH_MAC, ifindex=index,
                               state=0x80)  # NUD_PERMANENT
        if self.link_mbit is not None:
            self.set_rate(self.link_mbit, first=True)
        if self.uplink_mbit is not None:
            self.set_uplink_rate(self.uplink_mbit, first=True)

    # -- the links -----------------------------------------------------------------------

    def set_rate(self, link_mbit: float, first: bool = False) -> None:
        """Shape every worker's link (both directions) to ``link_mbit`` with tbf."""
        if not link_mbit > 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        first = first or self.link_mbit is None
        rate_bytes = link_mbit * 1e6 / 8
        # burst: a few jumbo frames or 1 ms at the rate, whichever is more (a link idle
        # that long banks its time for the next burst; ``burst_bytes``, as asked: a real
        # link banks nothing, one frame comes closest); queue: 10 ms of data, at least
        # 16 frames (a deep queue would only add latency).
        burst = (self.burst_bytes if self.burst_bytes is not None
                 else int(max(4 * (self.mtu + 64), rate_bytes * 1e-3)))
        limit = int(max(16 * (self.mtu + 64), rate_bytes * 0.01))
        links = ([(self.switch_ns, f"p{i}") for i in range(self.n)]
                 + [(ns, IFNAME) for ns in self.worker_ns])
        for ns, ifname in links:
            with NetNS(ns) as handle:
                index = handle.link_lookup(ifname=ifname)[0]
                handle.tc("add" if first else "replace", "tbf", index=index, handle="1:",
                          rate=f"{int(link_mbit * 1000)}kbit", burst=burst, limit=limit)
        self.link_mbit = link_mbit

    def set_uplink_rate(self, uplink_mbit: float, first: bool = False) -> None:
        """Shape every rack's uplink (both directions) to ``uplink_mbit`` with tbf."""
        if not self.racks or not uplink_mbit > 0:
            raise ValueError(f"uplinks need racks and a positive rate, got {uplink_mbit}")
        rate_bytes = uplink_mbit * 1e6 / 8
        burst = (self.burst_bytes if self.burst_bytes is not None
                 else int(max(4 * (self.mtu + 64), rate_bytes * 1e-3)))
        limit = int(max(16 * (self.mtu + 64), rate_bytes * 0.01))
        with NetNS(self.switch_ns) as sw:
            for r in range(1, self.racks + 1):
                for end in (f"u{r}", f"v{r}"):
                    sw.tc("add" if first else "replace", "tbf",
                          index=sw.link_lookup(ifname=end)[0], handle="1:",
                          rate=f"{int(uplink_mbit * 1000)}kbit", burst=burst, limit=limit)
        self.uplink_mbit = uplink_mbit

    def set_loss(self, probability: float, udp_port: int | None = None) -> None:
        """Drop each IPv4 packet (or, with ``udp_port``, each UDP packet to or from that
        port) with ``probability`` on every worker's uplink and downlink."""
        if not 0 <= probability < 1:
            raise ValueError(f"loss must be in [0, 1), got {probability}")
        cut = round(probability * 1_000_000)
        rule = f"numgen random mod 1000000 < {cut} counter drop"
        up, down = ((f"udp dport {udp_port}", f"udp sport {udp_port}") if udp_port
                    else ("ether type ip", "ether type ip"))
        for ns in self.worker_ns:
            self._nft(ns, f"delete table netdev {LOSS_TABLE}", check=False)
            if cut:
                self._nft(ns, f"table netdev {LOSS_TABLE} {{\n"
                          f"  chain up {{ type filter hook egress device \"{IFNAME}\" "
                          f"priority 0; {up} {rule}; }}\n"
                          f"  chain down {{ type filter hook ingress device \"{IFNAME}\" "
                          f"priority 0; {down} {rule}; }}\n}}\n")
        self.loss = probability

    def dropped(self) -> int:
        """Packets the loss rules have dropped so far."""
        total = 0
        for ns in self.worker_ns:
            out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "netdev",
                                  LOSS_TABLE], capture_output=True, text=True, timeout=30)
            total += sum(int(line.split("counter packets")[1].split()[0])
                         for line in out.stdout.splitlines() if "counter packets" in line)
        return total

    @staticmethod
    def _nft(ns: str, script: str, check: bool = True) -> None:
        proc = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                              capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise RuntimeError(f"nft failed in {ns} ({proc.returncode}): "
                               f"{proc.stderr.strip()}; is the nftables package installed? "
                               f"(apt-get install nftables)")

    def set_tcp_rto_min(self, ms: float) -> None:
        """TCP's smallest retransmission timeout on the workers' subnet route (Linux: 200
        ms by default). MPI's and gloo's messages use TCP across the same lossy links; a
        lost segment of a small message waits this long."""
        for ns in self.worker_ns:
            subprocess.run(["ip", "-n", ns, "route", "replace", f"{SUBNET}.0/24", "dev",
                            IFNAME, "proto", "kernel", "scope", "link", "rto_min",
                            f"{ms:g}ms"], check=True, capture_output=True, timeout=30)

    # -- running -------------------------------------------------------------------------

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
                        workers: Sequence[int] | None = None,
                        options: Sequence[str] = ()) -> list[str]:
        """One MPMD mpiexec line: rank r runs ``command`` in the namespace of worker
        ``workers[r]`` (default: every worker, rank i in namespace i)."""
        workers = range(self.n) if workers is None else workers
        return mpiexec_line(mpiexec, command, namespaces=[self.worker_ns[i] for i in workers],
                            options=options)

    def run_job(self, mpiexec: str, command: Sequence[str], env: dict[str, str],
                limit: float, cwd: str | os.PathLike = ROOT,
                workers: Sequence[int] | None = None) -> tuple[int | None, str]:
        """Run ``command`` as one mpiexec job over the workers' namespaces
        (``mpiexec_command``), its output merged; (exit code, output), or (None, output)
        if it ran past ``limit`` seconds: then its whole process group is killed."""
        return run_group(self.mpiexec_command(mpiexec, command, workers), env, limit, cwd)

    def job_record(self, mpiexec: str, command: Sequence[str], env: dict[str, str],
                   limit: float, record: Path, what: str, cwd: str | os.PathLike = ROOT
                   ) -> Any:
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
        """Variables that make MPICH and gloo use the fabric's links, not shared memory;
        gloo's rendezvous at the job's first worker."""
        return {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                "FI_TCP_IFACE": IFNAME, "GLOO_SOCKET_IFNAME": IFNAME,
                "MASTER_ADDR": worker_ip(first_worker)}

    # -- packets by hand -----------------------------------------------------------------

    def udp_socket(self, worker: int, port: int) -> socket.socket:
        """A UDP socket in worker ``worker``'s namespace, bound to its address and ``port``."""
        with in_namespace(self.worker_ns[worker]):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((worker_ip(worker), port))
        s.settimeout(5)
        return s

    def capture(self, worker: int) -> socket.socket:
        """A raw socket on the switch's port towards ``worker``: every frame it sends."""
        with in_namespace(self.switch_ns):
            # ETH_P_ALL: a tap sees a bridge port's frames before the bridge takes them
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            s.bind((f"p{worker}", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.setblocking(False)
        return s

    def inject(self, worker: int, frames: Sequence[bytes]) -> None:
        """Send whole Ethernet frames out of ``worker``'s interface, towards the switch."""
        with in_namespace(self.worker_ns[worker]):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        try:
            s.bind((IFNAME, 0))
            for frame in frames:
                s.send(frame)
        finally:
            s.close()
