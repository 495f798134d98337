"""ina/offload.py: what the APIs give the chooser of the INA engine: the engine where
INA_SWITCH is set, none where it is not, and a job INA_REQUIRE_SWITCH requires to have one
refused without; what stats() shows without it."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from ina_collectives.collectives import Collectives
from ina_collectives.errors import AggregatorUnavailable
from ina_collectives.ina.engine import InaEngine
from ina_collectives.ina.offload import ABSENT, offload_for
from ina_collectives.settings import Settings


def test_the_offload_is_the_ina_engine_where_a_switch_is_set_and_required_where_asked():
    assert offload_for(Settings(switch="127.0.0.1:9")) is InaEngine
    assert offload_for(Settings(switch="")) is None
    assert offload_for(Settings(switch="127.0.0.1:9", require_switch=True)) is InaEngine
    with pytest.raises(AggregatorUnavailable, match="INA_REQUIRE_SWITCH is set but no "
                                                    "switch is configured: set INA_SWITCH"):
        offload_for(Settings(switch="", require_switch=True))


def test_without_a_switch_the_snapshot_has_the_switch_engines_keys():
    state = Collectives(MPI.COMM_SELF, Settings(switch=""), offload_for(Settings()), ABSENT)
    try:
        assert state.offload is None
        snapshot = state.stats.snapshot()
    finally:
        state.free()
    assert snapshot["kernels"] is None and snapshot["transport"] == {}
    assert snapshot["switch"]["configured"] is False
    assert "no switch configured (INA_SWITCH is unset)" in snapshot["switch"]["reason"]
