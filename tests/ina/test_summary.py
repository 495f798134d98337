"""ina/summary.py: stats() in one paragraph (ina_collectives.summary), the switch's
sentences in it (the counts are collectives/stats.py's)."""
from __future__ import annotations

from ina_collectives.ina.offload import ABSENT
from ina_collectives.ina.summary import summarize


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


def test_the_summary_of_a_job_without_a_switch_says_so_from_the_absent_report():
    snapshot = {"calls": 1, "bytes": 8, "engines": {"ring": 1},
                "bytes_by_engine": {"ring": 8}, "fallback_reasons": {}, **ABSENT}
    assert summarize(snapshot) == ("ina served 0 of 1 calls (0% of 8 B); 1 took ring. "
                                   "No switch configured (INA_SWITCH is unset).")
