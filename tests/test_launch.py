"""ina-run: the job's exit code, the embedded switch's address in the ranks' environment,
and clear errors for a missing command or a malformed switch address (a missing launcher:
tests/test_control.py)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from ina_collectives.switch.embedded import embedded_switch

pytestmark = pytest.mark.mpi

PRINT_SWITCH = "import os; print('switch=' + os.environ.get('INA_SWITCH', '?'))"


def ina_run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ina_collectives.launch", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_embedded_switch_address_reaches_every_rank_and_exit_code_is_the_jobs():
    proc = ina_run("-np", "2", "--", sys.executable, "-c", PRINT_SWITCH)
    assert proc.returncode == 0, proc.stderr
    # The launcher may interleave the two ranks' lines: find the addresses, not lines.
    seen = re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)
    assert len(seen) == 2 and len(set(seen)) == 1, proc.stdout
    assert "ina-switch 127.0.0.1" in proc.stderr  # its final status line
    failing = ina_run("-np", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert failing.returncode != 0


def test_switch_none_and_an_address():
    none = ina_run("-np", "1", "--switch", "none", "--", sys.executable, "-c", PRINT_SWITCH)
    assert none.returncode == 0 and "switch=\n" in none.stdout + "\n", none.stdout
    with embedded_switch() as switch:
        given = ina_run("-np", "1", "--switch", switch.address_text, sys.executable, "-c",
                        PRINT_SWITCH)
    assert given.returncode == 0, given.stderr
    assert f"switch={switch.address_text}" in given.stdout
    # Nothing listens on a port a closed socket had: ina-run names the address.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    missing = ina_run("-np", "1", "--switch", dead, sys.executable, "-c", PRINT_SWITCH)
    assert f"aggregator at {dead} did not answer" in missing.stderr, missing.stderr


@pytest.mark.parametrize("args, words", [
    (["-np", "2"], "no command to run"),
    (["-np", "0", "true"], "-np must be at least 1"),
    (["-np", "2", "--switch", "127.0.0.1:notaport", "true"], "is not a number"),
])
def test_clear_errors(args, words):
    proc = ina_run(*args)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_ina_run_never_initialises_mpi_itself():
    """The launcher starts MPI jobs; it must not be one (importing mpi4py.MPI runs
    MPI_Init, which aborts where MPI's network settings do not apply). Run it with that
    import made to fail: the embedded switch, the controller and the ranks all work."""
    code = (
        "import sys\n"
        "class NoMPI:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mpi4py.MPI':\n"
        "            raise ImportError('the launcher imported mpi4py.MPI')\n"
        "sys.meta_path.insert(0, NoMPI())\n"
        "from ina_collectives.launch import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "-np", "2", "--", sys.executable,
                           "-c", PRINT_SWITCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)) == 2, proc.stdout
