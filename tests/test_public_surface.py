"""The public surface: what a user imports is there, documented, and says what it is;
every error is an InaError; the console scripts resolve. Checked from the package as
installed, in this process (no MPI job: importing the array API never starts MPI)."""
from __future__ import annotations

import configparser
import importlib
import inspect

import pytest

from tests.conftest import ROOT

PUBLIC = {
    "ina_collectives": ["init", "finalize", "allreduce", "stats", "summary", "set_quorum",
                        "Op", "SUM", "AVERAGE", "Settings", "InaError"],
    "ina_collectives.mpi": ["Intracomm"],
    "ina_collectives.errors": ["InaError", "AgreementError", "CollectiveTimeout",
                               "CommunicatorBroken", "AggregatorUnavailable",
                               "OperationError"],
    "ina_collectives.switch": ["SoftwareSwitch", "send_faults", "main"],
    "ina_collectives.control": ["Controller", "JobSpec", "Worker"],
}
TORCH = {
    "ina_collectives.torch": ["init", "allreduce", "allreduce_async", "synchronize",
                              "grouped_allreduce", "allgather", "broadcast", "alltoall",
                              "reducescatter", "broadcast_parameters",
                              "DistributedOptimizer", "Compression", "Average", "Sum",
                              "size", "rank", "local_rank", "join", "ProcessSet"],
    "ina_collectives.torch.distributed": ["BACKEND", "ProcessGroupIna", "stats"],
}


def _check(module_name: str, names: list[str]) -> None:
    module = importlib.import_module(module_name)
    assert module.__doc__, f"{module_name} has no docstring"
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{module_name} declares no __all__"
    assert not [n for n in exported if n.startswith("_")], exported
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{module_name}.__all__ names {missing}, which it lacks"
    assert set(names) <= set(exported), sorted(set(names) - set(exported))
    undocumented = [n for n in exported if (inspect.isfunction(getattr(module, n))
                                            or inspect.isclass(getattr(module, n)))
                    and not inspect.getdoc(getattr(module, n))]
    assert not undocumented, f"{module_name}: no docstring on {undocumented}"


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_modules_export_what_users_import(module_name):
    _check(module_name, PUBLIC[module_name])


@pytest.mark.parametrize("module_name", sorted(TORCH))
def test_the_torch_binding_exports_horovods_names(module_name):
    pytest.importorskip("torch")
    _check(module_name, TORCH[module_name])


def test_every_exception_is_an_ina_error_and_the_top_level_reexports_them():
    import ina_collectives
    from ina_collectives import errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert classes and all(issubclass(c, errors.InaError) for c in classes)
    for name in ("AgreementError", "CollectiveTimeout", "CommunicatorBroken",
                 "AggregatorUnavailable", "OperationError"):
        assert getattr(ina_collectives, name) is getattr(errors, name)


def test_the_console_scripts_resolve_to_their_mains():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in
                   config["options.entry_points"]["console_scripts"].strip().splitlines())
    assert set(scripts) == {"ina-run", "ina-switch"}
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
