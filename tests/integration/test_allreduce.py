"""ina_collectives.allreduce on real mpiexec jobs: values, layouts, errors, stats."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.inputs import FLOATS, INTS, OPS, check_result
from tests.integration import mpirun, rank_cases

pytestmark = pytest.mark.mpi


def _valid(dtype: str, op: str) -> bool:
    return not (op == "average" and dtype in INTS)


def _check_job(n: int, cases: list, results: list, *, same_bits: bool = True) -> None:
    for i, (dtype, op, count, seed) in enumerate(cases):
        per_rank = [r["results"][i] for r in results]
        for rank, got in enumerate(per_rank):
            assert isinstance(got, np.ndarray), f"case {cases[i]} rank {rank}: {got}"
            check_result(got, dtype, op, count, seed, n)
        if same_bits:
            assert len({got.tobytes() for got in per_rank}) == 1, \
                f"case {cases[i]}: ranks disagree on the result's bits"


case_strategy = st.tuples(
    st.sampled_from(FLOATS + INTS), st.sampled_from(OPS),
    st.one_of(st.integers(0, 40), st.integers(0, 5000), st.integers(100_000, 300_000)),
    st.integers(0, 2**31),
).filter(lambda c: _valid(c[0], c[1]))


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), cases=st.lists(case_strategy, min_size=1, max_size=12),
       chunk_bytes=st.sampled_from([8, 100, 4096, 1 << 20]))
def test_ring_matches_numpy_reduction(n, cases, chunk_bytes):
    """Hypothesis: random shapes, dtypes and ops against NumPy's reduction of all ranks'
    inputs, with chunk sizes down to one element so the pipeline has many stages."""
    settings_ = {"ring_min_bytes": 0, "ring_chunk_bytes": chunk_bytes}
    results = mpirun.run(n, rank_cases.allreduce_cases, {"cases": cases, "settings": settings_})
    _check_job(n, cases, results)
    for r in results:
        assert r["stats"]["engines"] == {"ring": len(cases)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_lengths_around_segment_and_chunk_edges(n):
    """0, 1, < n, not divisible by n, and multi-chunk lengths for every dtype and op."""
    lengths = [0, 1, n - 1, n + 1, 7 * n + 3, 1000, 262_147]
    cases = [(dtype, op, length, 11 * length + i)
             for i, (dtype, op) in enumerate((d, o) for d in FLOATS + INTS for o in OPS
                                             if _valid(d, o))
             for length in lengths[i % 3::3] + [262_147 if i % 2 else 1]]
    results = mpirun.run(n, rank_cases.allreduce_cases,
                         {"cases": cases, "settings": {"ring_min_bytes": 0,
                                                       "ring_chunk_bytes": 64 * 1024}})
    _check_job(n, cases, results)


def test_large_float32_sum_on_four_ranks():
    # (Many ring chunks and an odd tail; 64 MiB through the switch: test_ina.py.)
    cases = [("float32", "sum", 4 * 1024 * 1024 + 5, 1), ("float32", "average", 1_000_001, 2)]
    results = mpirun.run(4, rank_cases.allreduce_cases, {"cases": cases}, timeout=300)
    _check_job(4, cases, results)


def test_small_arrays_go_to_mpi_and_stats_say_why():
    cases = [("float32", "sum", 10, 1), ("float64", "max", 100_000, 2)]
    results = mpirun.run(2, rank_cases.allreduce_cases,
                         {"cases": cases, "settings": {"ring_min_bytes": 4096}})
    _check_job(2, cases, results)
    stats = results[0]["stats"]
    assert stats["calls"] == 2
    assert stats["engines"] == {"mpi": 1, "ring": 1}
    assert stats["bytes"] == 10 * 4 + 100_000 * 8
    assert stats["fallback_reasons"] == {"ring: below ring_min_bytes (4096)": 1}
    assert stats["last_call"]["engine"] == "ring"
    # No INA_SWITCH: stats say so, rather than nothing.
    assert stats["switch"]["configured"] is False and not stats["switch"]["serving"]
    assert "no switch configured (INA_SWITCH is unset)" in stats["switch"]["reason"]


def test_layouts_in_place_out_and_non_contiguous():
    n = 3
    results = mpirun.run(n, rank_cases.layouts)
    total = sum(r["base"] for r in results)
    for r in results:
        for key in ("new", "in_place", "fortran", "strided_in", "strided_out"):
            np.testing.assert_allclose(r[key], total, rtol=1e-5, err_msg=key)
        assert (r["strided_out_untouched"] == 0).all()
        assert r["scalar"] == sum(range(n)) and r["scalar"].shape == ()
        np.testing.assert_array_equal(r["list"], [n, 2 * n, 3 * n])
    assert len({r["fortran"].tobytes() for r in results}) == 1


@pytest.mark.parametrize("what", ["length", "dtype", "op"])
def test_ranks_that_disagree_all_get_a_clear_error(what):
    n = 3
    results = mpirun.run(n, rank_cases.disagree, {"what": what})
    for r in results:
        first = r["first"]
        assert isinstance(first, dict) and first["error"] == "AgreementError", first
        assert "ValueError" in first["types"]
        assert what in first["message"] and "rank 2:" in first["message"], first["message"]
        np.testing.assert_array_equal(r["second"], np.full(10, n, np.float32))


def test_rank_that_never_arrives_times_out_naming_the_wait():
    results = mpirun.run(3, rank_cases.rank_absent, {"timeout": 2.0}, timeout=60)
    for r in results[:2]:
        first = r["first"]
        assert first["error"] == "CollectiveTimeout", first
        assert "waited 2 s for all 3 ranks to enter allreduce #1" in first["message"]
        assert r["after"]["error"] == "CommunicatorBroken"


def test_bad_arguments_raise_named_errors_on_every_rank():
    results = mpirun.run(2, rank_cases.local_errors)
    for r in results:
        def err(name):
            return r[name]["error"], r[name]["message"]
        assert err("before_init")[0] == "RuntimeError" and "init()" in err("before_init")[1]
        kind, msg = err("average_int")
        assert kind == "ValueError" and "AVERAGE" in msg and "int32" in msg
        kind, msg = err("bool_sum")
        assert kind == "TypeError" and "bool" in msg and "SUM" in msg
        kind, msg = err("complex_max")
        assert kind == "TypeError" and "MAX" in msg and "complex64" in msg
        assert err("object_dtype")[0] == "TypeError"
        assert err("bad_op_name")[0] == "ValueError" and "median" in err("bad_op_name")[1]
        assert err("maxloc")[0] == "ValueError"
        assert err("out_shape")[0] == "ValueError" and "(4,)" in err("out_shape")[1]
        assert err("out_dtype")[0] == "TypeError" and "float32" in err("out_dtype")[1]
        assert err("out_readonly")[0] == "ValueError"
        assert err("reinit")[0] == "RuntimeError"
        assert err("bad_setting")[0] == "TypeError" and "no_such_setting" in err("bad_setting")[1]
        np.testing.assert_array_equal(r["still_works"], [2.0, 2.0])


@pytest.mark.mpi
def test_an_unparsable_switch_address_fails_init_on_every_rank():
    """A typo in INA_SWITCH is a mistake, not an outage: init raises, naming it, instead of
    every call quietly taking the ring."""
    results = mpirun.run(2, rank_cases.allreduce_cases, {"cases": [("float32", "sum", 10, 1)]},
                         env={"INA_SWITCH": "127.0.0.1:notaport"})
    for r in results:
        assert r["error"] == "ValueError", r
        assert r["message"].startswith("INA_SWITCH='127.0.0.1:notaport': switch address"), r
        assert "is not a number" in r["message"], r



@pytest.mark.mpi
def test_require_switch_fails_init_on_every_rank_saying_why(closed_udp_port):
    """INA_REQUIRE_SWITCH=1: a switch that does not answer, or none configured, fails
    init() on every rank (any launcher), instead of a warning and the ring."""
    case = {"cases": [("float32", "sum", 10, 1)], "settings": {"switch_join_timeout": 1.0}}
    silent = mpirun.run(2, rank_cases.allreduce_cases, case, env={
        "INA_REQUIRE_SWITCH": "1", "INA_SWITCH": f"127.0.0.1:{closed_udp_port}"})
    unset = mpirun.run(2, rank_cases.allreduce_cases, case, env={"INA_REQUIRE_SWITCH": "1"})
    for r in silent:
        assert r["error"] == "AggregatorUnavailable", r
        assert r["message"].startswith("INA_REQUIRE_SWITCH is set and the switch cannot "
                                       "serve: "), r
        assert f"127.0.0.1:{closed_udp_port}" in r["message"], r
    for r in unset:
        assert r["error"] == "AggregatorUnavailable", r
        assert "no switch is configured: set INA_SWITCH" in r["message"], r


@pytest.mark.mpi
def test_a_job_wide_warning_is_logged_once_by_rank_0(closed_udp_port):
    """Every rank learns together that the switch does not answer; the job says so once
    (rank 0), not once per rank."""
    from ina_collectives.launch.ranks import find_mpiexec

    code = ("import numpy as np, ina_collectives as ina\n"
            "ina.init(switch_join_timeout=0.5)\n"
            "ina.allreduce(np.ones(4, np.float32))\n"
            "ina.finalize()\n")
    proc = subprocess.run(
        [find_mpiexec(), "-n", "3", sys.executable, "-c", code],
        env=dict(os.environ, INA_SWITCH=f"127.0.0.1:{closed_udp_port}"),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "calls take the ring" in line]
    assert len(warned) == 1, proc.stderr
    assert f"127.0.0.1:{closed_udp_port}" in warned[0], warned
