"""The Horovod API (``ina_collectives.torch``) under real mpiexec jobs of 2-3 ranks, with
and without a software switch: every operation and dtype against values computed here,
gradients, agreement errors, a dead peer, join, init variants, the optimizer."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Horovod API needs torch: pip install "
                            "'ina-collectives[torch]'")

from ina_collectives import protocol as P  # noqa: E402
from ina_collectives.runtime.scaling import split_rows  # noqa: E402
from tests.integration import mpirun, rank_cases, torch_cases  # noqa: E402
from tests.integration.torch_cases import (  # noqa: E402
    DTYPES,
    OPS,
    gradient_like,
    loss_of,
    optimizer_problem,
    torch_input,
)


def run(n, case, params=None, env=None, timeout=120.0, **options):
    return mpirun.run(n, case, params, env=env, timeout=timeout, **options)


# Most cases need nothing of their own (a switch at most, the module's): they run as the
# cases of two jobs, one of 2 ranks and one of 3 (tests/integration/mpirun.py's
# ``several``), each case with the settings its own job had, and each test checks its
# case's results. Two launches instead of twenty-four.
SHAPE = (5, 7)
HALF_FACTORS = [0.1915194503788923, 0.6221087710398319]   # Horovod's test draws such f, g
OPTIMIZER_OPTIONS = [{}, {"passes": 2, "predivide": 2.0}, {"compression": "fp16"}]


@pytest.fixture(scope="module")
def two_ranks(switch):
    return run(2, mpirun.several, mpirun.cases(
        ("async_fused", torch_cases.torch_async, {"settings": {"fusion_threshold": 1 << 20}}),
        ("async_unfused", torch_cases.torch_async, {"settings": {"fusion_threshold": 0}}),
        ("switch16", torch_cases.torch_switch16, None, {"INA_SWITCH": switch.address_text}),
        ("name_reuse", torch_cases.torch_name_reuse, None),
        ("half_scaling", torch_cases.torch_half_scaling, {"factors": HALF_FACTORS},
         {"INA_SWITCH": ""}),
        ("alltoall_forms", torch_cases.torch_alltoall_forms, None),
        ("optimizer_unnamed", torch_cases.torch_optimizer_unnamed, None),
        ("optimizer_state", torch_cases.torch_optimizer_state, None),
        *[(f"optimizer/{i}", torch_cases.torch_optimizer, {"steps": 2, **options})
          for i, options in enumerate(OPTIMIZER_OPTIONS)],
        ("priority_fifo", rank_cases.runtime_priority,
         {"big": 1 << 16, "settings": {"ordering": "fifo"}})), timeout=240)


@pytest.fixture(scope="module")
def three_ranks(switch, tmp_path_factory):
    ops = {"shape": SHAPE, "settings": {"switch_min_bytes": 0, "ring_min_bytes": 0}}
    return run(3, mpirun.several, mpirun.cases(
        ("ops/switch", torch_cases.torch_ops,
         {**ops, "tmp": str(tmp_path_factory.mktemp("ops_switch"))},
         {"INA_SWITCH": switch.address_text}),
        ("ops/ring", torch_cases.torch_ops,
         {**ops, "tmp": str(tmp_path_factory.mktemp("ops_ring"))}, {"INA_SWITCH": ""}),
        ("autograd", torch_cases.torch_autograd, None),
        ("grouped_and_scaled", torch_cases.torch_grouped_and_scaled, None, {"INA_SWITCH": ""}),
        ("process_sets", torch_cases.torch_process_sets, {"settings": {"switch_min_bytes": 0}},
         {"INA_SWITCH": switch.address_text}),
        ("process_sets_from_communicators",
         torch_cases.torch_process_sets_from_communicators, None),
        ("errors", torch_cases.torch_errors, None),
        ("join", torch_cases.torch_join, None),
        ("init", torch_cases.torch_init, None),
        ("sparse", torch_cases.torch_sparse, None, {"INA_SWITCH": ""}),
        ("priority", rank_cases.runtime_priority,
         {"big": 1 << 20, "settings": {"partition_bytes": 65536}})), timeout=300)


def of_case(results, name):
    """Each rank's result of case ``name`` of a job of ``mpirun.several``."""
    return [mpirun.case_result(out, name, r) for r, out in enumerate(results)]


def as_np(t):
    return (t.double() if t.dtype == torch.bfloat16 else t).numpy()


def expected_allreduce(dtype, op, shape, n, seed):
    xs = np.stack([as_np(torch_input(dtype, shape, r, seed)) for r in range(n)])
    if op in ("sum", "average"):
        total = xs.astype(np.float64 if xs.dtype.kind == "f" else np.int64).sum(axis=0)
        if op == "sum":
            return total
        return total / n if xs.dtype.kind == "f" else np.trunc(total / n)
    return {"min": xs.min(axis=0), "max": xs.max(axis=0),
            "product": xs.astype(np.float64).prod(axis=0)}[op]


