"""The user-facing docs: the README's first screen gives the two commands, the install
and a quickstart; the README stays short; every relative link of the README and docs/
reaches a file (and a heading, where it names one), and every docs/ page is linked from
the README; the command lines they quote parse with the real parsers; figures that
mirror a setting read it; no development history ("issue N") in the README or docs/."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from ina_collectives.settings import Settings
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "p4" / "README.md", *DOCS]
FENCED = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)


def test_the_first_screen_holds_the_commands_the_install_and_a_quickstart():
    first = "\n".join(README.splitlines()[:60])
    for needed in ("make demo", "make test", "pip install", "ina-run -np",
                   'init_process_group("ina")', "import ina_collectives.torch as hvd",
                   "Intracomm(MPI.COMM_WORLD)"):
        assert needed in first, f"the README's first 60 lines lack {needed!r}"


def test_the_readme_is_under_1500_words():
    words = len(re.findall(r"\S+", README))
    assert words < 1500, words


def test_folders_named_in_the_readme_exist():
    folders = re.findall(r"^\| `([\w/.]+/)` \|", README, re.M)
    assert folders and not [f for f in folders if not (ROOT / f).is_dir()], folders


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCED.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    """The link targets of ``page``, outside code blocks."""
    return re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    """Each link is resolved from its page's own folder, as a reader's browser does (a
    docs/ page's link to ``docs/x.md`` is to docs/docs/x.md)."""
    links = [link for link in _links(page) if not re.match(r"[a-z]+:", link)]
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no {target.relative_to(ROOT)})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.name})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in _links(ROOT / "README.md")}
    assert not [p.name for p in DOCS if p not in linked]


def test_the_waits_the_troubleshooting_page_quotes_are_the_settings():
    """The troubleshooting page quotes the join's message, whose seconds are
    settings.switch_join_timeout, and the return's, switch_retry_seconds."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    quoted = re.findall(r"did not answer the join within (\S+) s", page)
    assert quoted == [f"{Settings().switch_join_timeout:g}"], quoted
    retry = set(re.findall(r"once it answers \(within (\S+) s of that", page))
    assert retry == {f"{Settings().switch_retry_seconds:g}"}, retry


def test_no_development_history_in_the_user_docs():
    found = [f"{p.name}:{n}" for p in PAGES
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b[Ii]ssues? \d", line) or "this round" in line]
    assert not found, found


# Written by the code (ina_collectives/statskeys.py, ina_collectives/settings.py), whose
# tests keep them current: their length and words are the code's tables'.
GENERATED = {"stats.md", "settings.md"}
MAX_LINES = 400
# A page that narrates its history ("a first version ...", "before the fix ...") instead
# of saying what the library does now; the history goes to CHANGELOG.md.
HISTORY = re.compile(r"\b(?:first version|earlier versions?|older versions?|before the fix"
                     r"|found later|no longer|last session|the old code)\b", re.I)
# Lines that use such words for what the library does now, not for its history.
NOT_HISTORY = ("a worker on a slow path no longer sets the pace",)


def test_no_docs_page_is_over_400_lines():
    long = {p.name: n for p in DOCS if p.name not in GENERATED
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these pages (at most {MAX_LINES} lines): {long}"


def test_the_user_docs_say_what_the_library_does_not_its_history():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in PAGES
             if p.name not in GENERATED
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if HISTORY.search(line) and not any(ok in line for ok in NOT_HISTORY)]
    assert not found, "\n".join(found)


def test_the_history_check_finds_history():
    for line in ("A first version let the negotiation run ahead.",
                 "In earlier versions a lost packet stalled.", "Before the fix it opened",
                 "(found later)", "INA's calls are no longer bimodal"):
        assert HISTORY.search(line), line
    assert not HISTORY.search("the first window's exponents, an earlier call's result")


# -- the command lines the docs quote ----------------------------------------------------

CONTROL = "python -m ina_collectives.control"
PROGRAMS = (CONTROL, "ina-run", "ina-switch")


class _Parser(Exception):
    """Carries a program's real parser out of its main(), before it parses anything."""


