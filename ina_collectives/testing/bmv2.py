"""The P4 program on BMv2: find the toolchain, compile a build (cached), run the switch.

    tools = find_tools()                     # None, with missing_tools() saying why
    build = compile_build(k=8, slots=64, block=4, value_bits=32)   # p4info, json
    with Bmv2Switch(namespace, ports={1: "p0", 2: "p1"}, grpc="10.197.0.2:9559") as sw:
        ...                                  # configure it with ina_collectives.control

The tools are p4c's BMv2 back end (``p4c-bm2-ss``) and ``simple_switch_grpc`` (BMv2 with
P4Runtime). They are looked for on PATH, then in ``$P4TOOLS_DIR`` (default
``/opt/p4tools``, where ``../shared/p4-toolchain/build.sh`` installs them). This module
only runs them; it holds none of their code. A build is the program ``p4/gen.py`` writes
for (K, S, B, V); it is compiled once per text of the program and p4c version, into
``$INA_P4_CACHE`` (default ``~/.cache/ina-collectives/p4``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .jobs import child_env

ROOT = Path(__file__).resolve().parents[2]  # the checkout: p4/gen.py writes the program
COMPILER, SWITCH = "p4c-bm2-ss", "simple_switch_grpc"


def tools_dir() -> Path:
    return Path(os.environ.get("P4TOOLS_DIR", "/opt/p4tools"))


@dataclass(frozen=True)
class Tools:
    compiler: str
    switch: str
    env: Mapping[str, str]  # what running them needs (the toolchain's lib on the loader path)


def find_tools() -> Tools | None:
    """The compiler and the switch, or None where either is missing."""
    env = dict(os.environ)
    found = {name: shutil.which(name) for name in (COMPILER, SWITCH)}
    if not all(found.values()):
        base = tools_dir()
        for name in found:
            candidate = base / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                found[name] = str(candidate)
        lib = base / "lib"
        if lib.is_dir():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    if not all(found.values()):
        return None
    return Tools(found[COMPILER], found[SWITCH], env)


def missing_tools() -> str:
    """Why find_tools() found nothing: one line for a skip reason."""
    return (f"needs p4c ({COMPILER}) and BMv2 ({SWITCH}) on PATH or in "
            f"{tools_dir()}/bin (build them with ../shared/p4-toolchain/build.sh, or set "
            f"P4TOOLS_DIR)")


def _generator():
    spec = importlib.util.spec_from_file_location("ina_p4_gen", ROOT / "p4" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Build:
    k: int
    slots: int
    block: int
    value_bits: int
    p4info: Path
    json: Path


_compile_lock = threading.Lock()


def compile_build(k: int, slots: int, block: int, value_bits: int,
                  tools: Tools | None = None, cache: Path | None = None) -> Build:
    """p4c-bm2-ss on the program gen.py writes for (K, S, B, V): its JSON and P4Info,
    reused while the program's text and the compiler are the same."""
    tools = tools or find_tools()
    if tools is None:
        raise FileNotFoundError(missing_tools())
    source = _generator().program(k, slots, block, value_bits)
    version = subprocess.run([tools.compiler, "--version"], env=tools.env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    key = hashlib.sha256(f"{version}\n{source}".encode()).hexdigest()[:20]
    cache = cache or Path(os.environ.get("INA_P4_CACHE",
                                         Path.home() / ".cache" / "ina-collectives" / "p4"))
    where = cache / f"k{k}-s{slots}-b{block}-v{value_bits}-{key}"
    build = Build(k, slots, block, value_bits, where / "ina_aggregator.p4info.txt",
                  where / "ina_aggregator.json")
    with _compile_lock:
        if build.json.is_file() and build.p4info.is_file():
            return build
        work = where.with_name(where.name + f".tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        program = work / "ina_aggregator.p4"
        program.write_text(source)
        proc = subprocess.run([tools.compiler, "--arch", "v1model",
                               "-o", str(work / build.json.name),
                               "--p4runtime-files", str(work / build.p4info.name),
                               str(program)],
                              env=tools.env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{COMPILER} failed on the build K {k}, S {slots}, B {block}, "
                               f"V {value_bits} ({program}):\n{proc.stderr[-4000:]}")
        shutil.rmtree(where, ignore_errors=True)
        work.rename(where)
    return build


def wait_listening(process: subprocess.Popen, namespace: str, address: str, what: str,
                   timeout: float = 30.0, log: Path | None = None) -> None:
    """Wait, at most ``timeout`` seconds, until ``process`` takes TCP connections at
    ``address`` (HOST:PORT in ``namespace``); an error naming ``what`` if it exits first
    or the bound passes."""
    from .fabric import in_namespace

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    where = f" (log: {log})" if log else ""
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode} at start{where}")
        with in_namespace(namespace):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect((host, int(port)))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} took no gRPC connection at {address} within "
                                   f"{timeout:g} s{where}") from None
            time.sleep(0.1)
        finally:
            probe.close()


