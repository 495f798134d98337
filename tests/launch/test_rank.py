"""launch/rank.py: where a rank was stopped, as ina-run reports it."""
from __future__ import annotations

import importlib.util
import sys

from ina_collectives.launch.rank import where_raised


def test_where_raised_names_the_programs_line_past_a_librarys_generated_code(tmp_path):
    """A Ctrl-C inside a library's dataclass __init__ (generated code, file "<string>")
    is reported at the program's line that called the library, not at "<string>"."""
    package = tmp_path / "lib"
    package.mkdir()
    (package / "calls.py").write_text(
        "from dataclasses import dataclass, field\n"
        "def boom():\n"
        "    raise KeyboardInterrupt\n"
        "@dataclass\n"
        "class Call:\n"
        "    parts: list = field(default_factory=boom)\n"
        "def make():\n"
        "    return Call()\n")
    spec = importlib.util.spec_from_file_location("lib_calls", package / "calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.make()  # the program's line
    except KeyboardInterrupt:
        tb = sys.exc_info()[2]
    where = where_raised(tb, str(package.resolve()) + "/")
    assert where.startswith(f"{__file__}:") and where.endswith(
        "in test_where_raised_names_the_programs_line_past_a_librarys_generated_code"), where
    # python -c's own code is "<string>" too, and is the program's
    code = compile("def f():\n    raise KeyboardInterrupt\nf()\n", "<string>", "exec")
    try:
        exec(code, {})
    except KeyboardInterrupt:
        tb = sys.exc_info()[2]
    assert where_raised(tb, str(package.resolve()) + "/").startswith("<string>:2 in f")
