"""Fault injection of a running software switch, set from this machine (tests, benchmarks).

The switch applies the settings in its data path (_fast/switch_faults.pxi); this is the
client side: one CTRL_FAULTS control exchange.
"""
from __future__ import annotations

import socket

from .. import protocol as P


def send_faults(address: tuple[str, int], timeout: float = 2.0, **faults: float) -> None:
    """Set a running switch's fault injection (from this machine); faults not named are
    cleared; AggregatorUnavailable if it does not answer. Names: drop_in, drop_out,
    duplicate_in/out, reorder_in/out (probabilities), delay_ms_in, delay_ms_out
    (milliseconds), straggler_worker with straggler_delay_ms, and
    probes_from_installed_only (1: no answer to a PROBE of job 0, as a P4 switch) and
    service_pps (the data packets served a second, at most: a slow target)."""
    values = P.encode_faults(faults)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        status = P.control_exchange(s, address, 0, 0, [P.CTRL_FAULTS] + values, timeout,
                                    "fault settings")
    if status:
        raise ValueError(f"the switch refused the fault settings {faults}")
