"""runtime/hot_rows.py: the hot rows of a sparse tensor, elected alike on every rank by
bytes, per period, kept only while they are measured to pay."""
from __future__ import annotations

import numpy as np

from ina_collectives.runtime.hot_rows import HotRows, elect, locate


def test_hot_rows_are_elected_only_where_they_pay():
    """The hot set: the most touched rows, ascending; empty where summing them densely
    would cost more bytes than gathering their entries."""
    counts = np.zeros(1000, np.int64)
    counts[[7, 3, 500]] = [400, 300, 2]   # over 4 calls of 8 ranks
    np.testing.assert_array_equal(elect(counts, 4, 2, 8, 256), [3, 7])
    # Rows touched once in a while on 2 ranks: a dense row costs more than it saves.
    rare = np.zeros(1000, np.int64)
    rare[[1, 2, 3]] = 1
    assert elect(rare, 10, 3, 2, 256).size == 0
    assert elect(counts, 0, 2, 8, 256).size == 0   # nothing counted yet


def test_a_hot_set_slower_than_the_exact_gather_is_set_aside_and_tried_again_later():
    """HotRows.choose at each period's end: a trial whose calls were slower than the
    exact gather's is set aside for 1, then 2, 4 ... periods, then tried again; one
    that paid is kept (elected again) and resets the wait."""
    rows = np.array([3, 7])
    table = HotRows.of_rows(10)
    periods = []

    def period(exact_ms, hot_ms):
        table.choose(lambda: rows)
        for _ in range(3):
            table.record((hot_ms if table.hot.size else exact_ms) / 1e3,
                         bool(table.hot.size), keep=3)
        periods.append(int(table.hot.size))
    table.record(0.010, False, keep=3)               # the first, exact period's times
    for _ in range(8):
        period(exact_ms=10, hot_ms=15)                # hot rows that do not pay
    assert periods == [2, 0, 2, 0, 0, 2, 0, 0], periods
    assert table.declined == 3 and table.wait == 2, table
    periods.clear()
    table.wait = 0
    for _ in range(4):
        period(exact_ms=10, hot_ms=6)                 # the same rows now paying
    assert periods == [2, 2, 2, 2] and table.backoff == 1, (periods, table)
    assert table.report()["median_ms"] == {"exact": 10.0, "hot": 6.0}


def test_the_hot_set_follows_a_skew_that_moves():
    """The touches weigh half each period: when other rows become the popular ones, the
    hot set moves to them within a few periods (here the trials pay)."""
    table = HotRows.of_rows(1000)
    rng = np.random.default_rng(0)
    elected = []
    for period in range(12):
        popular = np.arange(10) if period < 6 else np.arange(500, 510)
        for _ in range(5):                      # 5 calls of 8 ranks a period
            table.count(np.concatenate([rng.choice(popular, 8 * 30),
                                        rng.integers(0, 1000, 8 * 5)]))
            table.record(0.001 if table.hot.size else 0.002, bool(table.hot.size), 3)
        table.end_period(most=10, n=8, row_bytes=256)
        elected.append(table.hot.copy())
    np.testing.assert_array_equal(elected[5], np.arange(10))
    np.testing.assert_array_equal(elected[8], np.arange(500, 510))


def test_calls_elect_at_each_period_end_from_what_every_rank_touched():
    """start_call and end_call as a binding makes them, 2 ranks, a period of 2 calls: the
    first period is exact; at its end the rows both ranks touched are elected; a call's
    hot rows count by how many ranks touched them, its time is the previous call's (with
    or without hot rows), recorded from the third call on; a tensor that grows keeps
    its counts."""
    table = HotRows.of_rows(100)
    row_bytes, period = 1024, 2
    cold = np.array([4, 9, 4, 9, 50])             # rows 4 and 9 on both ranks, 50 on one
    for call in range(2):
        hot, timed_hot = table.start_call(2, 2, row_bytes, period)
        assert hot.size == 0 and not timed_hot
        table.end_call(100, cold, hot, None, 0.004, timed_hot, period)
    assert (table.calls, table.rows_touched, table.exact_times) == (2, 6, [])
    np.testing.assert_array_equal(table.counts[[4, 9, 50]], [4, 4, 2])

    hot, timed_hot = table.start_call(2, 2, row_bytes, period)   # the period's end
    np.testing.assert_array_equal(hot, [4, 9])
    assert not timed_hot and table.last_hot and table.new_trial
    at, is_hot = locate(hot, np.array([9, 50, 4, 0]))
    np.testing.assert_array_equal(is_hot, [True, False, True, False])
    np.testing.assert_array_equal(at[is_hot], [1, 0])
    # Both ranks touched row 4, one row 9; row 50 was gathered from one rank.
    table.end_call(100, np.array([50]), hot, np.array([2, 1]), 0.004, timed_hot, period)
    np.testing.assert_array_equal(table.counts[[4, 9, 50]], [2 + 2, 2 + 1, 1 + 1])
    assert (table.hot_rows_touched, table.rows_touched) == (2, 9)
    assert table.exact_times == [0.004] and table.hot_times == []

    hot, timed_hot = table.start_call(2, 2, row_bytes, period)   # mid-period
    np.testing.assert_array_equal(hot, [4, 9])
    assert timed_hot
    table.end_call(120, np.zeros(0, np.int64), hot, np.array([0, 2]), 0.003, timed_hot,
                   period)                        # the tensor has grown to 120 rows
    assert table.counts.size == 120 and table.counts[9] == 5
    assert table.hot_times == [0.003] and not table.new_trial
    report = table.report()
    assert (report["calls"], report["hot_rows"]) == (4, 2)
    assert report["median_ms"] == {"exact": 4.0, "hot": 3.0}
    assert report["hot_share_of_touched_rows"] == round(3 / 10, 4)


def test_a_smaller_tensor_drops_the_hot_rows_past_its_end():
    table = HotRows(np.arange(10, dtype=np.int64), np.array([2, 8]))
    table.resize(5)
    np.testing.assert_array_equal(table.counts, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(table.hot, [2])
