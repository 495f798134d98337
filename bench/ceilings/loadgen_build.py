"""The benchmarks' load generator (_fast/loadgen.pyx), built on first use.

It is a tool of bench/, not of the library, so the package does not ship it: the first
benchmark that needs it compiles it into bench/_build/ (again whenever its sources are
newer), with the same Cython and flags as setup.py. Needs the bench extra (cython).
"""
from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1]
FAST = BENCH.parent / "_fast"
BUILD = BENCH / "_build"
NAME = "ina_loadgen"
# Everything loadgen.pyx includes or cimports: a change to any of them rebuilds it.
SOURCES = ("loadgen.pyx", "netio.pxd", "byteorder.pxd", "header.pxi", "syscall.pxi",
           "udp_batch.h", "udp_batch.pxd")


def _built() -> Path | None:
    """The module built for this Python, if it is newer than its sources."""
    path = BUILD / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not path.is_file():
        return None
    newest_source = max((FAST / s).stat().st_mtime for s in SOURCES)
    return path if path.stat().st_mtime >= newest_source else None


def build() -> Path:
    """Compile the load generator if it is missing or stale; the path of the module."""
    path = _built()
    if path is not None:
        return path
    import numpy
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    # setup.py's macros, flags and directives
    ext = Extension(NAME, [str(FAST / "loadgen.pyx")],
                    include_dirs=[numpy.get_include(), str(FAST)],
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                                   ("_GNU_SOURCE", None)],
                    extra_compile_args=["-O3", "-fno-math-errno"])
    modules = cythonize([ext], include_path=[str(FAST)], build_dir=str(BUILD / "c"),
                        language_level=3, quiet=True, force=True,  # _built() found it stale
                        compiler_directives={"boundscheck": False, "wraparound": False,
                                             "cdivision": True, "initializedcheck": False})
    command = Distribution({"ext_modules": modules}).get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(BUILD), str(BUILD / "tmp")
    command.force = True
    command.ensure_finalized()
    command.run()
    path = _built()
    if path is None:
        raise RuntimeError(f"building {NAME} left no module in {BUILD}")
    return path


def load() -> ModuleType:
    """The load generator module, built first if needed."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, build())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


if __name__ == "__main__":
    print(build())
