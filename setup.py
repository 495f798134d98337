"""Build the Cython hot loops in _fast/ into the package as ina_collectives._fast.*.

Flags are portable (-O3, no -march=native) so a wheel built here runs on any x86-64.
"""
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
sources = sorted((HERE / "_fast").glob("*.pyx"))
extensions = [
    Extension(
        f"ina_collectives._fast.{src.stem}",
        [str(src.relative_to(HERE))],
        include_dirs=[numpy.get_include(), "_fast"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for src in sources
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
