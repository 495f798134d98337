"""The kernel selector's account of itself: why the kernels in use are not the compiled
ones, in the words stats() gives (the setting chose the reference, or no build)."""
from __future__ import annotations

import sys

import pytest

import ina_collectives._fast as fast_package
from ina_collectives.ina import kernels
from ina_collectives.settings import Settings

CHOSEN = "INA_INTERNAL_KERNELS=numpy chose the NumPy reference kernels"


def test_the_setting_that_chose_the_reference_is_named_not_a_missing_build():
    assert kernels.why_not_fast(Settings(kernels="numpy")) == CHOSEN
    assert kernels.why_not_fast("numpy") == CHOSEN
    assert kernels.select("numpy").why_not_fast == CHOSEN


@pytest.mark.parametrize("wanted", ["", "fast"])
def test_the_compiled_kernels_have_no_reason_against_them(wanted):
    assert kernels.why_not_fast(Settings(kernels=wanted)) == ""
    chosen = kernels.select(wanted)
    assert (chosen.name, chosen.why_not_fast) == ("fast", "")


def test_a_missing_build_is_named_with_its_fix(monkeypatch):
    monkeypatch.delattr(fast_package, "blockfp")
    monkeypatch.setitem(sys.modules, "ina_collectives._fast.blockfp", None)
    chosen = kernels.select("")
    assert chosen.name == "numpy"
    assert chosen.why_not_fast.startswith("the compiled fast path is not built (")
    assert chosen.why_not_fast.endswith("'pip install -e .' builds it (needs a C compiler)")
    assert kernels.why_not_fast(Settings()) == chosen.why_not_fast
    assert kernels.why_not_fast(Settings(kernels="numpy")) == CHOSEN
    with pytest.raises(ImportError, match="the compiled fast path is not built"):
        kernels.select("fast")
