"""collectives/stats.py: the one-paragraph summary of stats() (ina_collectives.summary)."""
from __future__ import annotations


def test_summary_says_in_one_paragraph_what_the_switch_served_and_why_not():
    from ina_collectives.collectives.stats import summarize
    snapshot = {"calls": 15, "bytes": 100 << 20,
                "engines": {"ina": 12, "ring": 3},
                "bytes_by_engine": {"ina": 96 << 20, "ring": 4 << 20},
                "fallback_reasons": {"ina: below switch_min_bytes (131072)": 3},
                "switch": {"configured": True, "serving": True, "outages": 1,
                           "returns": 1}}
    assert summarize(snapshot) == (
        "ina served 12 of 15 calls (96% of 100.0 MiB); 3 took ring. Why not the switch: "
        "ina: below switch_min_bytes (131072) (3). Switch: serving, 1 outage(s), "
        "1 return(s).")
    assert summarize({"calls": 0}) == "No allreduce yet."
    alone = summarize({"calls": 2, "bytes": 80, "engines": {"mpi": 2},
                       "bytes_by_engine": {"mpi": 80}, "fallback_reasons": {},
                       "switch": {"configured": False, "serving": False}})
    assert alone == ("ina served 0 of 2 calls (0% of 80 B); 2 took mpi. No switch "
                     "configured (INA_SWITCH is unset).")
