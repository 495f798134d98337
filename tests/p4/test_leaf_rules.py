"""A tree's leaf (docs/trees.md, How a tree sums) in both aggregators, installed by the
controller (an ina_parents entry: the job's parent, and the leaf's worker id there), with
crafted packets from two workers and from the parent, the same on the software switch
and on the P4 program in BMv2: the workers' completed cell goes up as one packet of the
leaf's worker id (the sum, the exponents, the max proposals), nothing comes down until
the parent's result does, which goes to every worker and stays in the cell; a worker's
resend while the cell waits sends the sum up again, a retransmission with the packet's
first number, and after the result it is answered from the cell; an opening goes up as
one, marked where its workers' identities differed; the parent's held answer, its NACKs
and a stale result are counted and not passed on; the probe answer of a leaf's job states
no predicted windows and no quorum cells.

The namespace fabric of tests/integration/fabric.py with a third namespace whose socket
plays the parent; needs root and pyroute2, and the BMv2 half skips where p4c and BMv2 are
not found. One fabric per aggregator, each case in slots of its own.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.testing import bmv2
from tests.conftest import needs_p4_extra, needs_root

pytest.importorskip("pyroute2", reason="the namespaces need pyroute2 (the bench extra)")
from tests.p4.crafted import SWITCH, Workers, installed  # noqa: E402

pytestmark = [needs_root, needs_p4_extra]

K, SLOTS, B, BITS = 8, 16, 4, 32
G = K // B
JOB, EPOCH, CALL = 45, 93, 9
PARENT = 2          # the parent's socket in Workers
UP_WORKER = 1       # this leaf's worker id at the parent
A = list(range(1, K + 1))
C = [10 * v for v in range(1, K + 1)]
SUM = [a + c for a, c in zip(A, C)]
TOTAL = [3 * v for v in SUM]  # the whole tree's sum, as the parent's result says
EXPONENTS = [3, 5]


@pytest.fixture(scope="module", params=[
    "software", pytest.param("bmv2", marks=[pytest.mark.bmv2, pytest.mark.skipif(
        bmv2.find_tools() is None, reason=bmv2.missing_tools())])])
def leaf(request, tmp_path_factory):
    with installed(request.param, JOB, K, SLOTS, B, BITS,
                   tmp_path_factory.mktemp(f"leaf-{request.param}"), leaf=True) as workers:
        yield workers


def chunk(worker: int, values, proposals, *, slot: int, seq: int, flags: int = 0) -> bytes:
    return P.pack_data(values, exponents=EXPONENTS, proposals=proposals, block=B,
                       value_bits=BITS, flags=flags, job=JOB, worker=worker, slot_version=0,
                       slot=slot, offset=0, epoch=EPOCH, call=CALL, seq=seq)


def result(values, proposals, *, slot: int, flags: int = P.FLAG_RESULT) -> bytes:
    """The parent's result of the leaf's chunk: every leaf counted (contributors 0b11),
    the parent's job in quorum 2 (a mode the leaf's workers must not adopt)."""
    return P.pack_data(values, exponents=EXPONENTS, proposals=proposals, block=B,
                       value_bits=BITS, flags=flags, job=JOB, worker=0xFFFF, slot_version=0,
                       slot=slot, offset=0, epoch=EPOCH, call=CALL, contributors=0b11,
                       mode_quorum=2, mode_generation=5)


def opening(worker: int, ident: int, *, slot: int, seq: int) -> bytes:
    pairs = np.array([[ident & 0x7FFF, 4 + worker]] * G, ">i2").tobytes()
    return P.pack_header(flags=P.FLAG_OPEN, job=JOB, worker=worker, slot_version=0,
                         slot=slot, offset=ident, count=0, blocks=G, value_bits=BITS,
                         block=B, epoch=EPOCH, call=CALL, seq=seq) + pairs


def both_send(leaf: Workers, slot: int) -> list[int]:
    """Workers 0 and 1 send their chunk of ``slot``; their packet numbers."""
    seqs = [leaf.number(0), leaf.number(1)]
    leaf.send(0, chunk(0, A, [4, 6], slot=slot, seq=seqs[0]))
    leaf.send(1, chunk(1, C, [7, 2], slot=slot, seq=seqs[1]))
    return seqs


def went_up(leaf: Workers, slot: int, flags: int = 0) -> dict:
    """The one packet the parent gets: the leaf's sum of ``slot``, as its worker."""
    head, pairs, values = leaf.receive(PARENT)
    assert head["flags"] == flags, head
    assert (head["job"], head["worker"], head["slot"], head["offset"], head["call"],
            head["epoch"]) == (JOB, UP_WORKER, slot, 0, CALL, EPOCH), head
    assert head["contributors"] == 0 and head["mode_quorum"] == 0, head
    assert pairs == [(3, 7), (5, 6)]   # the exponents, this leaf's max proposals
    assert values == SUM
    return head


def leaf_counts(leaf: Workers) -> dict[str, int]:
    with leaf.fabric.controller() as c:
        return c.read_leaf()


def counted(leaf: Workers, before: dict[str, int], **grown: int) -> None:
    """The leaf counter's events grow by ``grown`` from ``before`` (read a moment behind
    the packets)."""
    deadline = time.monotonic() + 5
    while True:
        after = leaf_counts(leaf)
        if all(after[e] - before[e] >= n for e, n in grown.items()):
            break
        assert time.monotonic() < deadline, (grown, before, after)
        time.sleep(0.05)
    assert {e: after[e] - before[e] for e in grown} == grown, (before, after)


