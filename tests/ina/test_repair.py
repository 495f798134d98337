"""ina/repair.py at 3 ranks in one process (tests/threadcomm.py): each chunk some rank
lost comes from the lowest rank that has it, only chunks no rank has go to the ring, and
a rank that stops ends the others' waits with CollectiveTimeout naming what they waited
for."""
from __future__ import annotations

import numpy as np

from ina_collectives.collectives.waiting import Deadline, wait
from ina_collectives.ina.repair import repair_share
from tests.threadcomm import run_ranks, timed_out

CHUNKS, K = 6, 8
SIZE = CHUNKS * K - 3  # the last chunk short


def bounded(seconds: float):
    return lambda request, what: wait(request, Deadline(seconds), lambda: what)


def share_missing(missing_by_rank: list[list[int]], c0: int = 0):
    """Each rank's copy of a share (chunk j holds j + 1) with its missing chunks zeroed,
    repaired; (out, ranges for the ring, chunks repaired) by rank."""
    def rank(comm):
        out = np.repeat(np.arange(1, CHUNKS + 1, dtype=np.float32), K)[:SIZE]
        missing = np.array(missing_by_rank[comm.Get_rank()], np.int64)
        for j in missing.tolist():
            out[j * K:(j + 1) * K] = 0
        ranges, repaired = repair_share(comm, c0, c0 + CHUNKS, missing, out, SIZE, K,
                                        bounded(5.0))
        return out, ranges, repaired
    return run_ranks(len(missing_by_rank), rank)


def test_each_lost_chunk_comes_from_a_rank_that_has_it_and_only_chunks_none_has_go_to_the_ring():
    """No rank has every lost chunk (rank 0 lacks 1, rank 1 lacks 1 and 3, rank 2 lacks
    3 and the short last one), yet each is held by some rank: repaired, no ring. Chunk
    4, lost everywhere, is the ring's alone (its elements stay as they were)."""
    want = np.repeat(np.arange(1, CHUNKS + 1, dtype=np.float32), K)[:SIZE]
    want[4 * K:5 * K] = 0
    for out, ranges, repaired in share_missing([[1, 4], [1, 3, 4], [3, 4, 5]]):
        assert ranges == [(4 * K, 5 * K)]
        assert repaired == 3
        assert out.tolist() == want.tolist()


def test_nothing_lost_is_one_collective_and_changes_nothing():
    whole = np.repeat(np.arange(1, CHUNKS + 1, dtype=np.float32), K)[:SIZE]
    for out, ranges, repaired in share_missing([[], [], []]):
        assert (ranges, repaired) == ([], 0)
        assert out.tolist() == whole.tolist()


def test_a_chunk_two_ranks_lack_comes_from_the_lowest_that_has_it():
    """Rank 1 lost chunk 2 and rank 2 lost it too, differently zeroed: both take rank
    0's copy; the short last chunk, lost by rank 0 alone, comes from rank 1."""
    results = share_missing([[5], [2], [2]])
    for out, ranges, repaired in results:
        assert (ranges, repaired) == ([], 2)
    assert len({out.tobytes() for out, _, _ in results}) == 1


def test_a_rank_that_stops_ends_the_others_waits_naming_what_they_waited_for():
    def rank(comm):
        if comm.Get_rank() == 2:
            return None  # stops before the repair: never joins its collectives
        out = np.ones(SIZE, np.float32)
        missing = np.array([1] if comm.Get_rank() == 0 else [], np.int64)
        return repair_share(comm, 0, CHUNKS, missing, out, SIZE, K, bounded(0.3))

    assert "waited 0.3 s for the chunks lost" in timed_out(3, rank)
