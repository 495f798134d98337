"""The quorum rules of both aggregators (docs/quorum.md, The switch's rule), with crafted
packets from two installed workers of one job, the same packets on the software switch
and on the P4 program in BMv2: a late worker takes the result a quorum made without it
as it passes (a first copy of its own is dropped as late, a resend answered with the
stored result), its packet of a chunk the cell has moved past is late, a chunk stamped
sync (the staleness bound) waits for every worker, and a quorum call that meets the
cells an opening used as a gate alone at the same call number sums.

The namespace fabric of tests/integration/fabric.py, configured by the project's
controller; needs root and pyroute2, and the BMv2 half skips where p4c and BMv2 are not
found. One fabric per aggregator, each case in slots of its own.
"""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.testing import bmv2
from tests.conftest import needs_p4_extra, needs_root

pytest.importorskip("pyroute2", reason="the namespaces need pyroute2 (the bench extra)")
from tests.p4.crafted import Workers, installed  # noqa: E402

pytestmark = [needs_root, needs_p4_extra]

# A small build: K values per packet, S slots, B values per sub-block (G = 2 pairs).
K, SLOTS, B, BITS = 8, 16, 4, 32
G = K // B
JOB, EPOCH, CALL = 43, 91, 7
A = list(range(1, K + 1))
C = [10 * v for v in range(1, K + 1)]
SUM = [a + c for a, c in zip(A, C)]
EXPONENTS, PROPOSALS = [3, 5], [4, 6]


@pytest.fixture(scope="module", params=[
    "software", pytest.param("bmv2", marks=[pytest.mark.bmv2, pytest.mark.skipif(
        bmv2.find_tools() is None, reason=bmv2.missing_tools())])])
def workers(request, tmp_path_factory):
    with installed(request.param, JOB, K, SLOTS, B, BITS,
                   tmp_path_factory.mktemp(f"quorum-{request.param}")) as workers:
        yield workers


def chunk(worker: int, *, values, slot: int, version: int = 0, offset: int = 0,
          quorum: int = 1, flags: int = 0, seq: int) -> bytes:
    """A data packet of the call's chunk at ``offset`` in ``slot``, stamped ``quorum``
    (0: sync)."""
    return P.pack_data(values, exponents=EXPONENTS, proposals=PROPOSALS, block=B,
                       value_bits=BITS, flags=flags, job=JOB, worker=worker,
                       slot_version=version, slot=slot, offset=offset, epoch=EPOCH,
                       call=CALL, quorum=quorum, seq=seq)


def new(workers: Workers, worker: int, **fields) -> None:
    """Send the worker's next new data packet (``chunk``'s fields), numbered in order."""
    workers.send(worker, chunk(worker, seq=workers.number(worker), **fields))


def check_result(head: dict, pairs: list, values: list, offset: int, want: list,
                 counted: int) -> None:
    assert head["flags"] & P.FLAG_RESULT and not head["flags"] & (
        P.FLAG_MISMATCH | P.FLAG_OVERFLOW), head
    assert (head["offset"], head["call"]) == (offset, CALL), head
    assert head["contributors"] == counted, head
    assert values == want


def test_a_late_worker_takes_the_result_as_it_passes(workers):
    """Quorum 1 of 2: worker 0's packet completes the chunk, and the result goes to both.
    Worker 1's first copy of its own then adds nothing and is dropped as late (the result
    already reached it); its resend says the result never came, and gets it again."""
    before = workers.drops()
    new(workers, 0, values=A, slot=0)
    for w in (0, 1):
        check_result(*workers.receive(w), 0, A, 0b01)
    seq = workers.number(1)
    workers.send(1, chunk(1, values=C, slot=0, seq=seq))
    assert workers.silent(1) and workers.silent(0)
    workers.dropped(before, "late", 1)
    workers.send(1, chunk(1, values=C, slot=0, seq=seq, flags=P.FLAG_RETRANSMIT))
    check_result(*workers.receive(1), 0, A, 0b01)  # the stored result, nothing added
    assert workers.silent(0)


def test_a_packet_of_a_chunk_the_cell_moved_past_is_late(workers):
    """Worker 0 runs two chunks ahead in slot 1 (both cells of the slot, then its first
    cell again); worker 1's packet of the first chunk, first copy or resend, is late."""
    for version, offset in ((0, 0), (1, K * SLOTS), (0, 2 * K * SLOTS)):
        new(workers, 0, values=A, slot=1, version=version, offset=offset)
        for w in (0, 1):
            check_result(*workers.receive(w), offset, A, 0b01)
    before = workers.drops()
    seq = workers.number(1)
    workers.send(1, chunk(1, values=C, slot=1, seq=seq))
    workers.send(1, chunk(1, values=C, slot=1, seq=seq, flags=P.FLAG_RETRANSMIT))
    assert workers.silent(1)
    workers.dropped(before, "late", 2)


def test_a_chunk_stamped_sync_waits_for_every_worker(workers):
    """The staleness bound: after a quorum left worker 1 out of slot 2's first chunk,
    the slot's next chunk is stamped sync (quorum 0). Worker 0's packet alone completes
    nothing; worker 1's completes it, and the result counts both."""
    new(workers, 0, values=A, slot=2)
    for w in (0, 1):
        check_result(*workers.receive(w), 0, A, 0b01)
    offset = K * SLOTS
    new(workers, 0, values=A, slot=2, version=1, offset=offset, quorum=0)
    assert workers.silent(0) and workers.silent(1)
    new(workers, 1, values=C, slot=2, version=1, offset=offset, quorum=0)
    for w in (0, 1):
        check_result(*workers.receive(w), offset, SUM, 0b11)


def opening(worker: int, *, identity: int, slot: int, seq: int) -> bytes:
    """A call's opening: count 0, G pairs (the identity in the offset and exponents)."""
    pairs = np.array([[identity >> 32 & 0x7FFF, P.PROPOSAL_NONE]] * G, ">i2").tobytes()
    return P.pack_header(flags=P.FLAG_OPEN, job=JOB, worker=worker, slot_version=0,
                         slot=slot, offset=identity & 0xFFFF_FFFF, count=0, blocks=G,
                         value_bits=BITS, block=B, epoch=EPOCH, call=CALL,
                         seq=seq) + pairs


def test_a_gate_alone_leaves_its_call_number_to_a_quorum_call_after_it(workers):
    """An opening used as a gate alone (its call then served off the switch, or a host
    operation's gate) carries the next switch call's number without taking it: that
    call, in quorum, meets the opened cell at its own number, its chunks' offsets below
    the opening's identity (an opened cell holds it where a chunk's offset is). Only an
    earlier call is older than an opened cell: the chunks sum. (The software switch
    dropped them as late.)"""
    identity = 0x0042_7FFF_0000
    for w in (0, 1):
        workers.send(w, opening(w, identity=identity, slot=3, seq=workers.number(w)))
    for w in (0, 1):
        head, _, _ = workers.receive(w)
        assert head["flags"] == P.FLAG_RESULT | P.FLAG_OPEN, head
    before = workers.drops()
    # The call's first chunk of slot 3 takes the slot's other cell, its next the opened one.
    for version, offset in ((1, 0), (0, K * SLOTS)):
        assert offset < identity & 0xFFFF_FFFF
        for w, values in ((0, A), (1, C)):
            new(workers, w, values=values, slot=3, version=version, offset=offset, quorum=2)
        for w in (0, 1):
            check_result(*workers.receive(w), offset, SUM, 0b11)
    after = workers.drops()
    assert after["late"] == before["late"], (before, after)
