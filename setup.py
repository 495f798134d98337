"""Build the Cython hot loops in _fast/ into the package as ina_collectives._fast.*.

Flags are portable (-O3, no -march=native) so a wheel built here runs on any x86-64;
INA_BUILD_OPT replaces -O3 (INA_BUILD_OPT=-O0: a build four times quicker, for a build
that is only checked, as tests/test_packaging.py does, or debugged).
-fno-math-errno lets gcc vectorize the libm calls of the kernels (no libm errno is read;
the socket calls' errno is unaffected). loadgen.pyx is bench/'s: bench/ceilings/loadgen_build.py.
"""
import os
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
FAST = HERE / "_fast"
shared = [str(p.relative_to(HERE)) for pattern in ("*.h", "*.pxd", "*.pxi")
          for p in sorted(FAST.glob(pattern))]
extensions = [
    Extension(
        f"ina_collectives._fast.{src.stem}",
        [str(src.relative_to(HERE))],
        include_dirs=[numpy.get_include(), "_fast"],
        depends=shared,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), ("_GNU_SOURCE", None)],
        extra_compile_args=[os.environ.get("INA_BUILD_OPT", "-O3"), "-fno-math-errno"],
    )
    for src in sorted(FAST.glob("*.pyx"))
    if src.stem != "loadgen"  # the benchmarks' tool: bench/ceilings/loadgen_build.py builds it
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["_fast"],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True,
                             "initializedcheck": False},
    ),
)
