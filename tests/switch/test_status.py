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
