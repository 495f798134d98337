"""The package as a user gets it: the sdist holds what the wheel is built from (the Cython
and C sources of the fast path), the wheel built from the sdist carries the compiled
extensions, and in a fresh virtual environment with only the wheel and its dependencies
``import ina_collectives`` and an allreduce on one rank work, through the compiled
kernels. Slow (the wheel compiles the fast path): marked ``slow``, out of ``make check``."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _run(*cmd: str, cwd=None, timeout: float = 600, env=None) -> str:
    """``cmd``, which must succeed; its output. Without the caller's PYTHONPATH: what the
    new environment imports is what it installed (a checkout on the path would win)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_wheel_built_from_the_sdist_installs_and_reduces(tmp_path):
    dist = tmp_path / "dist"
    _run(sys.executable, "setup.py", "-q", "sdist", "-d", str(dist), cwd=ROOT)
    sdist = next(dist.glob("ina_collectives-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for source in ("_fast/transport.pyx", "_fast/wire.pxi", "_fast/udp_batch.h",
                   "setup.py", "pyproject.toml", "README.md"):
        assert source in names, f"the sdist lacks {source}"
    # The wheel built in the unpacked sdist, as pip builds it (here without build
    # isolation: the test environment has Cython, NumPy and setuptools; and compiling
    # two extensions at a time, on this machine's two cores, at -O0: the build is checked
    # here, not its speed; 8 s against 30 s at -O3).
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src", filter="data")
    source = next((tmp_path / "src").iterdir())
    _run(sys.executable, "setup.py", "-q", "build_ext", "-j", "2", "bdist_wheel", "-d",
         str(dist), cwd=source, env=dict(os.environ, INA_BUILD_OPT="-O0"))
    wheel = next(dist.glob("ina_collectives-*.whl"))
    assert "linux_x86_64" in wheel.name or "manylinux" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as zf:
        compiled = {n.split("/")[-1].split(".")[0] for n in zf.namelist() if n.endswith(".so")}
    assert compiled == {"blockfp", "packet", "switch_loop", "transport"}, compiled
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    # The wheel, its dependencies and an MPI (the mpich extra), from the index pip reads.
    _run(python, "-m", "pip", "install", "-q", f"{wheel}[mpich]", timeout=900)
    out = _run(python, "-c",
               "import numpy as np, ina_collectives as ina\n"
               "from ina_collectives.ina import kernels\n"
               "ina.init()\n"
               "x = np.arange(10, dtype=np.float32)\n"
               "y = ina.allreduce(x)\n"
               "assert (y == x).all(), y\n"
               "print(ina.__file__, kernels.BACKEND, ina.stats()['engines'])\n"
               "ina.finalize()\n", cwd=tmp_path)
    where, backend = out.split()[:2]
    assert where.startswith(str(venv)) and backend == "fast", out