def close(got, want, dtype):
    """Exact for integers; for floats within one rounding of the result's dtype."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype, 0)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("through", ["switch", "ring"])
def test_every_operation_and_dtype(three_ranks, through):
    n, shape = 3, SHAPE
    results = of_case(three_ranks, f"ops/{through}")
    for r, out in enumerate(results):
        assert "error" not in out, out
        assert (out["size"], out["rank"]) == (n, r)
        for dtype in DTYPES:
            for op in OPS:
                want = expected_allreduce(dtype, op, shape, n, OPS.index(op))
                close(out[f"allreduce/{dtype}/{op}"], want, dtype)
            total = expected_allreduce(dtype, "sum", shape, n, 0)
            got, same_object = out[f"allreduce_/{dtype}"]
            close(got, total, dtype)
            assert same_object, "allreduce_ must return its input tensor"
            close(out[f"allreduce_async/{dtype}"], total, dtype)
            assert out[f"input_kept/{dtype}"], "allreduce_async modified its input"
            for i, got in enumerate(out[f"grouped/{dtype}"]):
                close(got, expected_allreduce(dtype, "sum", (3 + i,), n, 10 + i), dtype)
            gathered = np.concatenate([as_np(torch_input(dtype, (q + 1, 2), q, 20))
                                       for q in range(n)])
            close(out[f"allgather/{dtype}"], gathered, dtype)
            close(out[f"broadcast/{dtype}"], as_np(torch_input(dtype, (4, 3), n - 1, 30)), dtype)
            close(out[f"broadcast_/{dtype}"], as_np(torch_input(dtype, (4, 3), 0, 30)), dtype)
            got, received = out[f"alltoall/{dtype}"]
            assert received == [r + 1] * n
            start = r * (r + 1) // 2   # rank q sends rows [start, start + r + 1) to rank r
            want = np.concatenate([as_np(torch_input(dtype, (n * (n + 1) // 2, 2), q, 40))
                                   [start:start + r + 1] for q in range(n)])
            close(got, want, dtype)
            if dtype != "uint8":
                full = expected_allreduce(dtype, "sum", (2 * n + 1, 2), n, 50)
                lo, hi = split_rows(2 * n + 1, n, r)
                close(out[f"reducescatter/{dtype}"], full[lo:hi], dtype)
        total32 = expected_allreduce("float32", "sum", shape, n, 0)
        close(out["scaled"], total32 * 1.5, "float32")
        close(out["fp16_compressed"], total32 / n, "float16")
        assert out["fp16_compressed_dtype"] == "torch.float32"
        got, got_shape = out["non_contiguous"]
        assert got_shape == [4, shape[0]]
        close(got, expected_allreduce("float32", "sum", (shape[0], 4), n, 60).T, "float32")
        close(out["grouped_"][0], expected_allreduce("float32", "sum", (4,), n, 70), "float32")
        close(out["grouped_"][1], expected_allreduce("int32", "sum", (3,), n, 71), "int32")
        assert out["grouped_"][2] is True, "grouped_allreduce_ must work in place"
        close(out["grouped_async"][0], np.full(2, n), "float32")
        close(out["grouped_async"][1], np.full(3, n), "float32")
        close(out["allgather_async"], np.concatenate([np.full(q + 1, q) for q in range(n)]),
              "float32")
        got, _ = out["broadcast_async_"]
        close(got, as_np(torch_input("float32", (4, 3), 0, 30)), "float32")
        assert out["broadcast_object"] == {"from": 1, "list": [1] * 3}
        assert out["allgather_object"] == [("rank", q, "x" * q) for q in range(n)]
        assert out["after_barrier_sees_file"] is True
        engines = out["stats"]["engines"]
        ours, package = out["summaries"]  # hvd.summary(), ina_collectives.summary()
        assert ours == package and ours.startswith(
            f"ina served {engines.get('ina', 0)} of {out['stats']['calls']} calls"), ours
        if through == "switch":
            assert engines.get("ina", 0) > 0, out["stats"]
            assert "Switch: serving" in ours and ours.endswith("Kernels: compiled."), ours
        else:
            assert "ina" not in engines, out["stats"]
            assert "No switch configured" in ours and "Kernels" not in ours, ours


@pytest.mark.mpi
def test_async_poll_and_fusion(two_ranks):
    results = of_case(two_ranks, "async_fused")
    assert results[0]["poll_before_peer"] is False
    for out in results:
        np.testing.assert_array_equal(out["late"], np.full(8, 2.0))
        for i, got in enumerate(out["small"]):
            np.testing.assert_array_equal(got, np.full(100, 2.0 * i))
        # 64 tensors submitted together: fused into far fewer reductions than tensors.
        assert out["fused_calls"] >= 1 and out["reductions"] < 64, out
        assert out["poll_unknown"]["error"] == "ValueError"
        assert out["sync_twice"]["error"] == "ValueError"


@pytest.mark.mpi
def test_fusion_off_reduces_each_tensor_alone(two_ranks):
    results = of_case(two_ranks, "async_unfused")
    for out in results:
        assert out["fused_calls"] == 0 and out["reductions"] == 64, out
        for i, got in enumerate(out["small"]):
            np.testing.assert_array_equal(got, np.full(100, 2.0 * i))


@pytest.mark.mpi
def test_gradients_flow_through_every_collective(three_ranks):
    n = 3
    results = of_case(three_ranks, "autograd")
    w = lambda r, count: np.arange(count, dtype=np.float64) + 100 * r  # noqa: E731
    sum_w = lambda count: sum(w(r, count) for r in range(n))  # noqa: E731
    rows = [r + 1 for r in range(n)]
    for r, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce_sum"], sum_w(6))
        np.testing.assert_allclose(out["allreduce_avg"], sum_w(6) / n, rtol=1e-6)
        np.testing.assert_array_equal(out["grouped"], 2 * sum_w(6))
        # Horovod's gradients: allgather and broadcast average the incoming gradient
        # over the ranks; reducescatter scales it by size (Sum) and its scale factors.
        start = sum(rows[:r])
        mine = sum_w(2 * sum(rows)).reshape(-1, 2)[start:start + rows[r]] / n
        np.testing.assert_allclose(out["allgather"], mine, rtol=1e-6)
        np.testing.assert_allclose(out["grouped_allgather"], 3 * mine, rtol=1e-6)
        np.testing.assert_allclose(out["broadcast"], sum_w(6) / n if r == 1 else np.zeros(6),
                                   rtol=1e-6)
        splits = [1] * (n - 1) + [2]
        # Row k of this rank went to rank j = owner(k), landing at offset r * splits[j].
        want = [w(j, n * splits[j])[r * splits[j] + i] for j in range(n)
                for i in range(splits[j])]
        np.testing.assert_array_equal(out["alltoall"], want)
        gathered = np.concatenate([w(j, 2) for j in range(n)])
        np.testing.assert_array_equal(out["reducescatter"], n * gathered)
        np.testing.assert_array_equal(out["reducescatter_scaled"], 6 * gathered)
        np.testing.assert_array_equal(out["grouped_reducescatter"], 3 * n * gathered)


@pytest.mark.mpi
def test_switch16_compression_sums_16_bit_values_through_the_switch(two_ranks):
    """hvd.Compression.switch16: the calls that carry it go through the switch as 16-bit
    values (counted by width), within the 16-bit bound; the same tensor without it is
    summed with 32-bit values; the optimizer's step is the same on both ranks."""
    from ina_collectives.ina.reference import blockfp

    n = 2
    results = of_case(two_ranks, "switch16")
    xs = np.stack([gradient_like(r) for r in range(n)])
    exact = xs.astype(np.float64).mean(axis=0)
    for name, bits in (("plain", 32), ("switch16", 16)):
        got = results[0][name]
        k = P.max_elements(P.MAX_DATAGRAM, P.DEFAULT_BLOCK, 32)  # the job's K
        agreed = np.max([blockfp.block_exponents(x, k)[0] for x in xs], axis=0)
        exps = blockfp.element_exponents(agreed, xs.shape[1], k, P.DEFAULT_BLOCK)
        bound = blockfp.error_bound(n, exps, np.float32, got, True, bits)
        assert (np.abs(got - exact) <= bound * (1 + 1e-9)).all(), name
        assert all((r[name] == got).all() for r in results), f"{name}: ranks differ"
    # 16 bits are visibly coarser than 32 on the same tensor.
    assert np.abs(results[0]["switch16"] - exact).max() > \
        10 * np.abs(results[0]["plain"] - exact).max()
    for a, b in zip(*(r["params"] for r in results)):
        np.testing.assert_array_equal(a, b)
    widths = results[0]["switch"]["calls_by_value_bits"]
    assert widths.get(16, 0) >= 2 and widths.get(32, 0) >= 1, widths


