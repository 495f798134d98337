"""docs/architecture.md is true to the imports: each part of the package depends on
exactly what its row of the table says, the parts form layers (no circle among them),
no module imports in a circle, and no module uses another module's private names.

Read from the sources (every import statement, the ones inside functions too), so the
check needs no build and sees what the import graph at run time might hide.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ina_collectives"
DOC = ROOT / "docs" / "architecture.md"
FAST_SOURCES = sorted((ROOT / "_fast").glob("*.p[yx][xid]"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    where = ROOT.joinpath(*name.split("."))
    return where.with_suffix(".py").exists() or (where / "__init__.py").exists()


def _part(module: str) -> str:
    """The row of the doc's table a module belongs to, by the row's short name."""
    parts = module.split(".")
    if parts[0] == "p4":
        return "p4"
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "ina" and parts[2:3] == ["reference"]:
        return "ina.reference"
    return parts[1]


def _imports(path: Path, name: str | None = None, text: str | None = None
             ) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import of the package in
    ``path`` (or in ``text``, as module ``name``)."""
    name = name or _module_name(path)
    text = path.read_text() if text is None else text
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "ina_collectives":
                found.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names
                         if a.name.split(".")[0] == "ina_collectives")
    return found


def _python_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + [ROOT / "p4" / "gen.py"]


def _module_edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name taken from a package that is a
    module of its own counts as that module)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in _python_sources():
        for target, names, _ in _imports(path):
            subs = [f"{target}.{n}" for n in names if _is_module(f"{target}.{n}")]
            edges[_module_name(path)].update(subs)
            if len(subs) < len(names) or not names:
                edges[_module_name(path)].add(target)
    return edges


def _fast_imports() -> list[tuple[Path, str, list[str]]]:
    """What the compiled sources import from the package (Python imports at module
    import time; cimports are of _fast's own .pxd files)."""
    pattern = re.compile(r"^\s*from\s+(ina_collectives[\w.]*)\s+import\s+([\w, ]+?)"
                         r"(?:\s+as\s+\w+)?\s*$", re.M)
    return [(path, m.group(1), [n.strip() for n in m.group(2).split(",")])
            for path in FAST_SOURCES for m in pattern.finditer(path.read_text())]


def _documented() -> dict[str, set[str]]:
    """The table of docs/architecture.md: part -> the parts its row depends on."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        where = cells[0].strip("`").removeprefix("ina_collectives/").rstrip("/")
        where = where.removesuffix(".py").replace("/", ".") or "__init__"
        deps = {d.strip().strip("`") for d in cells[2].split(",")} - {"-", ""}
        rows[where] = deps
    return rows


def _actual() -> dict[str, set[str]]:
    """Part -> the parts it imports; a part that imports one module of another part only,
    where the doc names that module (``control.schema``), keeps the module's name."""
    documented = _documented()
    deps: dict[str, set[str]] = defaultdict(set)
    for module, targets in _module_edges().items():
        for target in targets:
            if _part(target) != _part(module):
                deps[_part(module)].add(target)
    for path, target, names in _fast_imports():
        for name in names:
            full = f"{target}.{name}" if _is_module(f"{target}.{name}") else target
            deps["_fast"].add(full)
    shown = {}
    for part, targets in deps.items():
        parts = {_part(t) for t in targets}
        named = documented.get(part, set())
        result = set()
        for p in parts:
            modules = {t.removeprefix("ina_collectives.") for t in targets if _part(t) == p}
            narrowed = [n for n in named if n.split(".")[0] == p and n != p]
            if narrowed and modules <= set(narrowed):
                result |= modules
            else:
                result.add(p)
        shown[part] = result
    return shown


def test_the_doc_table_names_every_part():
    parts = {_part(_module_name(p)) for p in _python_sources()} | {"_fast"}
    assert parts == set(_documented()), (
        f"docs/architecture.md's table lacks {sorted(parts - set(_documented()))} and "
        f"names {sorted(set(_documented()) - parts)} that do not exist")


