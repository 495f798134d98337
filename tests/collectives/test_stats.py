"""collectives/stats.py: the one-paragraph summary of stats() (ina_collectives.summary),
and what stats() reports on one rank: the engines by their names (gloo's allreduce
without an MPI job), the kernels, and the APIs that report without ina.init()."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives.stats import summarize


def test_summary_says_in_one_paragraph_what_the_switch_served_and_why_not():
    snapshot = {"calls": 15, "bytes": 100 << 20,
                "engines": {"ina": 12, "ring": 3},
                "bytes_by_engine": {"ina": 96 << 20, "ring": 4 << 20},
                "fallback_reasons": {"ina: below switch_min_bytes (131072)": 3},
                "switch": {"configured": True, "serving": True, "outages": 1,
                           "returns": 1},
                "transport": {"sent": 4000, "retransmitted": 40},
                "kernels": "fast"}
    assert summarize(snapshot) == (
        "ina served 12 of 15 calls (96% of 100.0 MiB); 3 took ring. Why not the switch: "
        "below switch_min_bytes (131072) (3). Switch: serving, 1 outage(s), "
        "1 return(s). This rank sent 4000 packets, 40 of them again after a timeout "
        "(1.0%). Kernels: compiled.")
    assert summarize({"calls": 0}) == "No allreduce yet."
    alone = summarize({"calls": 2, "bytes": 80, "engines": {"mpi": 2},
                       "bytes_by_engine": {"mpi": 80}, "fallback_reasons": {},
                       "switch": {"configured": False, "serving": False},
                       "transport": {}, "kernels": None})
    assert alone == ("ina served 0 of 2 calls (0% of 80 B); 2 took mpi. No switch "
                     "configured (INA_SWITCH is unset).")


def test_the_exact_engines_own_thresholds_are_not_reasons_against_the_switch():
    # A small call the switch declines, which the ring then passes on to MPI: only the
    # switch's reason says why the switch did not serve it.
    text = summarize({"calls": 6, "bytes": 600, "engines": {"ina": 5, "mpi": 1},
                      "bytes_by_engine": {"ina": 590, "mpi": 10},
                      "fallback_reasons": {"ina: below switch_min_bytes (131072)": 1,
                                           "ring: below ring_min_bytes (4194304)": 1,
                                           "ring: dtype complex64 is left to MPI": 2},
                      "switch": {"configured": True, "serving": True},
                      "kernels": "numpy"})
    assert "Why not the switch: below switch_min_bytes (131072) (1)." in text, text
    assert "ring_min_bytes" not in text and "left to MPI" not in text, text
    assert text.endswith("Kernels: the NumPy reference (the switch does not serve with "
                         "it)."), text


def test_without_an_mpi_job_the_exact_engine_is_named_gloo():
    # Under torchrun the peers are gloo groups (TorchPeers): the call the ring cannot
    # take goes to gloo's allreduce, and stats() and the summary say "gloo", not "mpi".
    import datetime

    torch_dist = pytest.importorskip("torch.distributed")

    from ina_collectives.collectives import Collectives
    from ina_collectives.collectives.peers import TorchPeers
    from ina_collectives.settings import Settings

    peers = TorchPeers(torch_dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    state = Collectives(peers, Settings(switch=""))
    try:
        np.testing.assert_array_equal(state.allreduce(np.arange(4.0)), np.arange(4.0))
        snapshot = state.stats.snapshot()
    finally:
        state.free()
    assert snapshot["engines"] == {"gloo": 1}, snapshot
    assert snapshot["kernels"] is None, snapshot
    text = summarize(snapshot)
    assert "1 took gloo" in text and "took mpi" not in text and "Why not" not in text, text


def test_an_intracomm_is_what_the_package_reports_without_init(monkeypatch):
    import ina_collectives as ina
    from ina_collectives import mpi
    from ina_collectives.mpi import Intracomm
    from ina_collectives.runtime import world

    monkeypatch.delenv("INA_SWITCH", raising=False)
    assert not ina.is_initialized()
    # (Alone in this process: no other test's communicator or API answers for it.)
    monkeypatch.setattr(mpi, "_made", [])
    monkeypatch.setattr(world, "_default_sources", [mpi._default_comm])
    comm = Intracomm(MPI.COMM_SELF.Dup())
    try:
        x = np.ones(8, np.float32)
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        assert ina.stats() == comm.ina_stats() and ina.stats()["calls"] == 1
        assert ina.summary() == comm.ina_summary()
        assert ina.summary().startswith("ina served 0 of 1 calls"), ina.summary()
    finally:
        comm.Free()
    with pytest.raises(RuntimeError, match=r"none of its APIs is started \(ina_collectives"
                                           r"\.init\(\), hvd\.init\(\)"):
        ina.stats()


def test_require_switch_fails_an_intracomm_at_construction(monkeypatch, closed_udp_port):
    # As ina_collectives.init() does: at construction, not at the first Allreduce.
    from ina_collectives import AggregatorUnavailable
    from ina_collectives.mpi import Intracomm

    monkeypatch.setenv("INA_REQUIRE_SWITCH", "1")
    monkeypatch.delenv("INA_SWITCH", raising=False)
    with pytest.raises(AggregatorUnavailable, match="no switch is configured: set "
                                                    "INA_SWITCH"):
        Intracomm(MPI.COMM_SELF)
    monkeypatch.setenv("INA_SWITCH", f"127.0.0.1:{closed_udp_port}")
    with pytest.raises(AggregatorUnavailable, match="INA_REQUIRE_SWITCH is set and the "
                                                    "switch cannot serve: "):
        Intracomm(MPI.COMM_SELF, switch_join_timeout=0.5)