def test_a_completed_cell_goes_up_and_the_parents_result_comes_down(leaf):
    before = leaf_counts(leaf)
    both_send(leaf, slot=0)
    went_up(leaf, slot=0)
    assert leaf.silent(0) and leaf.silent(1)   # no result before the parent's
    leaf.send(PARENT, result(TOTAL, [9, 8], slot=0))
    for w in (0, 1):
        head, pairs, values = leaf.receive(w)
        assert head["flags"] == P.FLAG_RESULT, head
        assert (head["slot"], head["offset"], head["call"]) == (0, 0, CALL)
        assert head["contributors"] == 0     # none named: every rank of the tree
        assert (head["mode_quorum"], head["mode_generation"]) == (0, 0)  # the leaf's own
        assert pairs == [(3, 9), (5, 8)]     # the parent's max proposals, not this leaf's
        assert values == TOTAL
    assert leaf.silent(PARENT)
    counted(leaf, before, sent_up=1, came_down=1)


def test_a_resend_waiting_goes_up_again_and_after_the_result_is_answered(leaf):
    before = leaf_counts(leaf)
    seqs = both_send(leaf, slot=1)
    first = went_up(leaf, slot=1)
    leaf.send(0, chunk(0, A, [4, 6], slot=1, seq=seqs[0], flags=P.FLAG_RETRANSMIT))
    again = went_up(leaf, slot=1, flags=P.FLAG_RETRANSMIT)
    assert again["seq"] == first["seq"]     # the parent's staleness check needs it
    assert leaf.silent(0)
    leaf.send(PARENT, result(TOTAL, [9, 8], slot=1))
    for w in (0, 1):
        assert leaf.receive(w)[2] == TOTAL
    leaf.send(1, chunk(1, C, [7, 2], slot=1, seq=seqs[1], flags=P.FLAG_RETRANSMIT))
    head, pairs, values = leaf.receive(1)   # from the cell, the parent not asked
    assert head["flags"] == P.FLAG_RESULT and head["contributors"] == 0, head
    assert (pairs, values) == ([(3, 9), (5, 8)], TOTAL)
    assert leaf.silent(PARENT) and leaf.silent(0)
    counted(leaf, before, sent_up=1, resent_up=1, came_down=1)


@pytest.mark.parametrize("differ", [False, True], ids=["alike", "differing"])
def test_an_opening_goes_up_as_one_marked_where_its_workers_differed(leaf, differ):
    slot, ident = 2 + differ, 0x1234
    leaf.send(0, opening(0, ident, slot=slot, seq=leaf.number(0)))
    time.sleep(0.1)  # (the first to come is the cell's identity)
    leaf.send(1, opening(1, ident + differ, slot=slot, seq=leaf.number(1)))
    head, pairs, values = leaf.receive(PARENT)
    assert head["flags"] == P.FLAG_OPEN and head["count"] == 0, head
    assert head["worker"] == UP_WORKER and values == []
    # A marked opening goes up with an offset no other leaf sends: the parent marks it.
    assert head["offset"] == (ident ^ (0x8000_0000 | UP_WORKER + 1) if differ else ident)
    assert pairs == [(ident & 0x7FFF, 5)] * G   # the identity, the max proposal
    leaf.send(PARENT, P.pack_header(
        flags=P.FLAG_RESULT | P.FLAG_OPEN, job=JOB, worker=0xFFFF, slot_version=0,
        slot=slot, offset=head["offset"], count=0, blocks=G, value_bits=BITS, block=B,
        epoch=EPOCH, call=CALL, contributors=0b11)
        + np.array([[ident & 0x7FFF, 11]] * G, ">i2").tobytes())
    for w in (0, 1):
        down, pairs, _ = leaf.receive(w)
        want = P.FLAG_RESULT | P.FLAG_OPEN | (P.FLAG_MISMATCH if differ else 0)
        assert down["flags"] == want, down     # this leaf's mark reaches its workers
        assert pairs == [(ident & 0x7FFF, 11)] * G


def test_held_answers_nacks_and_stale_results_are_counted_not_passed_on(leaf):
    before = leaf_counts(leaf)
    both_send(leaf, slot=4)
    went_up(leaf, slot=4)
    leaf.send(PARENT, P.pack_header(flags=P.FLAG_NACK, job=JOB, worker=UP_WORKER,
                                    slot_version=0, slot=4, offset=0, count=0,
                                    epoch=EPOCH))                     # held: a peer late
    leaf.send(PARENT, result(TOTAL, [9, 8], slot=5))                  # no cell waits
    assert leaf.silent(0) and leaf.silent(1)
    leaf.send(PARENT, result(TOTAL, [9, 8], slot=4))
    for w in (0, 1):
        assert leaf.receive(w)[2] == TOTAL
    leaf.send(PARENT, result(TOTAL, [9, 8], slot=4))                  # a copy
    assert leaf.silent(0) and leaf.silent(1)
    counted(leaf, before, sent_up=1, came_down=1, parent_held=1, stale_down=2)


def test_a_leafs_job_takes_openings_alone(leaf):
    reply = P.control_request(leaf.socks[0], SWITCH, JOB, 0, [P.CTRL_PROBE], 5.0, "probe")
    assert reply.status == 0
    assert reply.capabilities & P.CAP_OPEN
    assert not reply.capabilities & (P.CAP_PREDICT | P.CAP_QUORUM)
