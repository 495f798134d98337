"""Fixtures and skip conditions shared by the test modules.

Tests that launch a multi-rank job (mpiexec through tests/integration/mpirun.py, or ina-run starting
ranks) carry the ``mpi`` marker, so that ``pytest -m "not mpi"`` runs the tests that need
no launcher alone, in seconds; ``make test`` runs all. A module whose every test launches
sets ``pytestmark = pytest.mark.mpi``; elsewhere each launching test is marked itself. A
test without the marker that calls ``mpirun.run`` or the ``ina_run`` fixture fails,
saying so.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ina_collectives.ina import kernels as kernel_module
from ina_collectives.switch import send_faults
from ina_collectives.switch.embedded import EmbeddedSwitch, embedded_switch
from ina_collectives.testing.jobs import child_env
from tests.integration import mpirun

ROOT = Path(__file__).resolve().parent.parent  # the repository
BACKENDS = ["fast", "numpy"]


# -- skip conditions ---------------------------------------------------------------------

# Network namespaces and veths: root.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (network namespaces, veths, nftables rules)")
# Loss rules: the nft command (make test installs it when run as root).
needs_nft = pytest.mark.skipif(
    shutil.which("nft") is None, reason="needs the nft command (Debian package nftables)")


def _missing(*modules: str) -> str | None:
    """The first of ``modules`` that cannot be imported here, or None."""
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError:  # a parent package is missing
            return name
    return None


def requires(*modules: str, why: str) -> pytest.MarkDecorator:
    """Skip unless every one of ``modules`` is installed; the reason names the missing one."""
    missing = _missing(*modules)
    return pytest.mark.skipif(missing is not None, reason=f"no module {missing}: {why}")


# The controller (p4runtime-shell), the switch's P4Runtime service (grpc) and P4Info
# parsing (p4runtime's protobufs).
needs_p4_extra = requires("grpc", "p4runtime_sh", "p4.config.v1.p4info_pb2",
                          why="needs the p4 extra: pip install 'ina-collectives[p4]'")


# -- the launcher guard ------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _launching_needs_the_mpi_marker(request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``pytest -m "not mpi"`` must not start jobs: a test that does must be marked."""
    if request.node.get_closest_marker("mpi") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} launches a multi-rank job: mark it "
                             f"@pytest.mark.mpi")

    monkeypatch.setattr(mpirun, "run", refuse)


# -- fixtures ------------------------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def kernels(request):
    """Each kernel test runs against the compiled backend and the NumPy reference."""
    return kernel_module.load(request.param)


def _running_switch(**options) -> Iterator[EmbeddedSwitch]:
    with embedded_switch(**options) as sw:
        yield sw
        assert sw.process.poll() is None, f"the switch died: {sw.lines}"
        send_faults((sw.host, sw.port))  # no fault injection left for the next module


@pytest.fixture(scope="module")
def switch() -> Iterator[EmbeddedSwitch]:
    """An ina-switch process on a free loopback port, for one test module."""
    yield from _running_switch()


@pytest.fixture(scope="module")
def p4runtime_switch() -> Iterator[EmbeddedSwitch]:
    """An ina-switch that also serves P4Runtime (jobs installed by a controller)."""
    yield from _running_switch(p4runtime=True)


@pytest.fixture
def faults(switch: EmbeddedSwitch) -> Iterator[Callable[..., None]]:
    """``faults(drop_in=0.1, ...)`` sets the module switch's fault injection (see
    ina_collectives.switch.faults); cleared after the test, whatever its outcome."""
    yield lambda **settings: send_faults((switch.host, switch.port), **settings)
    send_faults((switch.host, switch.port))


def _closed_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def closed_udp_port() -> int:
    """A loopback UDP port that a socket had and closed: nothing listens there."""
    return _closed_port(socket.SOCK_DGRAM)


@pytest.fixture
def closed_tcp_port() -> int:
    """A loopback TCP port that a socket had and closed: nothing listens there."""
    return _closed_port(socket.SOCK_STREAM)


# The name test modules import (tests/launch, tests/integration): the shared helper.
_child_env = child_env


@pytest.fixture
def ina_run(request: pytest.FixtureRequest) -> Callable[..., subprocess.CompletedProcess]:
    """``ina_run(*args, env=None, timeout=120)``: ``python -m ina_collectives.launch
    ARGS`` (ina-run) from the repository, without the caller's INA_* settings; its exit
    code and output. Only for tests marked mpi (ina-run finds mpiexec first of all)."""
    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0
            ) -> subprocess.CompletedProcess:
        if request.node.get_closest_marker("mpi") is None:
            raise AssertionError(f"{request.node.nodeid} runs ina-run: mark it "
                                 f"@pytest.mark.mpi")
        return subprocess.run([sys.executable, "-m", "ina_collectives.launch", *args],
                              cwd=ROOT, env=child_env(env), capture_output=True, text=True,
                              timeout=timeout)
    return run


_BLOCKER = """import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {block!r}):
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, _Block())
"""


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess]:
    """``run_python(code, *args, block=(), env=None, timeout=60)``: ``python -c CODE ARGS``
    in a fresh interpreter from the repository, with the modules (and packages) named in
    ``block`` made to fail on import; its exit code and output."""
    def run(code: str, *args: str, block: tuple[str, ...] = (),
            env: dict[str, str] | None = None, timeout: float = 60.0
            ) -> subprocess.CompletedProcess:
        prelude = _BLOCKER.format(block=tuple(block)) if block else ""
        return subprocess.run([sys.executable, "-c", prelude + code, *args], cwd=ROOT,
                              env=child_env(env), capture_output=True, text=True,
                              timeout=timeout)
    return run
