"""Benchmarks that need several ranks run under mpiexec (see bench/mpi.py); only rank 0
reports and saves, the other ranks run the same rounds silently."""
from __future__ import annotations

import os

import pytest


@pytest.hookimpl(trylast=True)  # after the terminal reporter has registered itself
def pytest_configure(config):
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank != 0:
        config.option.benchmark_json = None
        config.option.benchmark_autosave = False
        config.option.benchmark_save = None
        # pytest writes the report through a copy of the original stdout taken at start-up,
        # so redirecting fd 1 is not enough: the reporter itself must go.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
