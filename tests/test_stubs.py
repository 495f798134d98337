"""The compiled modules' stubs (ina_collectives/_fast/*.pyi) say what the .pyx files
define, as test_layers checks the imports: every public function, class, method and
attribute of a .pyx is in its stub with the same parameters in the same order, and the
stub names nothing the .pyx lacks. Read from the sources, so it needs no build."""
from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import ROOT

STUBS = sorted((ROOT / "ina_collectives" / "_fast").glob("*.pyi"))
DEF = re.compile(r"^(?P<indent>[ ]*)(?:cp)?def\s+(?P<name>\w+)\s*\((?P<params>.*?)\)"
                 r"[^:\n]*:", re.M | re.S)
CLASS = re.compile(r"^(?:cdef\s+)?class\s+(?P<name>\w+)", re.M)
ATTR = re.compile(r"^[ ]+cdef\s+(?:public|readonly)\s+[\w\[\]\s\*]*?\b(?P<names>\w+(?:\s*,"
                  r"\s*\w+)*)\s*(?:#.*)?$", re.M)


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _param_names(text: str) -> list[str]:
    """The parameters' names of a Cython signature: ``int fd, uint64_t seed=1`` ->
    [fd, seed]; ``self`` and a bare ``*`` left out."""
    out, depth, part = [], 0, ""
    for ch in text + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            part = part.split("=")[0].replace("not None", "").strip()
            if part and part not in ("*", "self"):
                name = re.findall(r"\w+", part)[-1]
                out.append(("**" if part.startswith("**") else "*" if part.startswith("*")
                            else "") + name)
            part = ""
        else:
            part += ch
    return out


def pyx_surface(source: str) -> dict[str, list[str] | None]:
    """``name`` or ``Class.member`` -> parameter names (None: an attribute or a class)."""
    found: dict[str, list[str] | None] = {}
    classes = [(m.start(), m.group("name")) for m in CLASS.finditer(source)]

    def owner(at: int, indent: int) -> str | None:
        if indent == 0:
            return None
        before = [name for start, name in classes if start < at]
        return before[-1] if before else None

    for _, name in classes:
        if _public(name):
            found[name] = None
    for m in DEF.finditer(source):
        name, indent = m.group("name"), len(m.group("indent"))
        if name == "__cinit__":  # (a stub says __init__: what Python calls)
            if _param_names(m.group("params")) == ["*args", "**kwargs"]:
                continue  # (a base class's: its subclasses' constructors are the API)
            name = "__init__"
        if indent not in (0, 4):
            continue  # (a function inside a function)
        cls = owner(m.start(), indent)
        if not _public(name) or (cls is not None and not _public(cls)):
            continue
        above = source[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        accessor = above.startswith("@") and ("property" in above or ".setter" in above)
        found[f"{cls}.{name}" if cls else name] = (None if accessor
                                                   else _param_names(m.group("params")))
    for m in ATTR.finditer(source):
        cls = owner(m.start(), 4)
        if cls is not None and _public(cls):
            for name in re.split(r"\s*,\s*", m.group("names")):
                found[f"{cls}.{name}"] = None
    return found


def pyi_surface(stub: str) -> dict[str, list[str] | None]:
    found: dict[str, list[str] | None] = {}

    def params(fn: ast.FunctionDef) -> list[str]:
        a = fn.args
        names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        if a.vararg:
            names.insert(len(a.posonlyargs + a.args), "*" + a.vararg.arg)
        if a.kwarg:
            names.append("**" + a.kwarg.arg)
        return [n for n in names if n != "self"]

    for node in ast.parse(stub).body:
        if isinstance(node, ast.FunctionDef) and _public(node.name):
            found[node.name] = params(node)
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            if any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
                continue  # (a stub's own helper type)
            found[node.name] = None
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and _public(item.name):
                    is_property = any(isinstance(d, ast.Name) and d.id == "property"
                                      for d in item.decorator_list)
                    found[f"{node.name}.{item.name}"] = None if is_property else params(item)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found[f"{node.name}.{item.target.id}"] = None
    return found


@pytest.mark.parametrize("stub", STUBS, ids=[s.stem for s in STUBS])
def test_each_stub_says_what_its_pyx_defines(stub):
    source = (ROOT / "_fast" / f"{stub.stem}.pyx").read_text()
    for include in re.findall(r'^include\s+"([\w.]+)"', source, re.M):
        source += "\n" + (ROOT / "_fast" / include).read_text()
    have, said = pyx_surface(source), pyi_surface(stub.read_text())
    missing = sorted(name for name in have if name not in said)
    assert not missing, f"{stub.name} lacks {missing}"
    unknown = sorted(name for name, params in said.items()
                     if name not in have and params is not None)
    assert not unknown, f"{stub.name} names {unknown}, which _fast/{stub.stem}.pyx lacks"
    differ = {name: (said[name], params) for name, params in have.items()
              if params is not None and said[name] is not None and said[name] != params}
    assert not differ, f"{stub.name}: parameters (stub, pyx) differ: {differ}"


def test_the_signature_reader_reads_cython():
    source = ("cdef class A:\n    cdef public int x, y  # two\n"
              "    def f(self, int a, np.ndarray b not None, *, double c=1.0,\n"
              "          object d=None) -> int:\n        pass\n"
              "    cdef int g(self) nogil:\n        pass\n"
              "    @property\n    def p(self):\n        return 1\n"
              "def h(const uint8_t[:] data, *args):\n    pass\n")
    assert pyx_surface(source) == {"A": None, "A.f": ["a", "b", "c", "d"], "h": ["data", "*args"],
                                   "A.x": None, "A.y": None, "A.p": None}
