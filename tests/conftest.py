"""Fixtures shared by the test modules.

Tests that launch multi-rank jobs (mpiexec, ina-run) carry the ``mpi`` marker, so that
``pytest -m "not mpi"`` runs the unit tests alone in seconds; ``make test`` runs all.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterator

import pytest

from ina_collectives.ina import kernels as kernel_module
from ina_collectives.switch import send_faults
from ina_collectives.switch.embedded import EmbeddedSwitch, embedded_switch

BACKENDS = ["fast", "numpy"]

# Network namespaces, veths and nftables: root, and the nft command.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None,
    reason="needs root and nftables (network namespaces, shaped links, loss rules)")


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