@pytest.mark.mpi
def test_set_quorum_leaves_a_straggler_out_and_average_divides_by_the_ranks_counted():
    """hvd.set_quorum(2), the switch's quorum (INA_INTERNAL_QUORUM_RUN_AHEAD=0), in a job of three
    whose rank 2 the switch holds back 150 ms:
    Average is the mean of ranks 0 and 1 (divided by 2), Sum their sum; set_quorum(0)
    returns to the mean of all three; ranks asking for different quorums all raise, and
    the runtime goes on."""
    from ina_collectives.ina.reference import blockfp
    from ina_collectives.switch import send_faults
    from ina_collectives.switch.embedded import embedded_switch

    n = 3
    with embedded_switch() as sw:
        send_faults((sw.host, sw.port), straggler_worker=2, straggler_delay_ms=150)
        results = run(n, torch_cases.torch_quorum, env={"INA_SWITCH": sw.address_text,
                                                        "INA_INTERNAL_QUORUM_RUN_AHEAD": "0"},
                      timeout=180)
    xs = np.stack([gradient_like(r) for r in range(n)])
    k = P.max_elements(P.MAX_DATAGRAM, P.DEFAULT_BLOCK, 32)
    agreed = np.max([blockfp.block_exponents(x, k)[0] for x in xs], axis=0)
    exps = blockfp.element_exponents(agreed, xs.shape[1], k, P.DEFAULT_BLOCK)
    for name, ranks, average in (("sync", [0, 1, 2], True), ("average", [0, 1], True),
                                 ("sum", [0, 1], False), ("back", [0, 1, 2], True),
                                 ("after", [0, 1, 2], True)):
        got = results[0][name]
        exact = xs[ranks].astype(np.float64).sum(axis=0) / (len(ranks) if average else 1)
        bound = blockfp.error_bound(n, exps, np.float32, got, average)
        # (Averages outside a quorum are Horovod's: the sum, then one division.)
        assert (np.abs(got - exact) <= bound * (1 + 1e-6) + 1e-6).all(), name
        assert all((r[name] == got).all() for r in results), f"{name}: ranks differ"
    assert [r["last"]["counted"] for r in results] == [True, True, False]
    assert results[0]["last"]["ranks_never_counted"] == [2]
    report = results[2]["report"]
    assert report["quorum_calls"] == 2 and report["calls_left_out"] == 2, report
    assert report["mode"] == "sync", report
    for r in results:
        assert "Mismatched shape of quorum" in r["disagree"]["message"], r["disagree"]


@pytest.mark.mpi
def test_grouped_allgather_grouped_reducescatter_and_scaled_reducescatter(three_ranks):
    n = 3
    results = of_case(three_ranks, "grouped_and_scaled")
    for r, out in enumerate(results):
        for dtype in ("int32", "float16", "float32", "float64"):
            for key in ("grouped_allgather", "grouped_allgather_async"):
                got = out[f"{key}/{dtype}"]
                close(got[0], np.concatenate([as_np(torch_input(dtype, (q + 1, 2), q, 60))
                                              for q in range(n)]), dtype)
                close(got[1], np.concatenate([as_np(torch_input(dtype, (2, 3), q, 61))
                                              for q in range(n)]), dtype)
            first = expected_allreduce(dtype, "sum", (2 * n + 1, 2), n, 62)
            start, stop = split_rows(2 * n + 1, n, r)
            got = out[f"grouped_reducescatter/{dtype}"]
            close(got[0], first[start:stop], dtype)
            close(got[1], expected_allreduce(dtype, "sum", (n,), n, 63)[r:r + 1], dtype)
            if dtype != "int32":  # (x * 0.5) summed, times 3 / n
                close(out[f"reducescatter_scaled/{dtype}"],
                      first[start:stop] * 0.5 * 3 / n, dtype)


