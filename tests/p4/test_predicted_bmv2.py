"""The P4 program's predicted first windows (docs/protocol.md, One round trip) on BMv2,
with crafted packets from two installed workers of one job: the sum of two predicted
packets that agree; OVERFLOW where the exponents differ (the cell keeps their max, a
resend is answered with the same flags, a late predicted copy from a worker that moved on
is stale, the ordinary second try sums); MISMATCH where the identities differ, or where a
predicted use meets an ordinary chunk or an opening; CAP_PREDICT in the probe's answer.

The BMv2 fabric of tests/integration/fabric.py (the program compiled by
ina_collectives/testing/bmv2.py, configured by the project's controller); needs root and
pyroute2, and skips where p4c and BMv2 are not found. One fabric for the module, each
case in slots of its own.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.testing import bmv2
from tests.conftest import needs_p4_extra, needs_root

pytest.importorskip("pyroute2", reason="the namespaces need pyroute2 (the bench extra)")
from tests.p4.crafted import SWITCH, installed  # noqa: E402

pytestmark = [pytest.mark.bmv2, needs_root, needs_p4_extra,
              pytest.mark.skipif(bmv2.find_tools() is None, reason=bmv2.missing_tools())]

# A small build: K values per packet, S slots, B values per sub-block (G = 2 pairs).
K, SLOTS, B, BITS = 8, 16, 4, 32
G = K // B
JOB, EPOCH, CALL = 41, 77, 5
IDENT = 0x1234_5678_9ABC  # a call's identity (48 bits)
RESULT_PREDICTED = P.FLAG_RESULT | P.FLAG_PREDICTED


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    with installed("bmv2", JOB, K, SLOTS, B, BITS,
                   tmp_path_factory.mktemp("bmv2-predicted")) as workers:
        yield workers


def chunk(worker: int, values, exponents, proposals, *, slot: int, version: int = 0,
          predicted: bool = True, ident: int = IDENT, flags: int = 0,
          quorum: int = 0) -> bytes:
    """A data packet of chunk 0 of the call (offset 0) in ``slot``: predicted (the
    identity in contributors) or ordinary."""
    return P.pack_data(values, exponents=exponents, proposals=proposals, block=B,
                       value_bits=BITS, flags=flags | (P.FLAG_PREDICTED if predicted else 0),
                       job=JOB, worker=worker, slot_version=version, slot=slot, offset=0,
                       epoch=EPOCH, call=CALL, quorum=quorum,
                       contributors=ident if predicted else 0)


def opening(worker: int, *, slot: int) -> bytes:
    """A call's opening: count 0, G pairs (the identity in the offset and exponents)."""
    pairs = np.array([[IDENT & 0x7FFF, 3]] * G, ">i2").tobytes()
    return P.pack_header(flags=P.FLAG_OPEN, job=JOB, worker=worker, slot_version=0,
                         slot=slot, offset=IDENT >> 16 & 0xFFFF_FFFF, count=0, blocks=G,
                         value_bits=BITS, block=B, epoch=EPOCH, call=CALL) + pairs


A = list(range(1, K + 1))
C = [10 * v for v in range(1, K + 1)]
SUM = [a + c for a, c in zip(A, C)]


def test_two_predicted_packets_that_agree_sum_in_one_round_trip(bench):
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=0))
    bench.send(1, chunk(1, C, [3, 5], [7, 2], slot=0))
    for w in (0, 1):
        head, pairs, values = bench.receive(w)
        assert head["flags"] == RESULT_PREDICTED, head
        assert (head["slot"], head["offset"], head["call"]) == (0, 0, CALL)
        assert pairs == [(3, 7), (5, 6)]  # the exponents, the max proposals
        assert values == SUM
        assert head["contributors"] == 0b11