def _caught_parser(main, argv: list[str]) -> argparse.ArgumentParser:
    def catch(parser, *args, **kwargs):
        raise _Parser(parser)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), \
            pytest.raises(_Parser) as caught:
        main(argv)
    return caught.value.args[0]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from ina_collectives.control.cli import _parser
    from ina_collectives.launch.cli import parse_args
    from ina_collectives.switch.cli import main as switch_main
    return {CONTROL: _parser(), "ina-run": _caught_parser(parse_args, []),
            "ina-switch": _caught_parser(switch_main, [])}


def _quoted_commands() -> list[tuple[str, str, bool]]:
    """(page, command line, whether it stands in a code block) for each command line of
    PROGRAMS quoted in the README or docs/, past any VAR=value and up to its ``--``."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [(line, True) for block in FENCED.findall(text)
                 for line in re.sub(r"\\\n\s*", " ", block).splitlines()[1:-1]
                 if not line.lstrip().startswith("#")]
        lines += [(span, False) for span in re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`",
                                                      FENCED.sub("", text))]
        for line, block in lines:
            line = re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", " ".join(line.split(" #")[0].split()))
            if line.startswith(tuple(f"{p} " for p in PROGRAMS)):
                found.append((str(page.relative_to(ROOT)), line.split(" -- ")[0], block))
    return found


def _args(line: str, parser: argparse.ArgumentParser) -> list[str]:
    """The arguments of a quoted command line, its placeholders made values of the
    options they follow: [optional] parts kept, the first of ``a | b`` alternatives,
    a number for a number's placeholder (J, N, ...), an address for another (H:P, ...)."""
    line = re.sub(r"(\S+)(?: \| \S+)+", r"\1", line.replace("[", "").replace("]", ""))
    args = shlex.split(line)
    for i, arg in enumerate(args):
        if re.fullmatch(r"[A-Z][A-Z0-9_]*(?:[:,][A-Z][A-Z0-9_]*)*|\.\.\.", arg) and i:
            action = _option(parser, args[:i], args[i - 1])
            number = action is not None and action.type in (int, float)
            args[i] = "1" if number else "127.0.0.1:9559"
    return args


def _subparser(parser: argparse.ArgumentParser, args: list[str]) -> argparse.ArgumentParser:
    """The subcommand's parser, where ``args`` start with one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and args and args[0] in action.choices:
            return action.choices[args[0]]
    return parser


def _option(parser: argparse.ArgumentParser, before: list[str], name: str):
    return _subparser(parser, before)._option_string_actions.get(name.split("=")[0])


def test_the_quoted_command_lines_are_found():
    commands = _quoted_commands()
    assert (f"{CONTROL} mode --target H:P --job-id J --quorum 3" in
            [line for _, line, _ in commands]), commands
    for program in PROGRAMS:
        assert any(line.startswith(program + " ") for _, line, _ in commands), program


def test_every_quoted_option_exists_and_every_quoted_command_line_parses():
    """Each option a quoted command line names is one of its program's (its
    subcommand's); a whole command line (in a code block, or a control command with
    options) parses with the real parser, required options and all."""
    parsers, wrong = _parsers(), []
    for page, line, block in _quoted_commands():
        program = next(p for p in PROGRAMS if line.startswith(p + " "))
        parser, args = parsers[program], _args(line[len(program):], parsers[program])
        options = [o for a in args if re.match(r"--?[A-Za-z]", a)
                   for o in a.split("/") if o != "..."]
        unknown = [o for o in options if _option(parser, args, o) is None]
        if unknown:
            wrong.append(f"{page}: {line!r}: no option {', '.join(unknown)}")
            continue
        if block or (program == CONTROL and options):
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parser.parse_args(args)
            except SystemExit:
                wrong.append(f"{page}: {line!r}: {err.getvalue().strip().splitlines()[-1]}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_says_why_one_machine_favours_the_ring_as_the_demo_does():
    """The demo's line on one machine and the README's share their words
    (examples/train_mlp.py: ONE_MACHINE)."""
    source = (ROOT / "examples" / "train_mlp.py").read_text()
    found = re.search(r'^ONE_MACHINE = \(((?:\s*"[^"]*")+)\)', source, re.M)
    assert found, "examples/train_mlp.py lost ONE_MACHINE"
    phrase = "".join(re.findall(r'"([^"]*)"', found.group(1)))
    assert phrase in " ".join(README.split()), phrase
    assert "make demo` prints which did" in README