@pytest.mark.parametrize("part", sorted(_documented()))
def test_each_part_depends_on_what_its_row_says(part):
    said, real = _documented()[part], _actual().get(part, set())
    assert real == said, (f"{part}: docs/architecture.md says it depends on "
                          f"{sorted(said) or '-'}, its imports say {sorted(real) or '-'}")


def _circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle in ``edges`` as a list of its nodes, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_parts_are_layers():
    edges = {part: {d.split(".")[0] if d.split(".")[0] != "ina" else
                    ("ina.reference" if d.startswith("ina.reference") else "ina")
                    for d in deps} for part, deps in _actual().items()}
    assert _circle(edges) is None, f"the parts import each other: {_circle(edges)}"


def test_no_module_imports_in_a_circle():
    edges = _module_edges()
    circle = _circle(edges)
    assert circle is None, " -> ".join(circle or [])


def test_the_check_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, name: str | None = None, text: str | None = None
                  ) -> list[str]:
    """Where a Python module imports a private name of another module of the package, or
    reads one as an attribute of a module it imported."""
    text = path.read_text() if text is None else text
    tree = ast.parse(text)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for target, _, line in _imports(path, name, text):
            if line != node.lineno:
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if _is_module(full):
                    aliases[alias.asname or alias.name] = full
                elif _private(alias.name):
                    found.append(f"{path.name}:{line}: from {target} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for path in _python_sources() for use in _private_uses(path)]
    for path, target, names in _fast_imports():
        found += [f"{path.name}: from {target} import {n}" for n in names if _private(n)]
        text = path.read_text()
        for alias in re.findall(rf"from {re.escape(target)} import \w+ as (\w+)", text):
            found += [f"{path.name}: {alias}.{n}"
                      for n in re.findall(rf"\b{alias}\.(_[a-z]\w*)", text)]
    assert found == [], "\n".join(found)


def test_the_private_name_check_finds_both_forms():
    path = PACKAGE / "torch" / "distributed.py"
    text = path.read_text() + "\n_X = staging._WIRE\nfrom .staging import _hidden\n"
    found = _private_uses(path, "ina_collectives.torch.distributed",
                          text.replace("from .staging import", "from . import staging\n"
                                       "from .staging import", 1))
    assert [f.split(": ", 1)[1] for f in found] == [
        "from ina_collectives.torch.staging import _hidden", "staging._WIRE"]


# The words of the offload's own world. collectives/ chooses among engines and must not
# need to know that a switch exists: it is given its offload (ina/'s engine, by the layer
# above), and the words about it (settings, messages, the summary) live in ina/.
NEUTRAL = PACKAGE / "collectives"
OFFLOAD_WORDS = re.compile(r"switch|aggregator|opening", re.I)


def _offload_words(text: str) -> list[tuple[int, str]]:
    """(line, the line) for each line of ``text`` that names an offload's parts."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if OFFLOAD_WORDS.search(line)]


def test_no_module_of_the_neutral_layer_names_a_switch_an_aggregator_or_an_opening():
    sources = sorted(path for path in NEUTRAL.rglob("*")
                     if path.suffix in (".py", ".pyi", ".pyx", ".pxd", ".md"))
    assert sources, NEUTRAL
    found = [f"{path.relative_to(ROOT)}:{n}: {line}" for path in sources
             for n, line in _offload_words(path.read_text())]
    assert found == [], "collectives/ is engine-neutral; these lines name the offload's " \
                        "parts (say offload, or move them to ina/):\n" + "\n".join(found)


def test_the_neutral_words_check_finds_code_and_comments():
    text = ("x = settings.require_switch\n# the Aggregator's cells\nok = 1\n"
            '"""an OPENING"""\n')
    assert [n for n, _ in _offload_words(text)] == [1, 2, 4]
