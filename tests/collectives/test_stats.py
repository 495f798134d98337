"""collectives/stats.py: the engine-neutral paragraph of stats() (the INA engine's words
in it: tests/ina/test_summary.py), what a snapshot shows of an offload the chooser lacks,
and what stats() reports on one rank: the engines by their names (gloo's allreduce
without an MPI job), the kernels, and the APIs that report without ina.init()."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives import Collectives
from ina_collectives.collectives.stats import paragraph, size_text
from ina_collectives.ina.offload import ABSENT
from ina_collectives.ina.summary import summarize
from ina_collectives.settings import Settings


def test_the_paragraph_counts_the_engines_and_leaves_the_offload_its_own_words():
    # Neutral: the offload's name and its sentences come from its own layer.
    seen = []

    def about(snapshot, reasons):
        seen.append(reasons)
        return f" ({snapshot['mine']})"

    snapshot = {"calls": 4, "bytes": 3 << 20, "engines": {"fast": 3, "ring": 1},
                "bytes_by_engine": {"fast": 2 << 20, "ring": 1 << 20},
                "fallback_reasons": {"fast: too small": 1, "ring: below x": 2,
                                     "fast: busy": 3},
                "mine": "its words"}
    assert paragraph(snapshot, "fast", about) == (
        "fast served 3 of 4 calls (67% of 3.0 MiB); 1 took ring. (its words)")
    assert seen == [[("busy", 3), ("too small", 1)]]
    assert paragraph({"calls": 0}, "fast", about) == "No allreduce yet."
    assert size_text(80) == "80 B" and size_text(1536) == "1.5 KiB"


def test_an_offload_the_chooser_lacks_shows_what_its_layer_said():
    absent = {"offloaded": {"configured": False}}
    state = Collectives(MPI.COMM_SELF, Settings(), absent=absent)
    try:
        snapshot = state.stats.snapshot()
        snapshot["offloaded"]["configured"] = True  # (a copy: the next one is intact)
        assert state.stats.snapshot()["offloaded"] == {"configured": False}
    finally:
        state.free()
    bare = Collectives(MPI.COMM_SELF, Settings())
    try:
        assert set(bare.stats.snapshot()) == {"calls", "bytes", "engines",
                                              "bytes_by_engine", "fallback_reasons",
                                              "last_call"}
    finally:
        bare.free()


def test_without_an_mpi_job_the_exact_engine_is_named_gloo():
    # Under torchrun the peers are gloo groups (TorchPeers): the call the ring cannot
    # take goes to gloo's allreduce, and stats() and the summary say "gloo", not "mpi".
    import datetime

    torch_dist = pytest.importorskip("torch.distributed")

    from ina_collectives.collectives.peers import TorchPeers

    peers = TorchPeers(torch_dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    state = Collectives(peers, Settings(switch=""), absent=ABSENT)
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
