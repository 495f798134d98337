"""torch/sparse.py: the row each rank sends in a sparse allreduce's layout gather, and
the reduction with hot rows at 3 ranks in one process (tests/threadcomm.py)."""
from __future__ import annotations

import numpy as np
import torch

from ina_collectives.collectives.ops import Op
from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.settings import Settings
from ina_collectives.torch.sparse import layout_row, parse_layouts, submit_sparse, table_stats
from tests.threadcomm import ThreadPeers, run_ranks


def test_the_sparse_layout_row_carries_size_time_and_touched_hot_rows():
    touched = np.zeros(70, bool)
    touched[[0, 5, 64, 69]] = True
    rows = np.concatenate([layout_row(True, (1000, 8), 1, 0.0125, touched),
                           layout_row(False, (5, 4, 3), 2, 0.0, np.zeros(0, bool))])
    first, second = parse_layouts(rows)
    assert first["inside"] and first["size"] == (1000, 8) and first["sparse_dims"] == 1
    assert first["elapsed"] == 0.0125
    np.testing.assert_array_equal(first["touched"], touched)
    assert not second["inside"] and second["size"] == (5, 4, 3)
    assert second["sparse_dims"] == 2 and second["touched"].size == 0


def lookups(rank: int, step: int) -> torch.Tensor:
    """A rank's sparse gradient at ``step``: rows 0-3 on every rank, a few others;
    integer values, so that every sum is exact in any order."""
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = torch.cat([torch.arange(4).repeat(3), torch.randint(4, 50, (5,), generator=g)])
    values = torch.randint(-8, 9, (rows.numel(), 4), generator=g).float()
    return torch.sparse_coo_tensor(rows.reshape(1, -1), values, (50, 4),
                                   check_invariants=True)


def test_hot_rows_are_summed_densely_and_every_result_stays_exact():
    """Hot rows on, a period of 2 calls: from the third call the rows every rank touches
    go as a dense allreduce and the others by the gather. Every call's result is the
    exact sum with the rows some rank touched, the same on every rank, and every rank's
    hot rows agree."""
    steps, n = 6, 3

    def rank(comm):
        runtime = BackgroundRuntime(comm, Settings(switch="", timeout=5.0, cycle_time=0.001))
        try:
            out = []
            for step in range(steps):
                handles, finish = submit_sparse(runtime, lookups(comm.Get_rank(), step),
                                                "embedding", Op.SUM, hot_rows=4, reelect=2)
                results = [h.wait(runtime.wait_seconds(), "embedding") for h in handles]
                out.append((len(handles), finish(results)))
            return out, table_stats(runtime)["embedding"]
        finally:
            runtime.shutdown(10)

    results = run_ranks(n, rank, timeout=60, kind=ThreadPeers)
    for step in range(steps):
        inputs = [lookups(r, step).coalesce() for r in range(n)]
        exact = sum(x.to_dense() for x in inputs)
        touched = torch.unique(torch.cat([x.indices()[0] for x in inputs]))
        for out, _ in results:
            handles, got = out[step]
            # (the first period exact; then a trial, kept or set aside by its times)
            assert handles == {0: 3, 1: 3, 2: 4, 3: 4}.get(step, handles), (step, handles)
            assert torch.equal(got.indices()[0], touched), step
            assert torch.equal(got.to_dense(), exact), step
    tables = [table for _, table in results]
    assert tables[0]["calls"] == steps and tables[0]["hot_share_of_touched_rows"] > 0
    for table in tables:
        assert {k: v for k, v in table.items() if not k.startswith("bytes")} == \
            {k: v for k, v in tables[0].items() if not k.startswith("bytes")}
        assert table["bytes_through_allreduce"] > 0 and table["bytes_gathered"] > 0
