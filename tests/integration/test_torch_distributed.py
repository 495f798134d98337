"""The torch.distributed backend "ina" under real mpiexec jobs of 2-4 ranks, with and
without a software switch: every collective and dtype against values computed here,
ranks that disagree, DDP against one process (examples/train_ddp.py, with DDP's fp16
communication hook too), and a switch killed mid-training."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the backend needs torch: pip install "
                            "'ina-collectives[torch]'")

from ina_collectives.runtime.scaling import split_rows  # noqa: E402
from ina_collectives.switch.embedded import embedded_switch  # noqa: E402
from tests.conftest import ROOT, _child_env  # noqa: E402
from tests.integration import ddp_cases, mpirun  # noqa: E402
from tests.integration.ddp_cases import DTYPES  # noqa: E402
from tests.integration.test_horovod import as_np, close  # noqa: E402
from tests.integration.torch_cases import torch_input  # noqa: E402

pytestmark = pytest.mark.mpi


def run(n, case, params=None, env=None, timeout=120.0):
    return mpirun.run(n, case, params, env=env, timeout=timeout)


def reduced(dtype, op, shape, n, seed):
    xs = np.stack([as_np(torch_input(dtype, shape, r, seed)) for r in range(n)])
    if op == "SUM":
        return xs.astype(np.float64 if xs.dtype.kind == "f" else np.int64).sum(axis=0)
    if op == "AVG":
        return xs.astype(np.float64).mean(axis=0)
    if op == "PRODUCT":
        return xs.astype(np.float64).prod(axis=0)
    if op in ("MIN", "MAX"):
        return xs.min(axis=0) if op == "MIN" else xs.max(axis=0)
    return {"BAND": np.bitwise_and, "BOR": np.bitwise_or,
            "BXOR": np.bitwise_xor}[op].reduce(xs, axis=0)


@pytest.fixture(scope="module")
def three_ranks(switch):
    """One mpiexec job of 3 ranks for the cases that run on 3 (one launch, not three):
    every collective through the switch ("switch") and exact ("exact"), then point to
    point ("p2p", last: it leaves a timed-out gate's messages posted)."""
    return run(3, mpirun.several, mpirun.cases(
        ("switch", ddp_cases.ddp_ops, None, {"INA_SWITCH": switch.address_text,
                                             "INA_SWITCH_MIN_BYTES": "0"}),
        ("exact", ddp_cases.ddp_ops, None, {"INA_SWITCH": "", "INA_SWITCH_MIN_BYTES": "0"}),
        ("p2p", ddp_cases.ddp_p2p, None, {"INA_SWITCH": ""})))


@pytest.fixture(scope="module")
def two_ranks(switch):
    """One mpiexec job of 2 ranks for the cases that run on 2: ranks that disagree
    ("mismatch", no switch) and the optimizer's overlap through the switch ("overlap")."""
    # (every call opened: INA_INTERNAL_SWITCH_PREDICT=0, as test_horovod's overlap test says why)
    return run(2, mpirun.several, mpirun.cases(
        ("mismatch", ddp_cases.ddp_mismatch, None, {"INA_SWITCH": ""}),
        ("overlap", ddp_cases.dist_overlap, {"steps": 4},
         {"INA_SWITCH": switch.address_text, "INA_SWITCH_MIN_BYTES": "0",
          "INA_SWITCH_ELEMENTS": "1024", "INA_PARTITION_BYTES": "4096",
          "INA_INTERNAL_SWITCH_PREDICT": "0"})))


def of_case(results, name):
    """Each rank's result of case ``name`` of a job of ``mpirun.several``."""
    return [mpirun.case_result(out, name, r) for r, out in enumerate(results)]


@pytest.mark.parametrize("through", ["switch", "exact"])
def test_every_collective_and_dtype(three_ranks, through):
    n = 3
    for r, out in enumerate(of_case(three_ranks, through)):
        assert "error" not in out, out
        for dtype in DTYPES:
            floating = dtype.startswith(("float", "bfloat"))
            ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (
                ["AVG"] if floating else ["BAND", "BOR", "BXOR"])
            for op in ops:
                want = reduced(dtype, op, (5, 3), n, ops.index(op))
                if dtype == "uint8" and op in ("SUM", "PRODUCT"):
                    want = want.astype(np.int64) % 256  # uint8 wraps, as in torch
                close(out[f"all_reduce/{dtype}/{op}"], want, dtype)
            total = reduced(dtype, "SUM", (4,), n, 1)
            close(out[f"async/{dtype}"], total % 256 if dtype == "uint8" else total, dtype)
            for q, got in enumerate(out[f"all_gather/{dtype}"]):
                close(got, as_np(torch_input(dtype, (2, 2), q, 2)), dtype)
            close(out[f"all_gather_into_tensor/{dtype}"], np.concatenate(
                [as_np(torch_input(dtype, (2,), q, 3)) for q in range(n)]), dtype)
            close(out[f"broadcast/{dtype}"], as_np(torch_input(dtype, (3,), n - 1, 4)), dtype)
            for q, (a, b) in enumerate(out[f"all_gather_coalesced/{dtype}"]):
                close(a, as_np(torch_input(dtype, (2,), q, 60)), dtype)
                close(b, as_np(torch_input(dtype, (1, 3), q, 61)), dtype)
            close(out[f"reduce_scatter/{dtype}"], reduced(dtype, "SUM", (2,), n, 10 + r),
                  dtype)
            lo, hi = split_rows(2 * n, n, r)
            close(out[f"reduce_scatter_tensor/{dtype}"],
                  reduced(dtype, "SUM", (2 * n,), n, 5)[lo:hi], dtype)
            start = r * (r + 1) // 2  # rank q's rows for rank r
            close(out[f"all_to_all_single/{dtype}"], np.concatenate(
                [as_np(torch_input(dtype, (n * (n + 1) // 2,), q, 6))[start:start + r + 1]
                 for q in range(n)]), dtype)
            for q, got in enumerate(out[f"all_to_all/{dtype}"]):
                close(got, as_np(torch_input(dtype, (2,), q, 20 + r)), dtype)
            if r == n - 1:
                for q, got in enumerate(out[f"gather/{dtype}"]):
                    close(got, as_np(torch_input(dtype, (2,), q, 30)), dtype)
            else:
                assert out[f"gather/{dtype}"] is None
            close(out[f"scatter/{dtype}"], as_np(torch_input(dtype, (3,), r, 40)), dtype)
        engines = out["stats"]["engines"]
        assert out["package_stats"]["engines"] == engines
        summary = out["package_summary"]
        assert summary.startswith(f"ina served {engines.get('ina', 0)} of "), summary
        if through == "switch":
            assert engines.get("ina", 0) > 0, out["stats"]
            assert summary.endswith("Kernels: compiled."), summary
        else:
            assert "ina" not in engines, out["stats"]
            assert "No switch configured" in summary, summary


def test_ranks_that_disagree_get_torchs_error_on_every_rank(two_ranks):
    # (Each call checked at its own gate, in program order: runtime/ordered.py.)
    for out in of_case(two_ranks, "mismatch"):
        for key, words in [("shape", "disagree on the length"),
                           ("dtype", "disagree on the dtype"),
                           ("op", "disagree on the op"),
                           ("kind", "disagree on the API")]:
            assert out[key]["error"] == "DistBackendError", (key, out[key])
            assert words in out[key]["message"] and "rank 1" in out[key]["message"], out[key]
        assert out["premul"]["error"] == "ValueError", out["premul"]
        assert "PREMUL_SUM" in out["premul"]["message"]
        # Dtypes torch passes on as they are and the backend does not take.
        for key in ("bool_broadcast", "bool_gather", "bool_scatter"):
            assert out[key]["error"] == "TypeError", (key, out[key])
            assert "torch.bool is not supported" in out[key]["message"], out[key]
        np.testing.assert_array_equal(out["after"], [2, 2, 2])


def ddp_demo(n, *extra):
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch", "-np", str(n),
                           "--", sys.executable, "examples/train_ddp.py", "--epochs", "1",
                           "--samples", "4096", *extra],
                          cwd=ROOT, env=_child_env({}), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "): OK" in proc.stdout, proc.stdout
    engines = re.findall(r"engines (\{.*\})", proc.stdout)
    assert "'ina'" in engines[-1], proc.stdout  # DDP's buckets went through the switch
    return proc.stdout


# (4 ranks with the INA hook, its example; with no hook: the torchrun demo at 4 ranks
# below, and every other DDP job of the suite.)
@pytest.mark.parametrize("n, hook", [(2, "fp16"), (4, "ina")])
def test_ddp_demo_through_the_switch_matches_one_process(n, hook):
    out = ddp_demo(n, "--hook", hook)
    assert f"comm hook {hook}" in out


# (The Horovod API's sparse path: test_horovod.py's sparse cases.)
@pytest.mark.parametrize("api", ["ddp"])
def test_embedding_demo_with_sparse_gradients_matches_one_process(api):
    """examples/train_embedding.py on 4 ranks: a DLRM-shaped click model whose embedding
    tables have sparse gradients, with DDP on backend "ina" and with the Horovod API (its
    64 hottest rows per table tried through the switch), ends within 1% of one
    process; the dense layers' gradients went through the switch."""
    env = {"INA_SWITCH_MIN_BYTES": "0"}
    if api == "horovod":
        env["INA_SPARSE_HOT_ROWS"] = "64"
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch", "-np", "4",
                           "--", sys.executable, "examples/train_embedding.py",
                           "--api", api, "--epochs", "1", "--samples", "8192"],
                          cwd=ROOT, env=_child_env(env), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "): OK" in proc.stdout, proc.stdout
    engines = re.findall(r"engines (\{.*\})", proc.stdout)
    assert "'ina'" in engines[-1], proc.stdout
    if api == "horovod":
        tables = dict(re.findall(r"sparse grad\.(\w+)\.weight: (\{.*\})", proc.stdout))
        assert set(tables) == {"user", "item"}, proc.stdout
        for table in tables.values():
            report = ast.literal_eval(table)
            # Tried after the first 20 calls, then kept or set aside by the times.
            assert report["bytes_through_allreduce"] > 0, report
            assert report["hot_rows"] == 64 or report["trials_declined"] > 0, report
            assert 0 < report["hot_share_of_touched_rows"] < 1, report


# (3 ranks: an odd count; the suite's other DDP jobs run 2 and 4.)
@pytest.mark.parametrize("n", [3])
def test_ddp_goes_on_when_the_switch_is_killed_mid_training(n):
    with embedded_switch() as sw:
        params = {"steps": 12, "kill_after_steps": 5, "switch_pid": sw.pid}
        # The reference (exact path, no switch) in the same job, after: one launch.
        job = run(n, mpirun.several, mpirun.cases(
            ("killed", ddp_cases.ddp_train, params, {
                "INA_SWITCH": sw.address_text, "INA_SWITCH_MIN_BYTES": "0",
                "INA_SWITCH_SILENCE": "1.0"}),
            ("reference", ddp_cases.ddp_train, {"steps": 12}, {"INA_SWITCH": ""})),
            timeout=180)
        assert sw.process.wait(5) == -9
    results, reference = of_case(job, "killed"), of_case(job, "reference")
    for out, ref in zip(results, reference):
        assert "error" not in out, out
        assert out["engines"][4].get("ina", 0) > 0, out["engines"]   # served before
        assert out["engines"][-1].get("ring", 0) + out["engines"][-1].get("mpi", 0) > \
            out["engines"][5].get("ring", 0) + out["engines"][5].get("mpi", 0)  # and after
        for got, want in zip(out["params"], ref["params"]):
            # The switch's quantized sums for 5 steps, exact ones after.
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for out in results[1:]:
        for a, b in zip(out["params"], results[0]["params"]):
            np.testing.assert_array_equal(a, b)  # every rank the same bits


@pytest.mark.mpi
def test_set_quorum_on_the_default_group_leaves_a_straggler_out():
    """ina_collectives.set_quorum(2) under torch.distributed (backend "ina"), three ranks,
    rank 2's packets held back by the switch: AVG is the mean of ranks 0 and 1."""
    import numpy as np

    from ina_collectives.switch import send_faults
    from ina_collectives.switch.embedded import embedded_switch

    with embedded_switch() as sw:
        send_faults((sw.host, sw.port), straggler_worker=2, straggler_delay_ms=150)
        results = run(3, ddp_cases.ddp_quorum, {"quorum": 2},
                      env={"INA_SWITCH": sw.address_text, "INA_SWITCH_MIN_BYTES": "0"},
                      timeout=180)
    xs = np.stack([np.random.default_rng(70 + r).standard_normal(70_000).astype(np.float32)
                   for r in range(3)]).astype(np.float64)
    for op, exact in (("AVG", xs[:2].mean(axis=0)), ("SUM", xs[:2].sum(axis=0))):
        got = results[0][op]
        assert np.abs(got - exact).max() < 1e-4, op  # (the bound: test_torch's quorum test)
        assert all((r[op] == got).all() for r in results), f"{op}: ranks differ"
    assert [r["counted"] for r in results] == [True, True, False]
    assert results[0]["report"]["mode"] == "quorum 2", results[0]["report"]


# -- under torchrun: no MPI job at all -------------------------------------------------------

def torchrun(n, case, params=None, env=None, through_ina_run=False, timeout=180.0,
             reference=False):
    """Run a rank function (ddp_cases') on n ranks that torchrun starts (through
    ``ina-run --launcher torchrun``, or torchrun alone); each rank's result by rank.
    ``reference``: a run on gloo to compare with, whose exit code is not judged (seen
    twice here: torch's gloo groups of a DeviceMesh abort the process at exit, after
    the case has returned and its result is written); its results must all be there.
    (One rank function a job here: a second init_process_group("ina") in a process
    that torchrun started finds the first's keys in torchrun's store and fails.)"""
    import pickle
    import socket
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="ina-torchrun-") as out:
        script = mpirun.rank_args(case, params, out, torchrun=True)
        if through_ina_run:
            line = [sys.executable, "-m", "ina_collectives.launch", "--launcher", "torchrun",
                    "-np", str(n), "--", sys.executable, *script]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            line = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(n), "--master-addr", "127.0.0.1", "--master-port", str(port), *script]
        proc = subprocess.run(line, cwd=ROOT, env=_child_env(env), capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0 or reference, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(n)]
    for r in results:
        assert not (isinstance(r, dict) and "traceback" in r), r
    return results, proc


