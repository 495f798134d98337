"""ina-run: the job's exit code, the embedded switch's address in the ranks' environment,
clear errors for a missing command or a malformed switch address (a missing launcher:
tests/test_control.py), and MPI never initialised by the launcher itself."""
from __future__ import annotations

import re
import sys

import pytest

from ina_collectives.switch.embedded import embedded_switch

PRINT_SWITCH = "import os; print('switch=' + os.environ.get('INA_SWITCH', '?'))"


@pytest.mark.mpi
def test_embedded_switch_address_reaches_every_rank_and_exit_code_is_the_jobs(ina_run):
    proc = ina_run("-np", "2", "--", sys.executable, "-c", PRINT_SWITCH)
    assert proc.returncode == 0, proc.stderr
    # The launcher may interleave the two ranks' lines: find the addresses, not lines.
    seen = re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)
    assert len(seen) == 2 and len(set(seen)) == 1, proc.stdout
    assert "ina-switch 127.0.0.1" in proc.stderr  # its final status line
    failing = ina_run("-np", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert failing.returncode != 0


@pytest.mark.mpi
def test_switch_none_and_an_address(ina_run, closed_udp_port):
    none = ina_run("-np", "1", "--switch", "none", "--", sys.executable, "-c", PRINT_SWITCH)
    assert none.returncode == 0 and "switch=\n" in none.stdout + "\n", none.stdout
    with embedded_switch() as switch:
        given = ina_run("-np", "1", "--switch", switch.address_text, sys.executable, "-c",
                        PRINT_SWITCH)
    assert given.returncode == 0, given.stderr
    assert f"switch={switch.address_text}" in given.stdout
    # Nothing listens on a port a closed socket had: ina-run names the address.
    dead = f"127.0.0.1:{closed_udp_port}"
    missing = ina_run("-np", "1", "--switch", dead, sys.executable, "-c", PRINT_SWITCH)
    assert f"aggregator at {dead} did not answer" in missing.stderr, missing.stderr


@pytest.mark.mpi  # these end at the arguments, but through ina-run: marked like the others
@pytest.mark.parametrize("args, words", [
    (["-np", "2"], "no command to run"),
    (["-np", "0", "true"], "-np must be at least 1"),
    (["-np", "2", "--switch", "127.0.0.1:notaport", "true"], "is not a number"),
])
def test_clear_errors(ina_run, args, words):
    proc = ina_run(*args)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_ina_run_never_initialises_mpi_itself(run_python):
    """The launcher starts MPI jobs; it must not be one (importing mpi4py.MPI runs
    MPI_Init, which aborts where MPI's network settings do not apply). Run it with that
    import made to fail: the embedded switch, the controller and the ranks all work."""
    code = "import sys\nfrom ina_collectives.launch import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = run_python(code, "-np", "2", "--", sys.executable, "-c", PRINT_SWITCH,
                      block=("mpi4py.MPI",), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"switch=(127\.0\.0\.1:\d+)", proc.stdout)) == 2, proc.stdout


def test_importing_the_launcher_side_leaves_mpi_uninitialised(run_python):
    """What ina-run, ina-switch and the controller import never imports mpi4py.MPI (whose
    import initialises MPI): checked in a fresh interpreter, without a launcher."""
    proc = run_python(
        "import sys\n"
        "import ina_collectives, ina_collectives.launch, ina_collectives.switch\n"
        "import ina_collectives.control\n"
        "print(sorted(m for m in sys.modules if m.startswith('mpi4py')))\n"
        "print('mpi4py.MPI' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False", proc.stdout
