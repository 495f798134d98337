"""statskeys.py, the table of stats()'s keys: docs/stats.md is current, the table holds
together, and real stats() dicts, made at 2 ranks in one process (tests/threadcomm.py's
ThreadPeers, a software switch in a thread: tests/switch/test_server.py), have exactly
the documented keys, of the documented types: the array API's with a switch, the
program-order runtime's (torch.distributed's) without one, and the Horovod API's with
one."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ina_collectives import statskeys as S
from ina_collectives.collectives.chooser import Collectives
from ina_collectives.collectives.ops import Op
from ina_collectives.ina.engine import InaEngine
from ina_collectives.runtime.hot_rows import HotRows
from ina_collectives.settings import Settings
from tests.runtime.test_background import allreduce, on_runtimes
from tests.switch.test_server import switch_thread
from tests.threadcomm import ThreadPeers, run_ranks

try:
    import torch

    from tests.torch.hvd_threads import on_hvd, per_thread_world  # noqa: F401
except ImportError:  # (the Horovod API's case is skipped)
    torch = None

ROOT = Path(__file__).resolve().parent.parent
COUNT = 200_000  # float32: several chunks, so the stream measures round trips
# What holds after a float32 call the switch served and an int32 call it declined.
SERVED = {S.SWITCH, S.JOINED, S.RTT, S.AFTER_CALL, S.AFTER_SWITCH_CALL, S.SERVING}
OPEN = {key.path for key in S.KEYS if key.open}


# A loaded machine (CI beside a build) may stall a rank's thread for seconds: the switch's
# silence and join bounds wait that out, so that the switch serves the float call.
LOADED = {"switch_silence": 20.0, "switch_join_timeout": 20.0}

def test_docs_page_is_current():
    doc = (ROOT / "docs" / "stats.md").read_text()
    assert doc == S.page(), ("docs/stats.md is stale: python -m ina_collectives.statskeys "
                             "> docs/stats.md")


def test_the_table_holds_together():
    paths = [key.path for key in S.KEYS]
    assert len(paths) == len(set(paths)), sorted(p for p in paths if paths.count(p) > 1)
    for key in S.KEYS:
        assert key.api in S.APIS and key.when in S.WHEN, key
        assert sum(holds(key) for _, _, holds in S.GROUPS) == 1, key.path
        assert key.meaning.endswith(".") and "|" not in key.path, key.path
        parent = re.sub(r"(\[\])?\.[^.]+$", "", key.path)
        assert parent == key.path or parent in paths, f"{key.path}: no entry {parent}"
        if key.open:
            assert not [p for p in paths if p.startswith((key.path + ".", key.path + "[]."))]
    hot = S.documented(S.HOROVOD)["sparse"].meaning
    assert not [k for k in _flat(HotRows.of_rows(4).report()) if f"`{k.split('.')[-1]}`"
                not in hot], hot


# -- real stats() dicts ------------------------------------------------------------------

def _flat(stats: dict[str, Any], prefix: str = "",
          into: dict[str, list[Any]] | None = None) -> dict[str, list[Any]]:
    """Every dotted path of ``stats`` and its values (a list's dicts give one value per
    entry), not into the open-ended entries."""
    into = {} if into is None else into
    for name, value in stats.items():
        path = f"{prefix}{name}"
        into.setdefault(path, []).append(value)
        if path in OPEN:
            continue
        if isinstance(value, dict):
            _flat(value, path + ".", into)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for entry in value:
                _flat(entry, path + "[].", into)
    return into


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def _is(kind: str, value: Any) -> bool:
    """Whether ``value`` is of the documented type ``kind`` (``int`` is no bool)."""
    if " | " in kind:
        return any(_is(k, value) for k in kind.split(" | "))
    base, _, inner = kind.partition("[")
    plain = {"None": type(None), "int": int, "float": float, "bool": bool, "str": str,
             "dict": dict, "list": list}[base]
    if type(value) is not plain:
        return False
    if base == "dict" and inner:
        keys, values = _split(inner[:-1])
        return all(_is(keys, k) and _is(values, v) for k, v in value.items())
    if base == "list" and inner:
        return all(_is(inner[:-1], v) for v in value)
    return True


def test_the_type_check_tells_the_types_apart():
    assert _is("int", 3) and not _is("int", True) and not _is("int", 3.0)
    assert _is("dict | None", None) and _is("dict[int, int]", {32: 1})
    assert not _is("dict[str, int]", {32: 1}) and _is("list[str]", ["a"])
    assert not _is("list[int]", ["a"]) and _is("dict[str, dict]", {"x": {}})


def _check(stats: dict[str, Any], api: str, when: set[str]) -> None:
    """``stats`` has exactly the keys documented for ``api`` where ``when`` holds, each of
    its documented type."""
    real, documented = _flat(stats), S.documented(api, when)
    missing, undocumented = sorted(set(documented) - set(real)), sorted(set(real) - set(documented))
    assert not missing and not undocumented, (
        f"{api} stats() and ina_collectives/statskeys.py differ: documented but missing: "
        f"{missing}; there but undocumented: {undocumented}")
    wrong = {path: values for path, values in real.items()
             if not all(_is(documented[path].type, v) for v in values)}
    assert not wrong, {p: (documented[p].type, v) for p, v in wrong.items()}


def _served(stats: dict[str, Any]) -> None:
    """The calls went as the test made them: the switch served the float32 one."""
    assert stats["engines"].get("ina") == 1 and stats["calls"] == 2, stats["engines"]
    assert any(r.startswith("ina: dtype int32") for r in stats["fallback_reasons"]), stats


def test_the_array_apis_stats_with_a_switch_have_the_documented_keys():
    with switch_thread() as sw:
        settings = Settings(switch="%s:%d" % sw.address, switch_min_bytes=0, timeout=30.0,
                            **LOADED)

        def rank(comm):
            coll = Collectives(comm, settings, InaEngine)
            try:
                coll.allreduce(np.full(COUNT, 1.0 + comm.Get_rank(), np.float32))
                coll.allreduce(np.arange(10, dtype=np.int32))
                return coll.stats.snapshot()
            finally:
                coll.free()

        results = run_ranks(2, rank, timeout=60, kind=ThreadPeers)
    for stats in results:
        _served(stats)
        _check(stats, S.ALL, SERVED)


def test_the_runtimes_stats_without_a_switch_have_the_documented_keys():
    """torch.distributed's runtime (program order) without a switch: stats()["switch"]
    is ina/offload.py's ABSENT."""
    def body(runtime, r):
        allreduce(runtime, "f", np.full(1000, 1.0, np.float32))
        allreduce(runtime, "i", np.arange(10, dtype=np.int32), Op.MAX)
        return runtime.stats()

    for stats in on_runtimes(2, body, ordered=True):
        assert stats["calls"] == 2 and stats["kernels"] is None, stats
        _check(stats, S.RUNTIME, {S.NO_SWITCH, S.AFTER_CALL})


@pytest.mark.skipif(torch is None, reason="no module torch: the Horovod API")
@pytest.mark.usefixtures("per_thread_world")
def test_the_horovod_apis_stats_with_a_switch_have_the_documented_keys():
    with switch_thread() as sw:
        def body(hvd, r):
            hvd.allreduce(torch.full((COUNT,), 1.0 + r), name="f", op=hvd.Sum)
            hvd.allreduce(torch.arange(10, dtype=torch.int32), name="i", op=hvd.Sum)
            return hvd.stats()

        results = on_hvd(2, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                         timeout=30.0, **LOADED)
    for stats in results:
        _served(stats)
        _check(stats, S.HOROVOD, SERVED)