@pytest.mark.parametrize("through", ["ina-run", "torchrun alone, no switch"])
def test_every_collective_under_torchrun(through):
    n = 2
    results, proc = torchrun(n, ddp_cases.ddp_ops, env={"INA_SWITCH_MIN_BYTES": "0"},
                             through_ina_run=through == "ina-run")
    for r, out in enumerate(results):
        for dtype in ("int32", "float32", "bfloat16"):
            close(out[f"all_reduce/{dtype}/SUM"], reduced(dtype, "SUM", (5, 3), n, 0), dtype)
            close(out[f"all_reduce/{dtype}/MAX"], reduced(dtype, "MAX", (5, 3), n, 3), dtype)
            for q, got in enumerate(out[f"all_gather/{dtype}"]):
                close(got, as_np(torch_input(dtype, (2, 2), q, 2)), dtype)
            start = r * (r + 1) // 2
            close(out[f"all_to_all_single/{dtype}"], np.concatenate(
                [as_np(torch_input(dtype, (n * (n + 1) // 2,), q, 6))[start:start + r + 1]
                 for q in range(n)]), dtype)
        engines = out["stats"]["engines"]
        # No MPI job: the exact calls took gloo's allreduce, and stats() says so.
        assert engines.get("gloo", 0) > 0 and "mpi" not in engines, engines
        summary = out["package_summary"]
        assert f"{engines['gloo']} took gloo" in summary and "took mpi" not in summary, summary
        if through == "ina-run":  # the switch served the floats, with no MPI job
            assert engines.get("ina", 0) > 0, out["stats"]
            assert "job" in proc.stderr and "configured" in proc.stderr
        else:
            assert "ina" not in engines, out["stats"]


def test_disagreeing_ranks_and_subgroups_under_torchrun():
    results, _ = torchrun(2, ddp_cases.ddp_mismatch, env={})
    for out in results:
        assert out["shape"]["error"] == "DistBackendError", out["shape"]
        assert "disagree on the length" in out["shape"]["message"], out["shape"]
        np.testing.assert_array_equal(out["after"], [2, 2, 2])
    results, _ = torchrun(3, ddp_cases.ddp_subgroups, env={"INA_SWITCH_MIN_BYTES": "0"},
                          through_ina_run=True)
    for r, out in enumerate(results):
        if r in (0, 2):
            np.testing.assert_array_equal(out["pair"], [4, 4, 4])
            assert out["pair_stats"].get("ina", 0) == 1, out  # its own job at the switch
        np.testing.assert_array_equal(out["everyone"], [2, 2, 2, 2])


# (4 ranks: torchrun's 2-rank jobs through ina-run are the hook's tests, test_ddp_hook.py.)
@pytest.mark.parametrize("n", [4])
def test_ddp_demo_under_torchrun_through_ina_run(n):
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch", "--launcher",
                           "torchrun", "-np", str(n), "--", sys.executable,
                           "examples/train_ddp.py", "--epochs", "1", "--samples", "4096"],
                          cwd=ROOT, env=_child_env({}), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "): OK" in proc.stdout and "'ina'" in re.findall(r"engines (\{.*\})",
                                                            proc.stdout)[-1], proc.stdout


def test_ddp_with_a_sparse_embedding_trains_as_one_process():
    """DDP with nn.Embedding(sparse=True): its sparse gradients go through the backend's
    all_reduce of sparse tensors (every rank's entries gathered and coalesced); the final
    parameters are one process's, trained on the mean of the ranks' gradients."""
    with embedded_switch() as sw:
        ina = run(2, ddp_cases.ddp_sparse_embedding, {"steps": 5},
                  env={"INA_SWITCH": sw.address_text, "INA_SWITCH_MIN_BYTES": "0"})
    alone = ddp_cases.sparse_embedding_alone(2, steps=5)
    for a in ina:
        assert "error" not in a, a
        # The embedding exactly (up to the order of a sum); the dense layer through the
        # switch (quantized sums).
        np.testing.assert_allclose(a["params"][0], alone[0], rtol=1e-6, atol=1e-7)
        for x, y in zip(a["params"][1:], alone[1:]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ina[0]["params"][0], ina[1]["params"][0])


# (FSDP2 under torchrun's ranks: test_fsdp2_and_dtensor_on_a_device_mesh_train_as_gloo_does.)
@pytest.mark.parametrize("launcher", ["mpiexec"])
def test_fsdp2_demo_through_the_switch_matches_one_process(launcher):
    """examples/train_fsdp2.py: FSDP2 over a DeviceMesh on backend "ina", under ina-run's
    MPI ranks and under torchrun, ends within 1% of one process; over MPI its
    reduce-scatters go round the ring (by arithmetic the switch gives them no bandwidth:
    docs/netsim-workloads.md)."""
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch",
                           *(["--launcher", "torchrun"] if launcher == "torchrun" else []),
                           "-np", "2", "--", sys.executable, "examples/train_fsdp2.py",
                           "--epochs", "1", "--samples", "4096"],
                          cwd=ROOT, env=_child_env({}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "): OK" in proc.stdout, proc.stdout
    assert "FSDP2 over mesh [0, 1]" in proc.stdout, proc.stdout
    engines = re.findall(r"engines (\{.*\})", proc.stdout)
    # The gradients' reduce-scatters: round the ring over MPI; over gloo's peers
    # (torchrun, no MPI job), whose point-to-point cannot be polled, an allreduce.
    assert ("'ring'" if launcher == "mpiexec" else "'ina'") in engines[-1], proc.stdout


def test_ddp_demo_under_plain_torchrun_without_a_switch_takes_the_exact_path():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "examples/train_ddp.py", "--epochs", "1", "--samples", "4096"],
                          cwd=ROOT, env=_child_env({}), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "): OK" in proc.stdout, proc.stdout
    assert "'ina'" not in re.findall(r"engines (\{.*\})", proc.stdout)[-1], proc.stdout
    # Said once, by rank 0 of the default group.
    assert proc.stderr.count("every call takes the exact path") == 1, proc.stderr


def test_plain_torchrun_reduces_large_tensors_and_reduce_scatters(tmp_path):
    """Without MPI the peers are gloo's, whose send and receive cannot be polled: a call
    of ring_min_bytes or more took the ring and waited out its bound. Now it takes gloo's
    allreduce, as does a reduce-scatter, and both are exact."""
    import socket
    script = tmp_path / "large.py"
    script.write_text(
        "import json, sys, torch, torch.distributed as dist\n"
        "import ina_collectives.torch.distributed as ina_dist\n"
        "dist.init_process_group('ina')\n"
        "r, n = dist.get_rank(), dist.get_world_size()\n"
        "x = torch.full((5 << 20,), 1.0 + r)\n"
        "dist.all_reduce(x)\n"
        "rows = torch.arange(6.0 * n).reshape(2 * n, 3) * (r + 1)\n"
        "out = torch.empty(2, 3)\n"
        "dist.reduce_scatter_tensor(out, rows)\n"
        "with open(sys.argv[1] + f'/rank{r}.json', 'w') as f:\n"
        "    json.dump([float(x.min()), float(x.max()), out.reshape(-1).tolist(),\n"
        "               ina_dist.stats()['engines']], f)\n"
        "dist.destroy_process_group()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                           str(script), str(tmp_path)], cwd=ROOT,
                          env=_child_env({"INA_TIMEOUT": "20"}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    for r in range(2):
        low, high, scattered, engines = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert low == high == 3.0  # 1 + 2 everywhere
        assert scattered == [3.0 * v for v in range(6 * r, 6 * r + 6)]  # (1 + 2) x rows
        assert "ring" not in engines, engines


def test_ina_run_gives_mpi_ranks_torchs_env_rendezvous(tmp_path):
    """A script written for torchrun (env://, nothing about MPI) runs unchanged under
    ina-run's MPI ranks: ina-run sets MASTER_ADDR/PORT, its rank wrapper RANK etc."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "import ina_collectives.torch.distributed as ina_dist\n"
        "dist.init_process_group('ina')\n"
        "t = torch.ones(300000) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "line = f\"rank {dist.get_rank()} {os.environ['LOCAL_RANK']} {float(t[0])} \"\n"
        "print(line + str(ina_dist.stats()['engines']) + '\\n', end='', flush=True)\n"
        "dist.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch", "-np", "2", "--",
                           sys.executable, str(script)], cwd=ROOT, env=_child_env({}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert re.search(rf"rank {rank} {rank} 3\.0 \{{'ina': 1\}}", proc.stdout), proc.stdout


def test_gloo_peers_read_a_read_only_source_and_refuse_a_read_only_result():
    # Under torchrun the ranks' peers are gloo groups over numpy buffers: an input the
    # caller made read-only is only read (no warning from torch), a result cannot land
    # in one (a named error, not undefined behaviour).
    import datetime
    import warnings

    import torch.distributed as dist

    from ina_collectives.collectives.peers import TorchPeers
    from ina_collectives.collectives.waiting import Deadline, wait

    peers = TorchPeers(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    source = np.arange(6, dtype=np.int32)
    source.flags.writeable = False
    gathered = np.zeros(6, np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wait(peers.Iallgather(source, gathered), Deadline(30), lambda: "the allgather")
        wait(peers.Ibcast(source, root=0), Deadline(30), lambda: "the broadcast")
    np.testing.assert_array_equal(gathered, source)
    with pytest.raises(ValueError, match="read-only buffer of 24 bytes cannot take"):
        peers.Iallgather(gathered, source)
    peers.Free()


def test_fsdp2_and_dtensor_on_a_device_mesh_train_as_gloo_does():
    """init_device_mesh, fully_shard (FSDP2) and a DTensor sharded (scatter) and
    replicated again (all_gather), under torchrun through the switch (ina-run): the
    losses and parameters follow gloo's within the quantization's reach. (The exact
    path's reduce-scatter under plain torchrun:
    test_plain_torchrun_reduces_large_tensors_and_reduce_scatters; FSDP2 on the exact
    path: test_fsdp2_demo_through_the_switch_matches_one_process.)"""
    n = 2
    gloo, _ = torchrun(n, ddp_cases.fsdp2_train, {"backend": "gloo"}, reference=True)
    served, _ = torchrun(n, ddp_cases.fsdp2_train, {"backend": "ina"},
                         env={"INA_SWITCH_MIN_BYTES": "0"}, through_ina_run=True)
    whole = np.arange(4.0 * n * 3, dtype=np.float32).reshape(4 * n, 3)
    for r in range(n):
        np.testing.assert_allclose(served[r]["losses"], gloo[r]["losses"], rtol=1e-5)
        for mine, theirs in zip(served[r]["params"], gloo[r]["params"]):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        assert served[r]["engines"].get("ina", 0) > 0, served[r]["engines"]
        assert served[r]["local_rows"] == 4 and served[r]["group_name"]
        np.testing.assert_array_equal(served[r]["replicated"], whole)


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_point_to_point(launcher, request):
    """send/recv and isend/irecv around a ring in every dtype, batch_isend_irecv, recv
    from any source (MPI's, or gloo's recv_anysource under torchrun), and the errors: a
    receive larger than what came, and one nobody sends, ended by the group's 2-second
    timeout."""
    if launcher == "mpiexec":
        n = 3
        results = of_case(request.getfixturevalue("three_ranks"), "p2p")
    else:
        n = 2
        results, _ = torchrun(n, ddp_cases.ddp_p2p, env={})
    for r, out in enumerate(results):
        assert "error" not in out, out
        left, right = (r - 1) % n, (r + 1) % n
        for dtype in DTYPES:
            close(out[f"ring/{dtype}"], as_np(torch_input(dtype, (4, 3), left, 50)), dtype)
        assert out["batch"] == [True, True]
        np.testing.assert_array_equal(out["batch_got"], [float(right)] * 5)
    first = results[0]
    assert sorted(first["any_source"]) == [(s, [float(s)] * 2) for s in range(1, n)]
    assert first["too_large"]["error"] == "DistBackendError"
    assert "16 bytes came, the tensor holds 36" in first["too_large"]["message"]
    assert first["never_sent"]["error"] == "DistBackendError"
    assert "recv from rank 1 (tag 99)" in first["never_sent"]["message"]
    for r, out in enumerate(results):
        assert out["bad_tag"]["error"] == "ValueError", out["bad_tag"]
        assert "send: tag -1 must be 0 .. " in out["bad_tag"]["message"]
        assert out["bad_peer"]["error"] == "ValueError", out["bad_peer"]
        assert f"rank {n} is not in the group's 0..{n - 1}" in out["bad_peer"]["message"]
        misfit = out["scatter_misfit"]
        if r == 0:
            assert misfit["error"] == "ValueError", misfit
            assert "tensor 0 is torch.float32 [3], the operation's is torch.float32 [2]" \
                in misfit["message"], misfit
        else:
            # (In program order: the gate of the root's broadcast waits the group's bound.)
            assert misfit["error"] == "DistBackendError", misfit
            assert f"waited 2 s for all {n} ranks" in misfit["message"], misfit
            assert "broadcast" in misfit["message"], misfit


def test_the_torch_distributed_optimizer_overlaps_and_matches_the_plain_loop(two_ranks):
    """ina_collectives.torch.overlap.DistributedOptimizer on backend "ina": with overlap,
    step() leaves each module's update for its next forward (the parameters before
    synchronize() lack the last step's), and after synchronize() they are the plain
    loop's bit for bit, on every rank; the gradients went through the switch."""
    results = of_case(two_ranks, "overlap")
    for out in results:
        assert "error" not in out, out
        assert out["isinstance"] and "ina" in out["engines"], out
        for a, b in zip(out["plain"], out["overlap"]):
            np.testing.assert_array_equal(a, b)
        assert any(not np.array_equal(a, b)
                   for a, b in zip(out["before_synchronize"], out["overlap"]))
    for a, b in zip(results[0]["overlap"], results[1]["overlap"]):
        np.testing.assert_array_equal(a, b)
