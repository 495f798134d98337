"""switch/server.py: the status line as key=value fields, and parse_status reading it back
(or saying which field it cannot read)."""
from __future__ import annotations

import pytest

from ina_collectives.switch.server import CONTROL_OUTCOMES, parse_status, status_text


def _counters(**over):
    s = {"packets_in": 10, "packets_out": 9, "results": 4, "openings": 1, "slots_busy": 0,
         "retransmits_answered": 2, "nacks": 0, "result_requests": 3, "send_calls": 5,
         "send_path": "UDP_SEGMENT", "gro_buffers": 1, "send_failures": 0,
         "drops": {"stale": 1, "unknown worker": 2},
         "jobs": {515: {"workers": 2, "slots": 4, "asked": 8, "results": 4}},
         "jobs freed idle": 0, "control overflow": 0, **{k: 0 for k in CONTROL_OUTCOMES}}
    s["joins"] = 2
    s.update(over)
    return s


def test_the_status_line_reads_back_field_by_field():
    line = status_text("127.0.0.1:47474", _counters())
    assert line.startswith("ina-switch 127.0.0.1:47474: in=10 out=9 results=4 "), line
    status = parse_status(line)
    assert status["address"] == "127.0.0.1:47474" and status["result_requests"] == 3
    assert status["send_path"] == "UDP_SEGMENT"
    assert status["control"] == {"joins": 2}
    assert status["drops"] == {"stale": 1, "unknown_worker": 2}
    assert status["job515"] == {"workers": 2, "slots": 4, "asked": 8, "results": 4}
    assert parse_status(status_text("h:1", _counters(drops={}, jobs={})))["drops"] == {}


@pytest.mark.parametrize("line, words", [
    ("hello", "not an ina-switch status line"),
    ("ina-switch h:1: in=3 oops", "field 'oops' is not key=value"),
    ("ina-switch h:1: drops=stale:x", "field 'drops=stale:x' is not key=value"),
])
def test_a_line_it_cannot_read_is_named(line, words):
    with pytest.raises(ValueError, match=words):
        parse_status(line)


def test_the_closing_line_in_words():
    """What ina-run prints of the embedded switch at the end (the counters with
    --verbose): results and packets, the losses answered, the drops by reason, and a
    job a controller left installed."""
    from ina_collectives.switch import status_summary
    line = status_text("127.0.0.1:47474", _counters(
        drops={"duplicate_in_progress": 101}, jobs={}))
    text = status_summary(line)
    assert text.startswith("the switch at 127.0.0.1:47474 returned 4 results, adding "
                           "10 packets"), text
    assert "dropped 101 (duplicate in progress)" in text and "still installed" not in text
    idle = status_summary("ina-switch h:1: in=3 out=0 results=0 p4runtime_jobs=1 drops=none")
    assert idle == ("the switch at h:1 returned no results (3 packets in): no call went "
                    "through it; 1 job(s) still installed over P4Runtime"), idle
