"""Scripts in the shape of Horovod's PyTorch examples (examples/pytorch_*.py) run through
ina-run on 2 ranks with the embedded switch: MNIST-style training equals one process
over the same global batches, a run resumed from a checkpoint equals the uninterrupted
one, and the synthetic benchmark finishes with every rank reporting; the switch served
the gradients' allreduces in each."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, _child_env

torch = pytest.importorskip("torch", reason="the Horovod API needs torch: pip install "
                            "'ina-collectives[torch]'")

pytestmark = pytest.mark.mpi

MNIST = ROOT / "examples" / "pytorch_mnist_synthetic.py"
BENCHMARK = ROOT / "examples" / "pytorch_synthetic_benchmark.py"
# The MNIST net's gradients (85 KiB) are below switch_min_bytes: send them to the switch.
THROUGH_THE_SWITCH = {"INA_SWITCH_MIN_BYTES": "0"}
# The switch sums block-quantized gradients (docs/quantization.md: about 2^-26 of each
# block's largest value for float32 at n = 2), and one process sums the batch in another
# order: measured differences are about 3e-8 after 16 steps. A step left out or a wrong
# average moves the parameters by about 1e-3.
ATOL, RTOL = 1e-5, 1e-4
EPOCH = re.compile(r"epoch (\d+): loss ([\d.]+) accuracy ([\d.]+)")
RANK_LINE = re.compile(r"rank (\d) of 2: parameters digest ([-\d.e+]+), engines (\{.*?\})")


def ina_run(*args: str, env: dict[str, str] | None = THROUGH_THE_SWITCH,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
    """ina-run -np 2 ARGS from the repository; fails the test unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "ina_collectives.launch", "-np", "2", *args],
                          cwd=ROOT, env=_child_env(env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def switch_results(stderr: str) -> int:
    """The results the embedded switch sent, from ina-run's closing line about it."""
    found = re.search(r"ina-run: the switch at 127\.0\.0\.1:\d+ returned (\d+) results",
                      stderr)
    assert found, stderr
    return int(found.group(1))


def every_rank_served_by_the_switch(stdout: str) -> list[float]:
    """Each rank's parameter digest, after checking both ranks reported and that the
    switch ('ina') served some of their reductions."""
    reports = {int(r): (float(d), ast.literal_eval(e)) for r, d, e in RANK_LINE.findall(stdout)}
    assert sorted(reports) == [0, 1], stdout
    for rank, (_, engines) in reports.items():
        assert engines.get("ina", 0) > 0, (rank, engines)
    return [reports[r][0] for r in (0, 1)]


def assert_same_parameters(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=RTOL, msg=name)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The MNIST-style script on 2 ranks, 2 epochs, checkpoints in ckpt/: (output, dir)."""
    folder = tmp_path_factory.mktemp("mnist")
    proc = ina_run("-H", "localhost:2", "--", sys.executable, str(MNIST), "--batch-size",
                   "32", "--lr", "0.05", "--checkpoint-dir", str(folder / "ckpt"),
                   "--save-final", str(folder / "final.pt"))
    return proc, folder


def test_mnist_on_two_ranks_equals_one_process_over_the_same_global_batch(two_ranks,
                                                                          tmp_path):
    """2 ranks x batch 32 at lr 0.05 x 2 against one process at batch 64 and lr 0.1 (what
    Horovod's lr scaling stands for): the same losses, the same final parameters within
    the switch's quantization, every rank holding the same model."""
    proc, folder = two_ranks
    one = subprocess.run([sys.executable, str(MNIST), "--batch-size", "64", "--lr", "0.1",
                          "--save-final", str(tmp_path / "one.pt")], cwd=ROOT,
                         env=_child_env(None), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    got, want = EPOCH.findall(proc.stdout), EPOCH.findall(one.stdout)
    assert [e for e, _, _ in got] == ["1", "2"] and len(want) == 2, proc.stdout
    for (_, loss, _), (_, ref, _) in zip(got, want):
        assert float(loss) == pytest.approx(float(ref), rel=RTOL), (got, want)
    assert_same_parameters(torch.load(folder / "final.pt"), torch.load(tmp_path / "one.pt"))
    digests = every_rank_served_by_the_switch(proc.stdout)
    assert digests[0] == digests[1], digests
    assert switch_results(proc.stderr) > 0


def test_mnist_resumed_from_a_checkpoint_equals_the_uninterrupted_run(two_ranks, tmp_path):
    """Rank 0 saved model and optimizer after epoch 1; a new job given only that
    checkpoint loads it on rank 0, broadcasts parameters and optimizer state (SGD's
    momentum) and trains epoch 2: it ends where the uninterrupted run ended, on every
    rank."""
    proc, folder = two_ranks
    resumed = tmp_path / "ckpt"
    resumed.mkdir()
    shutil.copy(folder / "ckpt" / "checkpoint-1.pt", resumed)
    again = ina_run("--", sys.executable, str(MNIST), "--batch-size", "32", "--lr", "0.05",
                    "--checkpoint-dir", str(resumed), "--resume",
                    "--save-final", str(tmp_path / "final.pt"))
    assert "resumed from epoch 1" in again.stdout, again.stdout
    assert [e for e, _, _ in EPOCH.findall(again.stdout)] == ["2"], again.stdout
    assert (resumed / "checkpoint-2.pt").exists()
    uninterrupted = {epoch: loss for epoch, loss, _ in EPOCH.findall(proc.stdout)}
    loss = float(EPOCH.findall(again.stdout)[0][1])
    assert loss == pytest.approx(float(uninterrupted["2"]), rel=RTOL)
    assert_same_parameters(torch.load(tmp_path / "final.pt"), torch.load(folder / "final.pt"))
    digests = every_rank_served_by_the_switch(again.stdout)
    assert digests[0] == digests[1], digests  # rank 1 resumed from rank 0's checkpoint
    assert digests[0] == pytest.approx(every_rank_served_by_the_switch(proc.stdout)[0],
                                       rel=RTOL)
    assert switch_results(again.stderr) > 0


def test_synthetic_benchmark_prints_img_per_sec_with_every_rank_reporting():
    """Horovod's benchmark shape: rank 0 prints img/sec per iteration and in total; each
    rank then reports its own img/sec and engines, the switch among them."""
    proc = ina_run("--", sys.executable, str(BENCHMARK), "--num-iters", "2",
                   env=None)  # its gradients are large enough for the switch as it is
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per CPU", proc.stdout)) == 2, proc.stdout
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+", proc.stdout), proc.stdout
    reports = re.findall(r"rank (\d) of 2: ([\d.]+) img/sec, engines (\{.*?\})", proc.stdout)
    assert sorted(int(r) for r, _, _ in reports) == [0, 1], proc.stdout
    for rank, img_sec, engines in reports:
        assert float(img_sec) > 0 and ast.literal_eval(engines).get("ina", 0) > 0, (rank, engines)
    assert switch_results(proc.stderr) > 0
