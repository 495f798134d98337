"""One error tree: every exception the library defines derives from InaError, each keeps
the builtin base its callers catch, and no module defines its own root. The compiled
modules' stubs name what the modules export."""
from __future__ import annotations

import ast
import errno
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import ina_collectives
from ina_collectives import errors


def test_every_error_is_an_ina_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert len(classes) >= 10
    assert all(issubclass(c, errors.InaError) for c in classes), classes


@pytest.mark.parametrize("cls, builtin", [
    (errors.AgreementError, ValueError), (errors.CollectiveTimeout, TimeoutError),
    (errors.AggregatorUnavailable, ConnectionError), (errors.SystemCallError, OSError),
    (errors.InaError, RuntimeError), (errors.TargetUnavailable, errors.ControlError),
])
def test_each_keeps_the_builtin_base_callers_catch(cls, builtin):
    assert issubclass(cls, builtin)


def test_a_failed_system_call_carries_errno_and_says_why():
    exc = errors.SystemCallError(errno.ECONNREFUSED, "sendto 127.0.0.1:47474")
    assert exc.errno == errno.ECONNREFUSED
    assert str(exc) == "[Errno 111] Connection refused: sendto 127.0.0.1:47474"


def _modules():
    for info in pkgutil.walk_packages(ina_collectives.__path__, "ina_collectives."):
        if info.name.endswith("__main__") or info.name == errors.__name__:
            continue
        yield importlib.import_module(info.name)


def test_no_module_defines_an_exception_outside_errors():
    found = []
    for module in _modules():
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found.append(f"{module.__name__}.{name}")
    assert found == []
    # The P4Runtime service's error is its answer to a client, under ControlError.
    assert issubclass(errors.P4RuntimeError, errors.ControlError)


@pytest.mark.parametrize("name", ["blockfp", "packet", "transport", "switch_loop"])
def test_each_compiled_module_has_a_stub_naming_its_api(name):
    module = importlib.import_module(f"ina_collectives._fast.{name}")
    stub = Path(module.__file__).with_name(f"{name}.pyi")
    tree = ast.parse(stub.read_text())
    declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    declared |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n, v in vars(module).items()
              if not n.startswith("_") and not inspect.ismodule(v)
              and getattr(v, "__module__", module.__name__) == module.__name__}
    assert public <= declared, sorted(public - declared)