@pytest.mark.mpi
def test_process_sets(three_ranks):
    """Even and odd ranks in their own sets (each its own job at the switch), a set given
    to init, Horovod's errors, a DistributedOptimizer over one set, removal."""
    n = 3
    results = of_case(three_ranks, "process_sets")
    for r, out in enumerate(results):
        assert out["static"] == (1, 2, [1, 2].index(r) if r in (1, 2) else -1)
        assert out["ids"] == (2, 3)
        ranks = [0, 2] if r % 2 == 0 else [1]
        assert out["mine"] == (ranks, len(ranks), ranks.index(r), True, False)
        total = sum(as_np(torch_input("float32", (3000,), q, 70)) for q in ranks)
        np.testing.assert_array_equal(out["allreduce"], total)
        np.testing.assert_array_equal(out["grouped_allreduce"][1], 2 * total)
        np.testing.assert_array_equal(out["allgather"],
                                      np.concatenate([[q] * (q + 1) for q in ranks]))
        np.testing.assert_array_equal(out["broadcast"], [ranks[-1]] * 3)
        i, m = ranks.index(r), len(ranks)
        np.testing.assert_array_equal(out["alltoall"], np.concatenate(
            [np.arange(2.0 * m)[2 * i:2 * i + 2] + 10 * q for q in ranks]))
        np.testing.assert_array_equal(out["reducescatter"], [sum(q + 1 for q in ranks)] * 4)
        assert out["object"] == {"from": ranks[0]}
        assert out["objects"] == [q * q for q in ranks]
        if r in (1, 2):
            np.testing.assert_array_equal(out["static_allreduce"], [2, 2])
        else:
            assert out["static_allreduce"] is None
        if len(ranks) > 1:  # the even set reduced through the switch, as its own job
            assert out["stats"]["engines"].get("ina", 0) > 0, out["stats"]
        for key, error, words in [
                ("not_member", "ValueError", f"rank {r} is not in"),
                ("root_outside", "ValueError", "is not in the process set"),
                ("duplicate_set", "ValueError", "duplicate process set"),
                ("disagree", "ValueError", "ranks disagree"),
                ("bad_rank", "ValueError", f"0..{n - 1}"),
                ("not_a_set", "TypeError", "must be a ProcessSet")]:
            assert out[key]["error"] == error and words in out[key]["message"], (key, out[key])
        assert out["remove_global"] is False
        assert list(out["removed"]) == [True, True, False, None]
        assert "not registered" in out["after_remove"]["message"]
        np.testing.assert_array_equal(out["global_still"], [n, n])
    weights = [out["weights"] for out in results]
    np.testing.assert_array_equal(weights[0], weights[2])   # reduced over the even set
    assert not np.allclose(weights[0], weights[1])          # rank 1 stepped on its own


@pytest.mark.mpi
def test_process_sets_given_to_init_as_communicators(three_ranks):
    for r, out in enumerate(of_case(three_ranks, "process_sets_from_communicators")):
        assert out["refused"]["error"] == "ValueError", out["refused"]
        assert "duplicate process set" in out["refused"]["message"]
        assert out["initialized_after_refusal"] is False
        ranks = [0, 2] if r % 2 == 0 else [1]
        # Ids in the order of the list; within one entry, the sets in order of ranks.
        assert out["half"] == ((1 if r % 2 == 0 else 2), ranks, ranks.index(r))
        assert out["first"] == (3, [0], r == 0)
        np.testing.assert_array_equal(out["sum"], [sum(ranks)] * 4)


@pytest.mark.mpi
def test_a_name_reused_at_once_is_a_duplicate_and_free_after_another_submission(two_ranks):
    n = 2
    for out in of_case(two_ranks, "name_reuse"):
        assert out["at_once"]["error"] == "ValueError", out["at_once"]
        assert "already in flight" in out["at_once"]["message"]
        np.testing.assert_array_equal(out["after_another"], [n] * 3)
        assert {"OperationError", "RuntimeError"} <= set(out["internal_error_is"])
        assert len(out["step_warning"]) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in \
            out["step_warning"][0]
        assert out["skip_warning"] == []


@pytest.mark.mpi
def test_disagreeing_ranks_all_raise_and_the_runtime_goes_on(three_ranks):
    results = of_case(three_ranks, "errors")
    for r, out in enumerate(results):
        assert out["before_init"]["error"] == "ValueError"
        for key, words in [("shape", "Mismatched shape"), ("dtype", "Mismatched dtype"),
                           ("op", "Mismatched reduction op"), ("root", "Mismatched root rank"),
                           ("kind", "Mismatched operation"), ("root_range", "root rank 7"),
                           ("gather_dims", "beyond the first dimension")]:
            error = out[key]
            assert isinstance(error, dict) and "RuntimeError" in error["types"], (key, error)
            assert words in error["message"], (key, error)
        assert "rank 1: (4,)" in out["shape"]["message"]
        assert out["duplicate"]["error"] == "ValueError" and "twice" in out["duplicate"]["message"]
        assert out["adasum"]["error"] == "NotImplementedError"
        assert out["complex"]["error"] == "TypeError" and "complex64" in out["complex"]["message"]
        assert out["bool"]["error"] == "TypeError"
        assert out["not_tensor"]["error"] == "TypeError"
        assert out["bad_op"]["error"] == "ValueError" and "median" in out["bad_op"]["message"]
        assert out["splits"]["error"] == "ValueError"
        assert out["uneven"]["error"] == "ValueError"
        assert out["scatter_op"]["error"] == "ValueError"
        assert np.isnan(out["nan"][0]) and out["nan"][1] == 3.0
        np.testing.assert_array_equal(out["still_works"], np.full(3, 3.0))
        assert out["after_shutdown"]["error"] == "ValueError"


@pytest.mark.mpi
def test_a_dead_peer_fails_pending_operations_within_the_timeout():
    results = run(3, torch_cases.torch_dead_peer, {"timeout": 3.0}, timeout=90,
                  survive_dead_ranks=True)
    assert results[2].get("dead"), "the frozen rank should have been killed"
    for r in (0, 1):
        error = results[r]["error"]
        assert isinstance(error, dict) and error["error"] == "OperationTimeout", error
        assert {"CollectiveTimeout", "TimeoutError", "OperationError"} <= set(error["types"])
        assert "negotiation cycle" in error["message"], error
        assert "stopped" in results[r]["later"]["message"], results[r]["later"]


