"""The ranks' per-cycle agreement (ina_collectives.runtime.negotiation), without MPI: every
rank feeds the same messages to its ReadinessTable, so one table stands for all."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from ina_collectives.runtime.negotiation import Message, OpRequest, ReadinessTable


def req(name, kind="allreduce", dtype="float32", shape=(4,), op="sum", root=-1, **more):
    return OpRequest(kind, name, dtype, "float32", shape, op, root, **more)


def test_an_operation_is_ready_once_every_rank_submitted_it():
    table = ReadinessTable(3)
    first = table.absorb([Message([req("a")]), Message([req("a")]), Message()], now=0.0)
    assert first.ready == [] and first.failed == []
    second = table.absorb([Message(), Message(), Message([req("a")])], now=1.0)
    assert [r.name for r in second.ready] == ["a"]
    assert sorted(second.ready[0].requests) == [0, 1, 2]
    assert table.pending == {}


def test_ready_operations_come_in_the_order_they_were_first_seen():
    table = ReadinessTable(2)
    table.absorb([Message([req("b"), req("a")]), Message()], now=0.0)
    out = table.absorb([Message(), Message([req("a"), req("b")])], now=0.0)
    assert [r.name for r in out.ready] == ["b", "a"]  # rank 0 submitted b first


@pytest.mark.parametrize("base, change, words", [
    ({}, dict(dtype="float64"), "Mismatched dtype of allreduce 'x': rank 0: float32, "
                                "rank 1: float32, rank 2: float64"),
    ({}, dict(shape=(5,)), "Mismatched shape of allreduce 'x': rank 0: (4,), rank 1: (4,), "
                           "rank 2: (5,)"),
    ({}, dict(op="max"), "Mismatched reduction op of allreduce 'x': rank 0: sum, rank 1: sum, "
                         "rank 2: max"),
    (dict(kind="broadcast", root=0), dict(kind="broadcast", root=1),
     "Mismatched root rank of broadcast 'x': rank 0: 0, rank 1: 0, rank 2: 1"),
    ({}, dict(kind="broadcast", root=1), "Mismatched operation of allreduce 'x': "
                                         "rank 0: allreduce, rank 1: allreduce, rank 2: broadcast"),
    ({}, dict(prescale=2.0), "Mismatched prescale/postscale factors of allreduce 'x': "
                             "rank 0: (1.0, 1.0), rank 1: (1.0, 1.0), rank 2: (2.0, 1.0)"),
    ({}, dict(priority=3), "Mismatched priority of allreduce 'x': rank 0: 0, rank 1: 0, "
                           "rank 2: 3"),
])
def test_a_metadata_mismatch_fails_naming_each_ranks_value(base, change, words):
    table = ReadinessTable(3)
    out = table.absorb([Message([req("x", **base), req("y")]), Message([req("x", **base)]),
                        Message([req("x", **change), req("y")])], now=0.0)
    assert [f.name for f in out.failed] == ["x"] and out.failed[0].message == words
    assert out.ready == [] and list(table.pending) == ["y"]  # x is gone; y waits for rank 1
    later = table.absorb([Message(), Message([req("y")]), Message()], now=1.0)
    assert [r.name for r in later.ready] == ["y"] and later.failed == []


def test_a_mismatch_is_found_only_once_every_rank_has_submitted():
    table = ReadinessTable(2)
    first = table.absorb([Message([req("x")]), Message()], now=0.0)
    assert first.failed == [] and list(table.pending) == ["x"]
    out = table.absorb([Message(), Message([req("x", dtype="int32")])], now=1.0)
    assert "rank 0: float32, rank 1: int32" in out.failed[0].message
    again = table.absorb([Message([req("x")]), Message([req("x")])], now=2.0)
    assert [r.name for r in again.ready] == ["x"]  # the name can be used afresh


def test_allgather_may_differ_in_its_first_dimension_only():
    table = ReadinessTable(2)
    ok = table.absorb([Message([req("g", "allgather", shape=(2, 3))]),
                       Message([req("g", "allgather", shape=(5, 3))])], now=0.0)
    assert [r.name for r in ok.ready] == ["g"]
    bad = table.absorb([Message([req("h", "allgather", shape=(2, 3))]),
                        Message([req("h", "allgather", shape=(2, 4))])], now=0.0)
    assert "shape beyond the first dimension" in bad.failed[0].message


def test_broadcast_root_out_of_range_and_alltoall_splits_are_checked():
    table = ReadinessTable(2)
    out = table.absorb([Message([req("b", "broadcast", root=2)])] * 2, now=0.0)
    assert "root rank 2 is not in 0..1" in out.failed[0].message
    splits = table.absorb([Message([req("t", "alltoall", splits=(1,))])] * 2, now=0.0)
    assert "rank 0 gave 1 splits for 2 ranks" in splits.failed[0].message


def test_a_name_submitted_twice_while_pending_fails():
    table = ReadinessTable(2)
    table.absorb([Message([req("a")]), Message()], now=0.0)
    out = table.absorb([Message([req("a")]), Message()], now=0.0)
    assert "rank 0 submitted 'a' again" in out.failed[0].message
    assert "a" not in table.pending


def test_joined_ranks_count_as_present_for_allreduce_only():
    table = ReadinessTable(2)
    out = table.absorb([Message([req("a"), req("b", "broadcast", root=0)]),
                        Message(join=True)], now=0.0)
    assert [r.name for r in out.ready] == ["a"]
    assert list(out.ready[0].requests) == [0]  # the joined rank adds nothing
    assert "only allreduce continues with joined ranks" in out.failed[0].message
    assert out.join_done is None
    done = table.absorb([Message(join=True), Message()], now=0.0)
    assert done.join_done == 0 and table.joined == {}  # the last rank to join


def test_shutdown_names_the_first_rank_that_asked():
    out = ReadinessTable(3).absorb([Message(), Message(shutdown=True),
                                   Message(shutdown=True)], now=0.0)
    assert out.shutdown_by == 1


def test_stalled_names_warn_once_then_fail_naming_the_missing_ranks(caplog):
    table = ReadinessTable(3)
    table.absorb([Message([req("s")]), Message(), Message([req("s")])], now=10.0)
    assert table.stalled(now=15.0, warn_after=60.0, fail_after=300.0) == ()
    with caplog.at_level(logging.WARNING, logger="ina_collectives"):
        assert table.stalled(now=80.0, warn_after=60.0, fail_after=300.0) == ()
        assert table.stalled(now=90.0, warn_after=60.0, fail_after=300.0) == ()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "rank(s) [1] have not submitted it" in warnings[0]
    assert table.stalled(now=310.0, warn_after=60.0, fail_after=300.0) == ("s",)
    out = table.absorb([Message(stalled=("s",)), Message(), Message()], now=310.0)
    assert out.failed[0].name == "s"
    assert ("submitted by rank(s) [0, 2], but rank(s) [1] never submitted it"
            in out.failed[0].message)


def test_a_name_repeated_within_one_message_fails():
    table = ReadinessTable(2)
    out = table.absorb([Message([req("a"), req("a")]), Message()], now=0.0)
    assert [(f.name, f.message) for f in out.failed] == [
        ("a", "rank 0 submitted 'a' again while its first one was pending")]
    assert table.pending == {}


def test_ranks_joining_in_one_cycle_report_the_highest_and_no_shutdown_by_default():
    table = ReadinessTable(3)
    out = table.absorb([Message(join=True), Message(), Message(join=True)], now=0.0)
    assert out.join_done is None and out.shutdown_by is None
    done = table.absorb([Message(), Message(join=True), Message(join=True)], now=0.0)
    assert done.join_done == 1  # rank 1 joined last (rank 2's second join changes nothing)
    assert table.joined == {}


def test_stall_warning_starts_at_warn_after_and_skips_joined_ranks(caplog):
    table = ReadinessTable(3)
    table.absorb([Message([req("s")]), Message(join=True), Message()], now=100.0)
    with caplog.at_level(logging.WARNING, logger="ina_collectives"):
        assert table.stalled(now=159.9, warn_after=60.0, fail_after=120.0) == ()
        assert caplog.records == []
        assert table.stalled(now=160.0, warn_after=60.0, fail_after=120.0) == ()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("stalled: allreduce 's' float32[4] sum was submitted by "
                              "rank(s) [0], but rank(s) [2] have not submitted it for 60 s")
    assert table.stalled(now=219.9, warn_after=60.0, fail_after=120.0) == ()
    assert table.stalled(now=220.0, warn_after=60.0, fail_after=120.0) == ("s",)


def test_only_rank_0s_stalled_list_counts_and_unknown_names_are_ignored():
    table = ReadinessTable(2)
    table.absorb([Message([req("s")]), Message()], now=0.0)
    out = table.absorb([Message(stalled=("gone",)), Message(stalled=("s",))], now=500.0)
    assert out.failed == [] and list(table.pending) == ["s"]
    out = table.absorb([Message(stalled=("s",)), Message()], now=500.0)
    assert [f.name for f in out.failed] == ["s"] and table.pending == {}


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "float16", "float32",
                                   "float64"])
@pytest.mark.parametrize("n", [2, 3, 7])
def test_average_divides_exactly_as_horovods_tests_expect(dtype, n):
    """Average is a true division: floats correctly rounded (float16 through float32, one
    rounding), integers truncated toward zero; Horovod's tests at 3 ranks compare against
    t / n with no tolerance, which a multiplication by (float)(1 / n) misses by an ulp."""
    from ina_collectives.runtime.scaling import divide
    rng = np.random.default_rng(n)
    low = 0 if dtype == "uint8" else -100
    values = rng.integers(low, 100, 1000).astype(dtype) * (
        1 if np.dtype(dtype).kind != "f" else np.asarray(1.37, dtype))
    got = values.copy()
    divide(got, n)
    if np.dtype(dtype).kind == "f":
        wide = values.astype(np.float32 if dtype == "float16" else dtype)
        want = (wide / wide.dtype.type(n)).astype(dtype)
    else:
        want = np.trunc(values.astype(np.float64) / n).astype(dtype)
    np.testing.assert_array_equal(got, want)


def test_a_rank_in_trouble_is_named_with_its_call_and_nothing_else_changes():
    table = ReadinessTable(3)
    out = table.absorb([Message([req("a")]), Message(trouble=7), Message([req("a")])],
                       now=0.0)
    assert out.trouble == {1: 7} and not out.ready and not out.failed
    assert Message(trouble=-1) == Message()  # (an idle cycle's message stays empty)
    later = table.absorb([Message(), Message([req("a")]), Message()], now=1.0)
    assert later.trouble == {} and [r.name for r in later.ready] == ["a"]


def test_an_operation_out_of_program_order_names_what_each_rank_made_there():
    table = ReadinessTable(2)
    messages = [Message([req("x")]), Message([req("y", "broadcast", root=0)])]
    table.absorb(messages, now=0.0)
    entry = table.pending["x"]
    text = table.out_of_order("x", entry, messages)
    assert "allreduce 'x'" in text and "rank(s) [0]" in text, text
    assert "rank(s) [1] never submitted it" in text and "rank 1: broadcast 'y'" in text, text


def quorum_table(k=2, n=3, max_steps=3):
    """A table in quorum k that has run allreduce "g" with every rank (it is known)."""
    table = ReadinessTable(n, quorum=k, max_steps=max_steps)
    out = table.absorb([Message([req("g")]) for _ in range(n)], now=0.0)
    assert [r.name for r in out.ready] == ["g"] and out.ready[0].absent == ()
    return table


def test_in_quorum_mode_a_known_allreduce_runs_without_the_late_rank_once_rank_0_says():
    table = quorum_table()
    out = table.absorb([Message([req("g")]), Message([req("g")]), Message()], now=1.0)
    assert out.ready == []                      # k ranks in: rank 0 has not said go yet
    assert table.due(now=1.0, grace=0.05) == ()  # the grace runs from here (rank 0's clock)
    assert table.due(now=1.04, grace=0.05) == ()
    assert table.due(now=1.06, grace=0.05) == ("g",)
    out = table.absorb([Message(go_ahead=("g",)), Message(), Message()], now=1.1)
    assert [(r.name, sorted(r.requests), r.absent) for r in out.ready] == [("g", [0, 1], (2,))]
    assert table.absences == 1 and table.absent_steps == [0, 0, 1]


def test_a_late_rank_that_submits_in_the_same_cycle_as_the_go_ahead_is_counted():
    table = quorum_table()
    table.absorb([Message([req("g")]), Message([req("g")]), Message()], now=1.0)
    out = table.absorb([Message(go_ahead=("g",)), Message(), Message([req("g")])], now=1.1)
    assert out.ready[0].absent == () and sorted(out.ready[0].requests) == [0, 1, 2]


def test_only_allreduces_every_rank_ran_as_now_go_without_a_rank():
    table = ReadinessTable(3, quorum=2, max_steps=3)
    # never run with every rank: not known, so rank 0 never names it
    table.absorb([Message([req("new")]), Message([req("new")]), Message()], now=0.0)
    assert table.due(now=10.0, grace=0.0) == ()
    out = table.absorb([Message(go_ahead=("new",)), Message(), Message()], now=10.0)
    assert out.ready == []
    # known, but submitted with another shape this time: compared with every rank, later
    table = quorum_table()
    table.absorb([Message([req("g", shape=(5,))]), Message([req("g", shape=(5,))]),
                  Message()], now=1.0)
    out = table.absorb([Message(go_ahead=("g",)), Message(), Message()], now=2.0)
    assert out.ready == [] and "g" in table.pending


def test_sync_mode_and_too_few_ranks_never_go_ahead():
    table = quorum_table(k=3, n=3)          # k = n: sync
    table.absorb([Message([req("g")]), Message([req("g")]), Message()], now=1.0)
    assert table.due(now=9.0, grace=0.0) == ()
    table = quorum_table(k=2, n=4)
    table.absorb([Message([req("g")]), Message(), Message(), Message()], now=1.0)
    assert table.due(now=9.0, grace=0.0) == ()
    out = table.absorb([Message(go_ahead=("g",)), Message(), Message(), Message()], now=9.0)
    assert out.ready == []


def test_a_negotiated_quorum_operation_sets_the_tables_k_for_what_follows():
    table = quorum_table(k=0)
    table.absorb([Message([req("q", kind="quorum", dtype="none", shape=(2,), op=None)])
                  for _ in range(3)], now=0.5)
    assert table.quorum == 2
    table.absorb([Message([req("g")]), Message([req("g")]), Message()], now=1.0)
    assert table.due(now=1.0, grace=0.0) == ("g",)


def test_a_rank_is_absent_from_the_calls_of_at_most_max_steps_steps_in_a_row():
    """Its steps are counted as the engine counts them: a step ends where a call it
    missed repeats. At the bound its submission is waited for, and counted, which
    starts the count again."""
    table = ReadinessTable(3, quorum=2, max_steps=2)
    table.absorb([Message([req("a"), req("b")]) for _ in range(3)], now=0.0)

    def step(names, late_rank_in=False):
        fast = Message([req(x) for x in names])
        table.absorb([fast, Message([req(x) for x in names]),
                      Message([req(x) for x in names]) if late_rank_in else Message()],
                     now=1.0)
        return table.absorb([Message(go_ahead=tuple(names)), Message(), Message()], now=2.0)

    assert [r.absent for r in step(["a", "b"]).ready] == [(2,), (2,)]   # step 1
    assert table.absent_steps[2] == 1
    assert [r.absent for r in step(["a", "b"]).ready] == [(2,), (2,)]   # step 2
    assert table.absent_steps[2] == 2
    out = step(["a"])                                                   # step 3: waited for
    assert out.ready == [] and "a" in table.pending
    out = table.absorb([Message(), Message(), Message([req("a")])], now=3.0)
    assert [(r.name, r.absent) for r in out.ready] == [("a", ())]
    assert table.absent_steps[2] == 0