class Bmv2Switch:
    """``simple_switch_grpc`` in a network namespace: BMv2 port p on interface
    ``ports[p]``, P4Runtime at ``grpc`` (HOST:PORT, an address in that namespace), no
    program until a controller pushes one. Stopped (SIGKILL after SIGTERM) on exit."""

    def __init__(self, namespace: str, ports: Mapping[int, str], grpc: str,
                 tools: Tools | None = None, device_id: int = 1, log: Path | None = None):
        self.tools = tools or find_tools()
        if self.tools is None:
            raise FileNotFoundError(missing_tools())
        self.namespace, self.ports, self.grpc = namespace, dict(ports), grpc
        self.device_id, self.log = device_id, log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Bmv2Switch":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait (bounded) until its gRPC port takes connections."""
        command = ["ip", "netns", "exec", self.namespace, self.tools.switch,
                   "--device-id", str(self.device_id), "--no-p4"]
        for port, ifname in sorted(self.ports.items()):
            command += ["-i", f"{port}@{ifname}"]
        command += ["--", "--grpc-server-addr", self.grpc]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command, env=self.tools.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if self.log:
                out.close()
        try:
            wait_listening(self.process, self.namespace, self.grpc, SWITCH, timeout, self.log)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL, as a crash: the test's switch death."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass


class OneArmedTarget:
    """BMv2 as an aggregator host on a fabric's bridge (bench.cluster.netsim
    --aggregator bmv2): ``simple_switch_grpc`` in aggregator namespace ``j``, its one port
    the namespace's interface, which keeps no address (the kernel there stays silent).
    The workers reach ``aggregator_ip(j)`` through a static neighbour entry; every result
    leaves by that one port, rewritten per worker, and the bridge delivers it. Each INA
    run pushes its build and installs its job with the project's control CLI, run in
    that namespace (BMv2's P4Runtime listens on its loopback)."""

    GRPC = "127.0.0.1:9559"
    WORKER_PORT = 47100

    def __init__(self, cluster, j: int, ifname: str, address: str, log: Path | None = None):
        from pyroute2 import NetNS

        self.cluster, self.ns, self.address = cluster, cluster.aggregator_ns[j], address
        self.ifname = ifname
        with NetNS(self.ns) as host:
            index = host.link_lookup(ifname=ifname)[0]
            for a in host.get_addr(index=index, family=socket.AF_INET):
                host.addr("del", index=index, address=a.get_attr("IFA_ADDRESS"),
                          prefixlen=a["prefixlen"])
            mac = host.get_links(index)[0].get_attr("IFLA_ADDRESS")
        self.worker_macs = []
        for ns in cluster.worker_ns:
            with NetNS(ns) as host:
                index = host.link_lookup(ifname=ifname)[0]
                self.worker_macs.append(host.get_links(index)[0].get_attr("IFLA_ADDRESS"))
                host.neigh("add", dst=address, lladdr=mac, ifindex=index, state=0x80)
        self.switch = Bmv2Switch(self.ns, {1: ifname}, self.GRPC, log=log)
        self.builds: dict[int, Build] = {}
        self._jobs = 0

    def __enter__(self) -> "OneArmedTarget":
        self.switch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.switch.stop()

    def build(self, value_bits: int) -> Build:
        """The program for ``value_bits``: K 64 (32-bit) or 128 (16-bit), B 32, S 64."""
        if value_bits not in self.builds:
            self.builds[value_bits] = compile_build(2048 // value_bits, 64, 32, value_bits)
        return self.builds[value_bits]

    def _control(self, *args: str) -> str:
        try:
            proc = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-m",
                                   "ina_collectives.control", *args, "--target", self.GRPC],
                                  cwd=ROOT, env=child_env(),
                                  capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"ina_collectives.control {args[0]} on BMv2 at {self.GRPC} "
                               "did not finish within 120 s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"ina_collectives.control {args[0]} on BMv2 failed: "
                               f"{proc.stderr.strip()}")
        return proc.stdout

    def install(self, workers: list[int], value_bits: int, ips: list[str]) -> dict[str, str]:
        """Push the build for ``value_bits`` and install a job of the given worker
        namespaces (rank r in ``workers[r]``, at ``ips[r]``); the ranks' environment."""
        import json
        import tempfile

        build = self.build(value_bits)
        self._jobs += 1
        job_id = 100 + self._jobs
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump([{"ip": ip, "udp_port": self.WORKER_PORT + r, "switch_port": 1,
                        "mac": self.worker_macs[w]}
                       for r, (w, ip) in enumerate(zip(workers, ips))], f)
        try:
            self._control("configure", "--p4info", str(build.p4info), "--device-config",
                          str(build.json), "--push", "always", "--job-id", str(job_id),
                          "--workers", f.name, "--slots", "16")
        finally:
            os.unlink(f.name)
        self.job = job_id
        return {"INA_SWITCH": f"{self.address}:47474", "INA_JOB": str(job_id),
                "INA_WORKER_PORTS": ",".join(str(self.WORKER_PORT + r)
                                             for r in range(len(workers))),
                "INA_SWITCH_ELEMENTS": str(build.k), "INA_SWITCH_BLOCK": str(build.block),
                "INA_SWITCH_VALUE_BITS": str(value_bits), "INA_SWITCH_SLOTS": "16",
                "INA_INTERNAL_SWITCH_GSO": "0"}

    def counters(self) -> str:
        """What the control CLI shows of the target: its drops and installed entries."""
        return self._control("show", "--timeout", "10")
