"""The user-facing docs: the README's first screen gives the two commands, the install
and a quickstart; the README stays short; its links and folders exist; no development
history ("issue N") in the README or docs/."""
from __future__ import annotations

import re

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_the_first_screen_holds_the_commands_the_install_and_a_quickstart():
    first = "\n".join(README.splitlines()[:60])
    for needed in ("make demo", "make test", "pip install", "ina-run -np",
                   'init_process_group("ina")', "import ina_collectives.torch as hvd",
                   "Intracomm(MPI.COMM_WORLD)"):
        assert needed in first, f"the README's first 60 lines lack {needed!r}"


def test_the_readme_is_under_1500_words():
    words = len(re.findall(r"\S+", README))
    assert words < 1500, words


def test_links_and_folders_named_in_the_readme_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and not [p for p in links if not (ROOT / p).exists()], links
    folders = re.findall(r"^\| `([\w/.]+/)` \|", README, re.M)
    assert folders and not [f for f in folders if not (ROOT / f).is_dir()], folders


def test_no_development_history_in_the_user_docs():
    pages = [ROOT / "README.md", ROOT / "p4" / "README.md", *(ROOT / "docs").glob("*.md")]
    found = [f"{p.name}:{n}" for p in pages
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b[Ii]ssues? \d", line) or "this round" in line]
    assert not found, found
