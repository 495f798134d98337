"""The INA engine as the chooser's offload: what the layers above (the array API, mpi.py,
the runtime) give ``collectives.Collectives``, so that the chooser never names a switch.

``offload_for(settings)``: the engine's factory where INA_SWITCH names aggregators, None
where it is unset (every call takes the ring or MPI); a job that INA_REQUIRE_SWITCH
requires to have one fails here. ``ABSENT``: what stats() shows of the engine where
there is none, the keys of ``InaEngine.report`` ("kernels", "transport", "switch").
"""
from __future__ import annotations

from typing import Any

from ..errors import AggregatorUnavailable
from ..settings import Settings
from .engine import InaEngine

ABSENT: dict[str, Any] = {
    "kernels": None,
    "transport": {},
    "switch": {"configured": False, "serving": False,
               "reason": "no switch configured (INA_SWITCH is unset): every call takes "
                         "the ring or MPI"},
}


def offload_for(settings: Settings) -> type[InaEngine] | None:
    """The offload the chooser is given for ``settings``: InaEngine (made by the chooser,
    collectively, on its own copy of the communicator) where INA_SWITCH is set; None
    where it is not. AggregatorUnavailable where INA_REQUIRE_SWITCH is set and
    INA_SWITCH is not (a switch that is configured and cannot serve fails as the engine
    joins it: ina/aggregators.py)."""
    if not settings.switch and not settings.topology:
        if settings.require_switch:
            raise AggregatorUnavailable("INA_REQUIRE_SWITCH is set but no switch is "
                                        "configured: set INA_SWITCH=host:port")
        return None
    return InaEngine
