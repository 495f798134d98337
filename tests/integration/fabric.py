"""A switch and its workers in network namespaces, the aggregator either the software
switch (``ina-switch``) or the P4 program on BMv2, configured alike by the project's
controller over P4Runtime. The switch-behaviour tests run the same body on both.

    with Fabric("bmv2", n=4, k=8, slots=64, block=4, value_bits=32) as fabric:
        job = fabric.job(7, workers=[0, 1])          # installed through P4Runtime
        results = fabric.run(job, "ina_cases", params)

Worker i lives in ``<prefix>-w<i>``: one interface ``ina0`` with 10.198.0.<i+1> and a
fixed MAC, a veth whose other end, ``p<i>``, is in ``<prefix>-sw``: a bridge port with
the switch's address (software) or BMv2's port i + 1 (bmv2). The workers reach the
switch's address through a static neighbour entry (BMv2 answers no ARP), and the MPI
ranks talk to each other over shared memory, so only INA traffic crosses the switch.
The controller in the test process reaches the P4Runtime server over a management veth
(10.197.0.1 here, 10.197.0.2 in the switch's namespace). Everything is removed on exit,
after errors too; namespaces a killed run left behind are removed first.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from pyroute2 import IPRoute, NetNS, netns

from bench import bmv2
from ina_collectives import protocol as P
from ina_collectives.control import Controller, JobSpec, Worker
from ina_collectives.control import schema as S
from tests.integration import mpirun

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.198.0"
SWITCH_IP = f"{SUBNET}.254"
SWITCH_MAC = "02:1a:00:00:00:fe"
MGMT_HOST, MGMT_SWITCH = "10.197.0.1", "10.197.0.2"
GRPC_PORT = 9559
WORKER_PORT = 41000  # each worker namespace has its own port space
PREFIX = "inafab"
KINDS = ("software", "bmv2")


def worker_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def worker_mac(i: int) -> str:
    return f"02:1a:00:00:00:{i + 1:02x}"


def remove_stale() -> None:
    """Namespaces of fabrics whose process is gone (a killed test run)."""
    for name in netns.listnetns():
        head = name.split("-")[0]
        if head.startswith(PREFIX) and head[len(PREFIX):].isdigit():
            if not os.path.exists(f"/proc/{head[len(PREFIX):]}"):
                try:
                    netns.remove(name)
                except OSError:
                    pass


class Fabric:
    _made = 0

    def __init__(self, kind: str, n: int, k: int, slots: int, block: int, value_bits: int,
                 log_dir: Path | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.n = kind, n
        self.k, self.slots, self.block, self.value_bits = k, slots, block, value_bits
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.switch_ns = f"{self.prefix}-sw"
        self.worker_ns = [f"{self.prefix}-w{i}" for i in range(n)]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ina-fabric-"))
        self._created: list[str] = []
        self._process: subprocess.Popen | None = None
        self._bmv2: bmv2.Bmv2Switch | None = None
        self._owner = os.getpid()
        # veth names live briefly in this namespace: unique per fabric, <= 15 chars.
        Fabric._made += 1
        self._tag = f"fb{os.getpid() % 100_000}{Fabric._made % 100:02d}"
        if kind == "bmv2":
            build = bmv2.compile_build(k, slots, block, value_bits)
            self.p4info, self.device_config = build.p4info, build.json
        else:
            self.p4info = self.log_dir / "ina.p4info.txt"
            self.p4info.write_text(S.p4info_text(k, slots, block, value_bits))
            self.device_config = self.log_dir / "ina.json"
            self.device_config.write_bytes(b"software switch: no device config needed")

    # -- lifetime ------------------------------------------------------------------------

    def __enter__(self) -> "Fabric":
        remove_stale()
        try:
            self._build()
            self.start_switch()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if os.getpid() != self._owner:
            return
        self.kill_switch()
        with IPRoute() as ipr:  # the management veth's end here (its peer goes with it)
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

    def _build(self) -> None:
        tag = self._tag
        for name in [self.switch_ns, *self.worker_ns]:
            netns.create(name)
            self._created.append(name)
        with IPRoute() as ipr:
            ipr.link("add", ifname=f"{tag}m", kind="veth", peer={"ifname": f"{tag}n"})
            ipr.link("set", index=ipr.link_lookup(ifname=f"{tag}n")[0],
                     net_ns_fd=self.switch_ns)
            host = ipr.link_lookup(ifname=f"{tag}m")[0]
            ipr.addr("add", index=host, address=MGMT_HOST, prefixlen=30)
            ipr.link("set", index=host, state="up")
            for i, ns in enumerate(self.worker_ns):
                ipr.link("add", ifname=f"{tag}p{i}", kind="veth",
                         peer={"ifname": f"{tag}h{i}"})
                ipr.link("set", index=ipr.link_lookup(ifname=f"{tag}p{i}")[0],
                         net_ns_fd=self.switch_ns)
                ipr.link("set", index=ipr.link_lookup(ifname=f"{tag}h{i}")[0], net_ns_fd=ns)
        with NetNS(self.switch_ns) as sw:
            sw.link("set", index=sw.link_lookup(ifname="lo")[0], state="up")
            mgmt = sw.link_lookup(ifname=f"{tag}n")[0]
            sw.link("set", index=mgmt, ifname="mgmt", state="up")
            sw.addr("add", index=mgmt, address=MGMT_SWITCH, prefixlen=30)
            if self.kind == "software":
                sw.link("add", ifname="br0", kind="bridge")
                bridge = sw.link_lookup(ifname="br0")[0]
                sw.link("set", index=bridge, address=SWITCH_MAC)
            for i in range(self.n):
                index = sw.link_lookup(ifname=f"{tag}p{i}")[0]
                sw.link("set", index=index, ifname=f"p{i}")
                if self.kind == "software":
                    sw.link("set", index=index, master=bridge)
                sw.link("set", index=index, state="up")
            if self.kind == "software":
                sw.link("set", index=bridge, state="up")
                sw.addr("add", index=bridge, address=SWITCH_IP, prefixlen=24)
        for i, ns in enumerate(self.worker_ns):
            with NetNS(ns) as host:
                index = host.link_lookup(ifname=f"{tag}h{i}")[0]
                host.link("set", index=index, ifname="ina0", address=worker_mac(i))
                host.link("set", index=index, state="up")
                host.addr("add", index=index, address=worker_ip(i), prefixlen=24)
                host.link("set", index=host.link_lookup(ifname="lo")[0], state="up")
                host.neigh("add", dst=SWITCH_IP, lladdr=SWITCH_MAC, ifindex=index,
                           state=0x80)  # NUD_PERMANENT

    # -- the aggregator ------------------------------------------------------------------

    @property
    def p4runtime_address(self) -> str:
        return f"{MGMT_SWITCH}:{GRPC_PORT}"

    @property
    def switch_address(self) -> str:
        return f"{SWITCH_IP}:{P.UDP_PORT}"

    @property
    def switch_pid(self) -> int:
        return self._bmv2.pid if self._bmv2 is not None else self._process.pid

    def start_switch(self) -> None:
        """Start the aggregator (again): it holds no job until a controller installs one."""
        log = self.log_dir / f"{self.kind}.log"
        if self.kind == "bmv2":
            self._bmv2 = bmv2.Bmv2Switch(self.switch_ns, {i + 1: f"p{i}" for i in range(self.n)},
                                         f"{MGMT_SWITCH}:{GRPC_PORT}", log=log)
            self._bmv2.start()
            return
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                ["ip", "netns", "exec", self.switch_ns, sys.executable, "-m",
                 "ina_collectives.switch", "--host", "0.0.0.0", "--port", str(P.UDP_PORT),
                 "--threads", "1", "--p4runtime-port", str(GRPC_PORT),
                 "--p4runtime-host", "0.0.0.0",
                 "--max-elements", str(max(self.k, 64))],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        bmv2.wait_listening(self._process, self.switch_ns, self.p4runtime_address,
                            "ina-switch", log=log)

    def switch_running(self) -> bool:
        process = self._bmv2.process if self._bmv2 is not None else self._process
        return process is not None and process.poll() is None

    def kill_switch(self) -> None:
        """SIGKILL the aggregator, as a crash."""
        if self._bmv2 is not None:
            self._bmv2.kill()
            self._bmv2 = None
        if self._process is not None:
            if self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None

    @contextmanager
    def controller(self, push: str = "if-needed") -> Iterator[Controller]:
        with Controller(self.p4runtime_address, self.p4info, self.device_config,
                        push=push, timeout=10) as c:
            yield c

    # -- jobs and ranks ------------------------------------------------------------------

    def job(self, job_id: int, workers: Sequence[int], slots: int = 8,
            slot_base: int = 0) -> JobSpec:
        """The job of the given worker namespaces (rank r in namespace workers[r])."""
        return JobSpec(job_id, [Worker(worker_ip(i), WORKER_PORT + r, worker_mac(i), i + 1)
                                for r, i in enumerate(workers)], slots, slot_base)

    def configure(self, job: JobSpec, push: str = "if-needed") -> None:
        with self.controller(push) as c:
            c.configure(job)

    def env(self, job: JobSpec) -> dict[str, str]:
        """What the ranks of an installed job are told (as ina-run tells them)."""
        env = {"INA_SWITCH": self.switch_address, "INA_JOB": str(job.job_id),
               "INA_WORKER_PORTS": ",".join(str(w.udp_port) for w in job.workers),
               "INA_SWITCH_ELEMENTS": str(self.k), "INA_SWITCH_BLOCK": str(self.block),
               "INA_SWITCH_VALUE_BITS": str(self.value_bits),
               "INA_SWITCH_SLOTS": str(job.slots)}
        if self.kind == "bmv2":  # BMv2 takes a segmented batch as one frame (PITFALLS)
            env["INA_SWITCH_GSO"] = "0"
        return env

    def namespaces_of(self, job: JobSpec) -> list[str]:
        return [self.worker_ns[w.switch_port - 1] for w in job.workers]

    def run(self, job: JobSpec, case: str, params: dict[str, Any], *,
            env: dict[str, str] | None = None, timeout: float = 180.0,
            **kwargs: Any) -> list[Any]:
        """tests/integration/rank_cases.py's ``case`` on the job's ranks, each in its namespace."""
        return mpirun.run(len(job.workers), case, params, env={**self.env(job), **(env or {})},
                          timeout=timeout, namespaces=self.namespaces_of(job), **kwargs)

    # -- the links -----------------------------------------------------------------------

    def set_loss(self, probability: float) -> None:
        """Drop this share of INA packets on every worker's link, each way (nftables on
        the workers' interfaces: egress = uplink, ingress = downlink)."""
        cut = round(probability * 1_000_000)
        for ns in self.worker_ns:
            self._nft(ns, "delete table netdev inaloss", check=False)
            if cut:
                rule = f"numgen random mod 1000000 < {cut} counter drop"
                self._nft(ns, "table netdev inaloss {\n"
                          f"  chain up {{ type filter hook egress device \"ina0\" priority 0; "
                          f"udp dport {P.UDP_PORT} {rule}; }}\n"
                          f"  chain down {{ type filter hook ingress device \"ina0\" priority 0; "
                          f"udp sport {P.UDP_PORT} {rule}; }}\n}}\n")

    def dropped(self) -> int:
        """Packets the loss rules dropped so far."""
        total = 0
        for ns in self.worker_ns:
            out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "netdev",
                                  "inaloss"], capture_output=True, text=True)
            total += sum(int(line.split("counter packets")[1].split()[0])
                         for line in out.stdout.splitlines() if "counter packets" in line)
        return total

    @staticmethod
    def _nft(ns: str, script: str, check: bool = True) -> None:
        proc = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                              capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"nft failed in {ns}: {proc.stderr.strip()}")

    def udp_socket(self, worker: int, port: int) -> socket.socket:
        """A UDP socket in worker ``worker``'s namespace, bound to its address and ``port``."""
        with bmv2.in_namespace(self.worker_ns[worker]):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((worker_ip(worker), port))
        s.settimeout(5)
        return s

    def capture(self, worker: int) -> socket.socket:
        """A raw socket on the switch's port towards ``worker``: every frame it sends."""
        with bmv2.in_namespace(self.switch_ns):
            # ETH_P_ALL: a tap sees a bridge port's frames before the bridge takes them
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            s.bind((f"p{worker}", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.setblocking(False)
        return s

    def inject(self, worker: int, frames: Sequence[bytes]) -> None:
        """Send whole Ethernet frames out of ``worker``'s interface, towards the switch."""
        with bmv2.in_namespace(self.worker_ns[worker]):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        try:
            s.bind(("ina0", 0))
            for frame in frames:
                s.send(frame)
        finally:
            s.close()