@pytest.mark.mpi
def test_join_lets_ranks_with_fewer_batches_finish(three_ranks):
    n = 3
    results = of_case(three_ranks, "join")
    for r, out in enumerate(results):
        assert out["last"] == n - 1
        for step, got in enumerate(out["sums"]):
            # ranks with more than `step` batches contribute r + 1; joined ones zero
            np.testing.assert_array_equal(got, np.full(5, float(sum(q + 1 for q in range(n)
                                                                  if q >= step))))
        np.testing.assert_array_equal(out["after"], np.full(2, float(n)))


@pytest.mark.mpi
def test_init_on_a_subset_and_again(three_ranks):
    results = of_case(three_ranks, "init")
    for r, out in enumerate(results):
        assert out["initialized_before"] is False and out["initialized_after"] is False
        assert out["bad_type"]["error"] == "TypeError"
        assert out["bad_ranks"]["error"] == "ValueError"
        if r < 2:
            assert out["subset"] is None and out["sub_size_rank"] == (2, r)
            np.testing.assert_array_equal(out["sub_sum"], np.full(3, 2.0))
        else:
            assert out["subset"]["error"] == "ValueError"
            assert "not one of those ranks" in out["subset"]["message"]
        size, rank, local_size, local_rank, cross_size, cross_rank, threads = out["world"]
        assert (size, rank, local_size, local_rank, cross_size, cross_rank) == (3, r, 3, r, 1, 0)
        assert threads is True
        np.testing.assert_array_equal(out["world_sum"], np.full(3, 3.0))
        assert out["homogeneous"] is True


def test_built_and_enabled_flags_tell_the_truth():
    """Horovod's basics: scripts and Horovod's tests branch on them (hvd.ccl_built())."""
    import ina_collectives.torch as hvd
    assert hvd.mpi_built() is True and hvd.mpi_enabled() is True
    for flag in ("gloo_built", "gloo_enabled", "ddl_built", "ccl_built", "cuda_built",
                 "rocm_built"):
        assert getattr(hvd, flag)() is False, flag
        assert flag in hvd.__all__, flag
    assert hvd.nccl_built() == 0 and isinstance(hvd.nccl_built(), int)  # a version code
    if not hvd.is_initialized():
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.mpi_threads_supported()
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.is_homogeneous()


def test_what_is_out_of_scope_says_so_under_horovods_names():
    import ina_collectives.torch as hvd
    for call, words in [(lambda: hvd.start_timeline("/tmp/timeline.json"), "timeline"),
                        (hvd.stop_timeline, "timeline")]:
        with pytest.raises(NotImplementedError, match=words):
            call()
    # Sparse tensors are in scope now (test_sparse_tensors_through_the_horovod_api); bad
    # input is refused before anything is submitted, naming what is wrong.
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2))
    with pytest.raises(ValueError, match="not Sum or Average"):
        hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), op=hvd.Max)
    for name in ("ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
                 "grouped_allgather", "grouped_reducescatter_async", "HorovodInternalError",
                 "sparse_allreduce_async", "start_timeline"):
        assert name in hvd.__all__, name


def half_scaled(values, factor):
    """Horovod's CPU scaling of float16: float32 math, one rounding back to float16."""
    return (np.asarray(values, np.float16).astype(np.float32) * np.float32(factor)
            ).astype(np.float16)


@pytest.mark.mpi
def test_float16_prescale_and_postscale_match_horovod_exactly(two_ranks):
    n, (f, g) = 2, HALF_FACTORS
    results = of_case(two_ranks, "half_scaling")
    x = lambda seed: [torch_input("float16", (17, 3), r, seed).numpy() for r in range(n)]  # noqa: E731,E501

    def want(seed, pre=1.0, post=1.0, average=False):
        total = np.zeros((17, 3), np.float16)
        for part in x(seed):
            total = total + half_scaled(part, pre)        # summed in float16, as Horovod
        return half_scaled(total, post / n if average else post)

    for out in results:
        exact = np.testing.assert_array_equal
        exact(out["allreduce/pre"], want(0, pre=f))
        exact(out["allreduce/post"], want(1, post=f))
        exact(out["allreduce/average"], want(2, f, g, average=True))
        exact(out["allreduce_"], want(3, f, g))
        exact(out["allreduce_async"], want(4, f, g))
        assert out["input_kept"], "allreduce_async with factors modified its input"
        exact(out["allreduce_async_"], want(5, f, g, average=True))
        exact(out["grouped"][0], want(6, f, g))
        exact(out["grouped"][1], want(7, f, g))
        exact(out["grouped_"][0], want(8, f, g))
        exact(out["grouped_"][1], want(9, f, g))


@pytest.mark.mpi
def test_alltoall_without_splits_returns_the_tensor_alone(two_ranks):
    n = 2
    results = of_case(two_ranks, "alltoall_forms")
    x = lambda r: np.arange(2 * n) + 100 * r  # noqa: E731
    for r, out in enumerate(results):
        want = np.concatenate([x(q)[2 * r:2 * r + 2] for q in range(n)])
        kind, got = out["plain"]
        assert kind == "Tensor"
        np.testing.assert_array_equal(got, want)
        kind, got, received = out["pair"]
        assert kind == "tuple" and received == [2] * n
        np.testing.assert_array_equal(got, want)
        # Row 2q + i of this rank landed at 2r + i on rank q, weighted there by weight(q).
        weight = lambda q: np.arange(2 * n) + 10 * q  # noqa: E731
        np.testing.assert_array_equal(
            out["grad"], np.concatenate([weight(q)[2 * r:2 * r + 2] for q in range(n)]))


@pytest.mark.mpi
def test_distributed_optimizer_names_unnamed_parameters_as_horovod(two_ranks):
    results = of_case(two_ranks, "optimizer_unnamed")
    want = ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
            "allreduce.noname.1.1"]
    for out in results:
        assert out["names"] == want
        assert out["all_names"] == [want, want]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        np.testing.assert_array_equal(a, b)  # gradients were reduced: same step everywhere


