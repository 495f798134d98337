"""A switch and its workers on the namespace fabric (ina_collectives/testing/fabric.py),
the aggregator either the software switch (``ina-switch``) or the P4 program on BMv2,
configured alike by the project's controller over P4Runtime. The switch-behaviour tests
run the same body on both.

    with Fabric("bmv2", n=4, k=8, slots=64, block=4, value_bits=32) as fabric:
        job = fabric.job(7, workers=[0, 1])          # installed through P4Runtime
        results = fabric.run(job, rank_cases.ina_cases, params)

Worker i's interface ``ina0`` faces port ``p<i>`` in the switch's namespace: a bridge
port under the switch's address (software) or BMv2's port i + 1 (bmv2). The MPI ranks
talk to each other over shared memory, so only INA traffic crosses the switch, and the
loss rules drop INA packets alone. The controller in the test process reaches the
P4Runtime server over the fabric's management veth.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from ina_collectives import protocol as P
from ina_collectives.control import Controller, JobSpec, Parent, Worker
from ina_collectives.control import schema as S
from ina_collectives.testing import bmv2
from ina_collectives.testing import fabric as namespaces
from ina_collectives.testing.fabric import SWITCH_IP, worker_ip, worker_mac
from ina_collectives.testing.jobs import child_env
from tests.integration import mpirun

__all__ = ["Fabric", "KINDS", "SWITCH_IP"]

GRPC_PORT = 9559
WORKER_PORT = 41000  # each worker namespace has its own port space
KINDS = ("software", "bmv2")


class Fabric(namespaces.Fabric):
    def __init__(self, kind: str, n: int, k: int, slots: int, block: int, value_bits: int,
                 log_dir: Path | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        super().__init__(n, bridge=kind == "software", management=True)
        self.kind = kind
        self.k, self.slots, self.block, self.value_bits = k, slots, block, value_bits
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ina-fabric-"))
        self._process: subprocess.Popen | None = None
        self._bmv2: bmv2.Bmv2Switch | None = None
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
        super().__enter__()
        try:
            self.start_switch()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if os.getpid() == self._owner:
            self.kill_switch()
        super().close()

    # -- the aggregator ------------------------------------------------------------------

    @property
    def p4runtime_address(self) -> str:
        return f"{namespaces.MGMT_SWITCH}:{GRPC_PORT}"

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
                                         self.p4runtime_address, log=log)
            self._bmv2.start()
            return
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                self.in_switch([sys.executable, "-m", "ina_collectives.switch", "--host",
                                "0.0.0.0", "--port", str(P.UDP_PORT), "--threads", "1",
                                "--p4runtime-port", str(GRPC_PORT), "--p4runtime-host",
                                "0.0.0.0", "--max-elements", str(max(self.k, 64))]),
                env=child_env(keep_settings=True), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
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

    @contextmanager
    def root(self, worker: int, job_id: int, slots: int) -> Iterator[Parent]:
        """A tree's root above this fabric's aggregator (docs/trees.md): a software switch
        in worker namespace ``worker``, its job ``job_id`` installed by the controller
        (the CLI, run in that namespace) with one worker, the aggregator at its address
        and the INA port; yields the Parent the aggregator's leaf entry names."""
        from ina_collectives.switch.embedded import embedded_switch

        grpc = f"127.0.0.1:{GRPC_PORT + 1}"
        workers = self.log_dir / f"root-{job_id}-workers.json"
        workers.write_text(json.dumps([{"ip": SWITCH_IP, "udp_port": P.UDP_PORT}]))
        p4info = self.log_dir / "root.p4info.txt"
        p4info.write_text(S.p4info_text(self.k, self.slots, self.block, self.value_bits))
        launcher = ["ip", "netns", "exec", self.worker_ns[worker]]
        with embedded_switch("--p4runtime-port", str(GRPC_PORT + 1), "--p4runtime-host",
                             "127.0.0.1", "--max-elements", str(max(self.k, 64)),
                             host=worker_ip(worker), launcher=launcher) as switch:
            done = subprocess.run(
                [*launcher, sys.executable, "-m", "ina_collectives.control", "configure",
                 "--target", grpc, "--p4info", str(p4info), "--device-config", str(p4info),
                 "--p4-target", "bmv2", "--push", "always", "--job-id", str(job_id),
                 "--workers", str(workers), "--slots", str(slots)],
                env=child_env(keep_settings=True), capture_output=True, text=True,
                timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            yield Parent(worker_ip(worker), switch.port, 0, worker_mac(worker), worker + 1)

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
            env["INA_INTERNAL_SWITCH_GSO"] = "0"
        return env

    def namespaces_of(self, job: JobSpec) -> list[str]:
        return [self.worker_ns[w.switch_port - 1] for w in job.workers]

    def run(self, job: JobSpec, case: mpirun.RankFunction, params: dict[str, Any], *,
            env: dict[str, str] | None = None, timeout: float = 180.0,
            **kwargs: Any) -> list[Any]:
        """The rank function ``case`` (tests/integration/mpirun.py) on the job's ranks,
        each in its namespace."""
        return mpirun.run(len(job.workers), case, params, env={**self.env(job), **(env or {})},
                          timeout=timeout, namespaces=self.namespaces_of(job), **kwargs)

    def set_loss(self, probability: float, udp_port: int | None = P.UDP_PORT) -> None:
        """Drop this share of INA packets on every worker's link, each way."""
        super().set_loss(probability, udp_port)
