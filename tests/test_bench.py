"""bench/ as its docs quote it: every command that runs a bench module and every bench/
path named in the README, docs/, the Makefile, bench/, tests/ and examples/ exists; every
microbenchmark declares the ranks ``python -m bench.micro`` runs it at; the harness
bench shares with the tests is ina_collectives/testing/, which imports no bench module."""
from __future__ import annotations

import re

import pytest

from bench.micro.__main__ import declared_ranks
from tests.conftest import ROOT

QUOTING = sorted([ROOT / "README.md", ROOT / "Makefile", *ROOT.glob("docs/*.md"),
                  *ROOT.glob("bench/**/*.py"), *ROOT.glob("tests/**/*.py"),
                  *ROOT.glob("examples/*.py"), ROOT / "p4" / "README.md",
                  ROOT / "ina_collectives" / "settings.py", ROOT / "setup.py"])
COMMAND = re.compile(r"python -m (bench(?:\.\w+)*)")
PATH = re.compile(r"(?<![\w/.])(bench(?:/[\w.]+)+)")
NOT_TRACKED = ("bench/results", "bench/_build")


def _runnable(module: str) -> bool:
    where = ROOT.joinpath(*module.split("."))
    return where.with_suffix(".py").is_file() or (where / "__main__.py").is_file()


def _quotes(pattern: re.Pattern) -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT)), m.group(1)) for path in QUOTING
            for m in pattern.finditer(path.read_text())]


def test_the_check_finds_the_quoted_commands_and_paths():
    commands = {c for _, c in _quotes(COMMAND)}
    assert {"bench.micro", "bench.cluster.netsim", "bench.cluster.training"} <= commands
    assert "bench/micro/test_call_cost.py" in {p for _, p in _quotes(PATH)}
    assert not _runnable("bench.overlap") and not _runnable("bench.quorum_training")


def test_every_quoted_bench_command_runs_a_module_that_exists():
    wrong = [f"{where}: python -m {module}" for where, module in _quotes(COMMAND)
             if not _runnable(module)]
    assert not wrong, "\n".join(wrong)


def test_every_quoted_bench_path_exists():
    wrong = [f"{where}: {path}" for where, path in _quotes(PATH)
             if not path.startswith(NOT_TRACKED) and not (ROOT / path.rstrip(".")).exists()]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "micro").glob("test_*.py")),
                         ids=lambda p: p.name)
def test_every_microbenchmark_declares_its_ranks(path):
    assert declared_ranks(path)


def test_a_module_without_ranks_is_refused(tmp_path):
    (tmp_path / "test_x.py").write_text("RANKS = ()\n")
    with pytest.raises(ValueError, match="declares no RANKS"):
        declared_ranks(tmp_path / "test_x.py")


def test_the_shared_harness_imports_no_bench_module():
    for path in (ROOT / "ina_collectives" / "testing").glob("*.py"):
        assert not re.search(r"^\s*(from|import) bench\b", path.read_text(), re.M), path