@pytest.mark.mpi
def test_broadcast_optimizer_state_scalars_none_and_fresh_optimizers(two_ranks):
    results = of_case(two_ranks, "optimizer_state")
    for out in results:
        assert out["lr"] == 0.1
        assert [entry[:3] for entry in out["counting"]] == [(3, 1.5, None)] * 2
        assert out["counting"][0][3] == [[3.0, 3.0], [3.0, 3.0]]
        assert out["frozen_grad"] is None
        np.testing.assert_array_equal(out["trained_grad"], np.zeros(4))
        assert out["momentum"] == ["momentum_buffer"]


def reference_steps(n, steps, passes=1, compression=None):
    """The same training, on one process: rank 0's model, every rank's batch averaged."""
    model, _, _ = optimizer_problem(0)
    data = [optimizer_problem(r)[1:] for r in range(n)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x0, y0 = data[0]
    loss_of(model, x0, y0).backward()  # the root's extra step before the broadcast
    opt.step()
    opt.zero_grad()
    out = []
    for _ in range(steps):
        opt.zero_grad()
        grads = []
        for x, y in data:
            model.zero_grad()
            for _ in range(passes):
                loss_of(model, x, y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            mean = sum(g[i] for g in grads) / n
            p.grad = mean.half().float() if compression == "fp16" else mean
        opt.step()
        out.append([p.detach().numpy().copy() for p in model.parameters()])
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("options", OPTIMIZER_OPTIONS)
def test_distributed_optimizer_matches_one_process(two_ranks, options):
    n, steps = 2, 2
    results = of_case(two_ranks, f"optimizer/{OPTIMIZER_OPTIONS.index(options)}")
    want = reference_steps(n, steps, options.get("passes", 1), options.get("compression"))
    tol = 1e-3 if options.get("compression") else 1e-6
    for out in results:
        assert out["isinstance"] is True
        for got, ref in zip(out["initial"], results[0]["initial"]):
            np.testing.assert_array_equal(got, ref)   # broadcast_parameters
        assert len(out["momentum"]) == 4              # broadcast_optimizer_state
        for got_step, want_step in zip(out["steps"], want):
            for got, ref in zip(got_step, want_step):
                np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
        assert out["too_many_passes"]["error"] == "AssertionError", out["too_many_passes"]
        assert out["zero_grad_early"]["error"] == "AssertionError"
        assert out["unnamed"]["error"] == "ValueError"
    for a, b in zip(results[0]["steps"][-1], results[1]["steps"][-1]):
        np.testing.assert_array_equal(a, b)  # every rank holds the same model


@pytest.mark.mpi
def test_small_gradients_wait_to_be_fused_into_calls_the_switch_serves():
    """A DistributedOptimizer holds a gradient back while it, or what is still to come
    in backward, is below switch_min_bytes (64 KiB here), and starts it together with
    the next: every step's gradients go through the switch, none alone through MPI (the
    last layer's 4 KiB came first and the first layer's 1 KiB bias last, each too small
    alone). The parameters are one process's within the switch's bound, alike on
    every rank."""
    from ina_collectives.switch.embedded import embedded_switch
    from tests.integration.torch_cases import fusion_problem, loss_of
    n, steps = 2, 3
    with embedded_switch() as sw:
        results = run(n, torch_cases.torch_optimizer_fusion, {"steps": steps, "min_bytes": 65536},
                      env={"INA_SWITCH": sw.address_text})
    for out in results:
        assert set(out["engines"]) == {"ina"}, out["engines"]
        assert steps <= out["engines"]["ina"] <= 2 * steps, out["engines"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        np.testing.assert_array_equal(a, b)
    model, _, _ = fusion_problem(0)
    batches = [fusion_problem(r)[1:] for r in range(n)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        (sum(loss_of(model, x, y) for x, y in batches) / n).backward()
        opt.step()
    for got, want in zip(results[0]["params"], model.parameters()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.mpi
def test_training_demo_through_ina_run_matches_the_ring_and_says_why():
    """The README's main job (`make demo`), smaller: ina-run starts the embedded switch
    and 2 ranks, which train through the switch and then on the ring; the demo exits 0
    only if the final losses agree within its tolerance, and rank 0 ends with the
    summary, the waits of both runs and one line on why one machine favours the ring."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import ROOT as root

    ina_run = Path(sys.executable).parent / "ina-run"
    command = [str(ina_run)] if ina_run.exists() else [sys.executable, "-m",
                                                        "ina_collectives.launch"]
    proc = subprocess.run(
        [*command, "-np", "2", "--", sys.executable, str(root / "examples" / "train_mlp.py"),
         "--epochs", "2", "--samples", "4096", "--hidden", "384", "--compare-ring"],
        cwd=root, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "; on the ring (exact sums): " in output and ": OK" in output, output
    # (An epoch's line ends with the engines that served it.)
    epochs = [line for line in proc.stdout.splitlines() if re.search(r"\{'\w+': \d+", line)]
    assert len(epochs) == 4, output  # two epochs through the switch, two on the ring
    assert all("'ina'" in line for line in epochs[:2]), output
    assert not any("'ina'" in line for line in epochs[2:]), output
    assert "embedded ina-switch on 127.0.0.1:" in output, output
    # Rank 0 alone ends with the summary, the waits and why, once each.
    last = proc.stdout.strip().splitlines()[-3:]
    assert re.search(r"Summary of the switch's run: ina served \d+ of \d+ calls .*"
                     r"Kernels: compiled\.$", last[0]), output
    assert re.search(r"Waiting for the gradients, per step: [0-9.]+ ms through the "
                     r"switch, [0-9.]+ ms on the ring\.$", last[1]), output
    assert "core(s) run the software switch and all 2 ranks" in last[2], output
    assert last[2].endswith("To see INA pay: python -m bench.cluster.netsim --quick, as root "
                            "(emulated, shaped links put the cores out of the way)."), output
    assert proc.stdout.count("Summary of the switch's run") == 1, output


def test_horovod_variables_set_the_shared_settings(monkeypatch):
    from ina_collectives.settings import horovod_environment
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")          # milliseconds in Horovod
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "7")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "9")
    assert horovod_environment() == {
        "fusion_threshold": 1 << 20, "cycle_time": 0.005, "stall_warning_time": 7.0,
        "stall_shutdown_time": 9.0}
    monkeypatch.setenv("INA_CYCLE_TIME", "0.002")            # ours wins where both are set
    assert "cycle_time" not in horovod_environment()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        horovod_environment()


@pytest.mark.mpi
def test_sparse_tensors_through_the_horovod_api(three_ranks):
    """sparse_allreduce_async and allreduce of sparse COO tensors are the exact sums (or
    averages) of every rank's entries, coalesced, also with a rank that has none; bad
    input fails on every rank naming it; the DistributedOptimizer takes an
    nn.Embedding(sparse=True)'s gradients sparse and as dense, alike on every rank."""
    from tests.integration.torch_cases import sparse_input
    n = 3
    results = of_case(three_ranks, "sparse")
    dense = sum(sparse_input(r).to_dense() for r in range(n)).numpy()
    for r, out in enumerate(results):
        assert "error" not in out, out
        np.testing.assert_allclose(out["sum"], dense, rtol=1e-6)
        np.testing.assert_allclose(out["average"], dense / n, rtol=1e-6)
        np.testing.assert_allclose(out["allreduce"], dense, rtol=1e-6)
        assert out["coalesced"]
        assert out["shapes"]["error"] == "ValueError", out["shapes"]
        assert "the ranks' tensors differ" in out["shapes"]["message"]
        assert "(40, 3)" in out["shapes"]["message"] and "(42, 3)" in out["shapes"]["message"]
        assert out["range"]["error"] == "ValueError", out["range"]
        assert "rank(s) [0] passed indices outside" in out["range"]["message"]
        assert out["dense"]["error"] == "TypeError" and "sparse COO" in out["dense"]["message"]
        assert out["op"]["error"] == "ValueError" and "not Sum or Average" in out["op"]["message"]
        np.testing.assert_array_equal(out["after"], [n, n, n])
        for key in ("weight_False", "weight_True"):
            np.testing.assert_allclose(out[key], results[0][key], rtol=1e-6)
    # sparse and sparse_as_dense: the same update (exact path, no switch here)
    np.testing.assert_allclose(results[0]["weight_False"], results[0]["weight_True"],
                               rtol=1e-6)


@pytest.mark.mpi
def test_the_runtime_rescues_a_call_one_rank_lost_after_another_returned():
    """All or nothing without a vote under the Horovod runtime: its negotiation is the
    gate (docs/protocol.md). Rank 0 returned from the call and killed the switch; rank 1
    lost the results, reaches its silence bound and posts TROUBLE; rank 0's runtime
    meets it in its next negotiation and sends its kept window. Same bits, exact sum,
    and the next call on an exact engine."""
    from ina_collectives.switch.embedded import embedded_switch
    count = 5000
    with embedded_switch() as sw:
        results = run(2, torch_cases.torch_switch_dies_after_the_last_result,
                      {"count": count, "switch_pid": sw.process.pid},
                      env={"INA_SWITCH": sw.address_text})
    expected = np.arange(count, dtype=np.float32) * 3
    for out in results:
        assert "error" not in out, out
        np.testing.assert_array_equal(out["second"], expected)
        np.testing.assert_array_equal(out["third"], 4.0)
        assert out["switch"]["outages"] == 1, out["switch"]
    assert results[0]["second"].tobytes() == results[1]["second"].tobytes()
    assert results[1]["switch"]["rescued_calls"] == 1, results[1]["switch"]
    assert results[0]["switch"]["rescued_calls"] == 0
    assert results[1]["seconds"] >= 1.5


@pytest.mark.mpi
def test_the_runtime_opens_each_call_of_a_cycle_and_rescues_across_them():
    """Two calls in one cycle (docs/protocol.md, A call's opening): each opens through the
    switch and ends without a vote, the first because the second's opening is a gate. A
    rank deaf from the first call's stream on: the other holds every result and opens
    the second; the deaf rank takes the first call's bits from the other's kept window
    (ina/windows.py: it asks for it directly), both end the second in the rescue, which
    takes the ring. Same bits on both ranks, exact sums."""
    from ina_collectives.switch.embedded import embedded_switch
    count = 5000
    with embedded_switch() as sw:
        results = run(2, torch_cases.torch_two_calls_a_cycle, {"count": count},
                      env={"INA_SWITCH": sw.address_text})
    base = np.arange(count, dtype=np.float64) * 3
    for out in results:
        assert "error" not in out, out
        assert out["clean_opened"] == 2 and out["clean_vote_free"] == 2, out
        for got, scale in ((out["clean"], 1.0), (out["deaf"], 2.0)):
            np.testing.assert_array_equal(got[1], base * scale)
            np.testing.assert_allclose(got[0], base * scale, rtol=1e-6)
        assert out["switch"]["outages"] == 1, out["switch"]
    for i in range(2):
        assert results[0]["deaf"][i].tobytes() == results[1]["deaf"][i].tobytes()
    assert results[1]["switch"]["peer_completed_calls"] == 1, results[1]["switch"]
    assert results[0]["switch"]["failed_openings"] == 1, results[0]["switch"]


@pytest.mark.mpi
def test_hot_rows_of_a_sparse_tensor_go_through_the_switch():
    """Libra's split: after the first period the rows touched most over the ranks are
    elected (the same on every rank) and summed through the switch; the others are
    gathered exactly. Every step's result is the sum within the switch's bound on the
    hot rows and exact on the rest, has exactly the rows some rank touched, and is the
    same on every rank."""
    from ina_collectives.switch.embedded import embedded_switch
    from tests.integration.torch_cases import skewed_sparse
    n, steps = 3, 6
    with embedded_switch() as sw:
        results = run(n, torch_cases.torch_sparse_hot, {"steps": steps, "hot_rows": 6},
                      env={"INA_SWITCH": sw.address_text})
    for step in range(steps):
        inputs = [skewed_sparse(r, step) for r in range(n)]
        exact = sum(x.to_dense() for x in inputs).numpy()
        touched = np.unique(np.concatenate([x.coalesce().indices()[0].numpy()
                                            for x in inputs]))
        for out in results:
            got = out["results"][step]
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
            assert out["nnz"][step] == touched.size, (step, out["nnz"][step], touched)
            assert got.tobytes() == results[0]["results"][step].tobytes()
    tables = [next(iter(out["sparse"].values())) for out in results]
    for out, table in zip(results, tables):
        # Calls 0-1 exact (timed), 2-3 a trial of the 6 hot rows, then kept or set aside
        # by the times, alike on every rank.
        assert table["calls"] == steps, table
        assert (table["hot_rows"], table["trials_declined"]) in ((6, 0), (0, 1)), table
        assert {k: v for k, v in table.items() if not k.startswith("bytes")} == \
            {k: v for k, v in tables[0].items() if not k.startswith("bytes")}
        assert table["hot_share_of_touched_rows"] > 0.05, table  # 2 calls of 6
        assert table["bytes_through_allreduce"] > 0 and table["bytes_gathered"] > 0, table
        assert out["engines"].get("ina", 0) > 0, out["engines"]  # the hot blocks


@pytest.mark.mpi
def test_bad_sparse_input_with_hot_rows_on_is_named_on_every_rank():
    """While hot rows are tried (calls 2-3, sparse_reelect_calls 2), rank 1 passes an
    index outside its table, then a table of another size: every rank raises ValueError
    naming it (the ranks still submit the same operations, so none waits for a hot
    block another never sent), and the next good call works."""
    from ina_collectives.switch.embedded import embedded_switch
    from tests.integration.torch_cases import skewed_sparse
    n = 3
    with embedded_switch() as sw:
        results = run(n, torch_cases.torch_sparse_hot, {"steps": 2, "hot_rows": 6, "bad": True},
                      env={"INA_SWITCH": sw.address_text}, timeout=120)
    for out in results:
        assert out["outside"]["error"] == "ValueError", out["outside"]
        assert "rank(s) [1] passed indices outside" in out["outside"]["message"]
        assert out["shapes"]["error"] == "ValueError", out["shapes"]
        assert "the ranks' tensors differ" in out["shapes"]["message"]
        assert "rank 1: (101, 4)" in out["shapes"]["message"], out["shapes"]
        exact = sum(skewed_sparse(r, 99).to_dense() for r in range(n)).numpy()
        np.testing.assert_allclose(out["after"], exact, rtol=1e-5,
                                   atol=1e-6 * np.abs(exact).max())


@pytest.mark.mpi
def test_priority_orders_ready_tensors_alike_on_every_rank_and_preempts_partitions(
        three_ranks):
    """Ranks submit six tensors in orders of their own, ready in one round: every rank
    reduces them by priority (lowest first), in the world's runtime and in a process
    set's. A large tensor of low priority cut into 64 partitions runs one partition a
    round, and small high-priority tensors submitted just after it finish before it
    does. Every sum is right (docs/ordering.md)."""
    results = of_case(three_ranks, "priority")
    for out in results:
        assert "error" not in out, out
        assert out["right"], out
        assert out["together"] == [f"t{i}" for i in range(5, -1, -1)], out
        assert out["preempted"][-1] == "big", out
        assert out["preempted"][:3] == ["small0", "small1", "small2"], out
        # a process set's runtime (ranks 0 and 1; rank 2 alone) orders its own alike
        assert out["subset"] == [f"t{i}" for i in range(5, -1, -1)], out
    assert results[0]["together"] == results[1]["together"] == results[2]["together"]


@pytest.mark.mpi
def test_fifo_ordering_keeps_the_agreed_order(two_ranks):
    """INA_ORDERING=fifo (Horovod's order, bench.cluster.training's baseline): tensors ready in
    one round run in the order the ranks agreed on (that of the rank whose submissions
    the negotiation saw first), not by priority, alike on every rank; the sums are
    right."""
    results = of_case(two_ranks, "priority_fifo")
    submitted = [out["mine"] for out in results]
    assert [f"t{i}" for i in range(5, -1, -1)] not in submitted  # (else it shows nothing)
    for out in results:
        assert "error" not in out, out
        assert out["right"] and out["together"] in submitted, (out, submitted)
        assert out["together"] == results[0]["together"]


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer,loss", [("sgd", 0.0), ("adam", 0.0), ("sgd", 0.02)])
def test_overlap_gives_the_parameters_of_the_plain_loop(switch, faults, optimizer, loss):
    """DistributedOptimizer(overlap=model): step() returns at once and each module is
    updated at its next forward; after synchronize() the parameters are bit for bit the
    plain loop's (through the switch, gradients cut into 16 KiB partitions and reduced
    first layers first: with K a multiple of B, a float's result does not depend on the
    order or the fusion), also with 2% of the packets lost each way (partitions' packets
    resent). Updates were pending after the last step. Every call opens
    (INA_INTERNAL_SWITCH_PREDICT=0): a predicted call's first window is summed with exponents
    learned from the call before it of the same length, which the order changes
    (docs/quantization.md)."""
    n, steps = 2, 4
    if loss:
        faults(drop_in=loss, drop_out=loss)
    results = run(n, torch_cases.torch_overlap, {"steps": steps, "optimizer": optimizer},
                  env={"INA_SWITCH": switch.address_text, "INA_SWITCH_MIN_BYTES": "0",
                       "INA_SWITCH_ELEMENTS": "1024", "INA_PARTITION_BYTES": "16384",
                       "INA_INTERNAL_SWITCH_PREDICT": "0"})
    for out in results:
        assert "error" not in out, out
        assert set(out["engines"]) == {"ina"}, out["engines"]
        assert out["pending_before_synchronize"] == 6, out
        if loss:
            assert out["resent"] > 0, out["resent"]
        for a, b in zip(out["plain"], out["overlap"]):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(results[0]["overlap"], results[1]["overlap"]):
        np.testing.assert_array_equal(a, b)
