"""Benchmarks that need several ranks run under mpiexec (python -m bench.micro); only rank 0
reports and saves, the other ranks run the same rounds silently."""
from __future__ import annotations

import os

import pytest


def _rank() -> int:
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def pytest_cmdline_main(config):
    # Before any plugin's pytest_configure: pytest-benchmark's session reads the options
    # there. Cleared later, every rank wrote the same --benchmark-json file at once (seen:
    # two reports interleaved into one invalid file).
    if _rank() != 0:
        config.option.benchmark_json = None
        config.option.benchmark_autosave = False
        config.option.benchmark_save = None


@pytest.hookimpl(trylast=True)  # after the terminal reporter has registered itself
def pytest_configure(config):
    if _rank() != 0:
        # pytest writes the report through a copy of the original stdout taken at
        # start-up, so redirecting fd 1 is not enough: the reporter itself must go.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