def test_exponents_that_differ_overflow_and_the_second_try_sums(bench):
    before = bench.drops()
    first = chunk(0, A, [3, 5], [4, 6], slot=1)
    bench.send(0, first)
    bench.send(1, chunk(1, C, [3, 7], [2, -32768], slot=1))
    for w in (0, 1):
        head, pairs, _ = bench.receive(w)
        assert head["flags"] == RESULT_PREDICTED | P.FLAG_OVERFLOW, head
        assert pairs == [(3, 4), (7, 6)]  # per sub-block the max exponent
        assert head["contributors"] == 0b11
    # A resend of a worker the finished cell counted: the same result, alone.
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=1, flags=P.FLAG_RETRANSMIT))
    head, pairs, _ = bench.receive(0)
    assert head["flags"] == RESULT_PREDICTED | P.FLAG_OVERFLOW, head
    assert pairs == [(3, 4), (7, 6)] and head["contributors"] == 0b11
    assert bench.silent(1)
    # The second try: an ordinary chunk in the slot's other version, at the max
    # exponents. Worker 0's bit in the first cell is cleared by it, so a late copy of its
    # predicted first try is stale there: it neither opens the cell nor is answered.
    bench.send(0, chunk(0, A, [3, 7], [4, 6], slot=1, version=1, predicted=False))
    bench.send(0, first)
    assert bench.silent(0)
    bench.send(1, chunk(1, C, [3, 7], [2, -32768], slot=1, version=1, predicted=False))
    for w in (0, 1):
        head, pairs, values = bench.receive(w)
        assert head["flags"] == P.FLAG_RESULT and head["slot_version"] == 1, head
        assert pairs == [(3, 4), (7, 6)] and values == SUM
    deadline = time.monotonic() + 5
    while (after := bench.drops())["stale"] - before["stale"] < 1:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert after["stale"] - before["stale"] == 1, (before, after)
    assert after["mismatched chunk"] == before["mismatched chunk"], (before, after)


def test_identities_that_differ_mismatch(bench):
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=2))
    bench.send(1, chunk(1, C, [3, 5], [4, 6], slot=2, ident=IDENT + 1))
    for w in (0, 1):
        head, _, _ = bench.receive(w)
        assert head["flags"] == RESULT_PREDICTED | P.FLAG_MISMATCH, head
        assert head["contributors"] == 0b11
    # A resend is answered with the same flags.
    bench.send(1, chunk(1, C, [3, 5], [4, 6], slot=2, ident=IDENT + 1,
                        flags=P.FLAG_RETRANSMIT))
    head, _, _ = bench.receive(1)
    assert head["flags"] == RESULT_PREDICTED | P.FLAG_MISMATCH, head


def test_a_predicted_use_meeting_an_ordinary_chunk_or_an_opening_mismatches(bench):
    # An ordinary chunk of the same call meets a predicted use: marked, counted.
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=3))
    bench.send(1, chunk(1, C, [3, 5], [4, 6], slot=3, predicted=False))
    for w in (0, 1):
        head, _, _ = bench.receive(w)
        assert head["flags"] & P.FLAG_MISMATCH, head
    # An opening meets a predicted use: marked and counted; its result is an opening's.
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=4))
    bench.send(1, opening(1, slot=4))
    for w in (0, 1):
        head, _, _ = bench.receive(w)
        assert head["flags"] == P.FLAG_RESULT | P.FLAG_OPEN | P.FLAG_MISMATCH, head
        assert head["contributors"] == 0b11
    # A predicted packet meets an opening in progress: the same.
    bench.send(0, opening(0, slot=5))
    bench.send(1, chunk(1, C, [3, 5], [4, 6], slot=5))
    for w in (0, 1):
        head, _, _ = bench.receive(w)
        assert head["flags"] & (P.FLAG_RESULT | P.FLAG_MISMATCH) == (
            P.FLAG_RESULT | P.FLAG_MISMATCH), head
        assert head["contributors"] == 0b11


def test_a_predicted_packet_with_a_quorum_is_malformed(bench):
    before = bench.drops()
    bench.send(0, chunk(0, A, [3, 5], [4, 6], slot=6, quorum=1))
    assert bench.silent(0)
    deadline = time.monotonic() + 5
    while (after := bench.drops())["malformed"] == before["malformed"]:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert after["malformed"] - before["malformed"] == 1


def test_the_probe_answer_states_cap_predict(bench):
    reply = P.control_request(bench.socks[0], SWITCH, JOB, 0, [P.CTRL_PROBE], 5.0, "probe")
    assert reply.status == 0
    assert reply.capabilities == P.CAP_OPEN | P.CAP_PREDICT | P.CAP_QUORUM
