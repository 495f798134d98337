"""runtime/background.py at 2-3 ranks in one process (tests/threadcomm.py: ThreadPeers,
the ranks' peers as the library takes a job's without MPI): the background thread's
cycles, fusion, a name reused, the host collectives, join, a stalled tensor named with
the ranks that never submitted it, a rank that stops (the others' pending operations
fail within the bound, and the runtime says it stopped), a call the switch serves, and
the refusal of an MPI communicator without MPI_THREAD_MULTIPLE."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives.ops import Op
from ina_collectives.errors import CollectiveTimeout, OperationError
from ina_collectives.runtime.background import BackgroundRuntime
from ina_collectives.runtime.negotiation import OpRequest
from ina_collectives.settings import Settings
from tests.switch.test_server import switch_thread
from tests.threadcomm import ThreadPeers, run_ranks

BASE = {"switch": "", "timeout": 5.0, "cycle_time": 0.001}


def on_runtimes(n: int, body, ordered: bool = False, **settings):
    """``body(runtime, rank)`` on n ranks, each with its BackgroundRuntime (shut down
    after, on every rank; ``ordered``: in program order, as torch.distributed's); the
    results by rank."""
    def rank(comm):
        runtime = BackgroundRuntime(comm, Settings(**{**BASE, **settings}), ordered=ordered)
        try:
            return body(runtime, comm.Get_rank())
        finally:
            runtime.shutdown(10)
    return run_ranks(n, rank, timeout=60, kind=ThreadPeers)


def allreduce_request(name: str, x: np.ndarray, op: Op = Op.SUM) -> OpRequest:
    return OpRequest("allreduce", name, str(x.dtype), x.dtype, x.shape, op)


def submit(runtime, name: str, x: np.ndarray, op: Op = Op.SUM):
    return runtime.submit(allreduce_request(name, x, op), send=x, recv=np.empty_like(x))


def allreduce(runtime, name: str, x: np.ndarray, op: Op = Op.SUM) -> np.ndarray:
    return submit(runtime, name, x, op).wait(runtime.wait_seconds(), name)


def test_allreduces_submitted_together_are_fused_into_one_call_on_every_rank():
    def body(runtime, r):
        with runtime.together():
            handles = [submit(runtime, f"t{i}", np.full(5 + i, float(r + i), np.float32))
                       for i in range(3)]
        out = [h.wait(runtime.wait_seconds(), "t") for h in handles]
        alone = allreduce(runtime, "alone", np.full(4, r + 1, np.int32), Op.MAX)
        average = allreduce(runtime, "average", np.full(2, 3.0 * r, np.float64),
                            Op.AVERAGE)
        return out, alone, average, runtime.stats()

    for out, alone, average, stats in on_runtimes(3, body):
        for i, got in enumerate(out):
            assert got.tolist() == [float(3 * i + 3)] * (5 + i), i
        assert alone.tolist() == [3] * 4 and average.tolist() == [3.0, 3.0]
        assert (stats["fused calls"], stats["tensors fused"]) == (1, 3), stats
        assert stats["last_call"]["engine"] == "gloo", stats["last_call"]


def test_a_name_reused_at_once_is_refused_and_free_after_another_submission():
    """A finished operation's name stays taken until the next submission (so that a
    reuse fails alike however fast the first ran), then it is free."""
    def body(runtime, r):
        first = submit(runtime, "again", np.ones(3, np.float32))
        deadline = time.monotonic() + 10
        while not first.done() and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(ValueError, match="'again' is already in flight"):
            submit(runtime, "again", np.ones(3, np.float32))
        allreduce(runtime, "another", np.ones(1, np.float32))
        return allreduce(runtime, "again", np.ones(3, np.float32)).tolist()

    assert on_runtimes(2, body) == [[2.0] * 3] * 2


def test_allgather_and_broadcast_go_by_the_host_collectives():
    def body(runtime, r):
        gathered = runtime.submit(
            OpRequest("allgather", "rows", "int64", "int64", (r + 1, 2)),
            send=np.full((r + 1, 2), r, np.int64)).wait(runtime.wait_seconds(), "rows")
        buf = np.full(3, r, np.float32)
        runtime.submit(OpRequest("broadcast", "b", "float32", "float32", (3,), root=1),
                       buf=buf).wait(runtime.wait_seconds(), "b")
        return gathered, buf

    for (out, rows), buf in on_runtimes(2, body):
        assert rows == [1, 2] and out.tolist() == [[0, 0], [1, 1], [1, 1]]
        assert buf.tolist() == [1.0] * 3


def test_join_lets_ranks_with_fewer_batches_finish():
    """Rank r has r + 1 batches: a joined rank adds zeros to the others' allreduces, and
    join's result is the rank that joined last. (Moved here from the Horovod API's
    mpiexec job: hvd.join is this runtime's join.)"""
    n = 3

    def body(runtime, r):
        sums = [allreduce(runtime, f"grad.{step}", np.full(5, float(r + 1), np.float32))
                for step in range(r + 1)]
        last = runtime.join().wait(runtime.wait_seconds(), "every rank to join")
        return sums, last, allreduce(runtime, "after", np.ones(2, np.float32))

    for sums, last, after in on_runtimes(n, body):
        assert last == n - 1
        for step, got in enumerate(sums):
            assert got.tolist() == [float(sum(q + 1 for q in range(step, n)))] * 5, step
        assert after.tolist() == [float(n)] * 2


def test_a_tensor_some_ranks_never_submit_fails_naming_them_and_the_runtime_goes_on():
    """Rank 2 never submits 'lonely': ranks 0 and 1 fail within stall_shutdown_time,
    naming the tensor and the rank; every rank then reduces the next one. (Moved here
    from the Horovod API's mpiexec job.)"""
    stall = 1.0

    def body(runtime, r):
        error = None
        if r != 2:
            with pytest.raises(OperationError) as failed:
                allreduce(runtime, "lonely", np.ones(4, np.float32))
            error = str(failed.value)
        else:
            time.sleep(stall + 0.5)
        return error, allreduce(runtime, "after", np.ones(4, np.float32))

    results = on_runtimes(3, body, stall_warning_time=0.5, stall_shutdown_time=stall)
    for r, (error, after) in enumerate(results):
        if r != 2:
            assert "allreduce 'lonely' float32[4] sum" in error, error
            assert "rank(s) [2] never submitted it" in error, error
        assert after.tolist() == [3.0] * 4


def test_a_rank_that_stops_fails_the_others_pending_operations_within_the_bound():
    """Rank 2 freezes after one allreduce: the others' next one fails with
    CollectiveTimeout naming the negotiation it waited for, within the timeout, and a
    later submission says the runtime stopped, and why. (The Horovod API's mpiexec job
    freezes a process with SIGSTOP and checks the error types it maps this to.)"""
    timeout = 1.0

    def body(runtime, r):
        allreduce(runtime, "first", np.ones(4, np.float32))
        if r == 2:
            runtime.comm.stop()
            return None
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout) as failed:
            allreduce(runtime, "second", np.ones(4, np.float32))
        seconds = time.monotonic() - start
        with pytest.raises(OperationError) as later:
            submit(runtime, "third", np.ones(4, np.float32))
        return str(failed.value), seconds, str(later.value)

    results = on_runtimes(3, body, timeout=timeout)
    for error, seconds, later in results[:2]:
        # (the cycle's first allgather, or its second where rank 2's thread had made
        # the first before it stopped)
        assert error.startswith("waited 1 s for ") and "negotiation cycle" in error, error
        assert seconds < timeout + 2.0, seconds
        assert "the background runtime has stopped: CollectiveTimeout" in later, later


def test_a_fused_call_goes_through_the_switch():
    """At 2 ranks with a software switch: the runtime's engines are the chooser's, with
    InaEngine first, and its allreduce is served by the switch."""
    with switch_thread() as sw:
        def body(runtime, r):
            got = allreduce(runtime, "x", np.full(10_000, r + 1.0, np.float32))
            return got, runtime.stats()

        results = on_runtimes(2, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                              timeout=10.0)
    for got, stats in results:
        assert got.tolist() == [3.0] * 10_000
        assert stats["last_call"]["engine"] == "ina", stats["last_call"]
        assert stats["kernels"] == "fast", stats


def test_an_mpi_communicator_without_thread_multiple_is_refused(monkeypatch):
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(RuntimeError, match="needs MPI_THREAD_MULTIPLE"):
        BackgroundRuntime(MPI.COMM_SELF, Settings(**BASE))


def test_a_rank_that_lost_a_call_while_the_others_idle_is_rescued_through_the_negotiation():
    """The negotiation runs ahead on a communicator of its own and is no gate. Rank 1
    loses the results of a call without a vote that rank 0 finished; rank 0 then kills
    the switch and submits its next call, which waits for rank 1's submission, which
    waits for the rescue. Rank 1 says in the negotiation that it is in trouble; rank 0,
    which kept that call, makes a gate of its own (Collectives.meet_trouble) and sends
    its window: both get the exact sum bit for bit, and the next call takes the exact
    engine on both."""
    from tests.ina.test_engine_faults import COUNT, deaf_from_the_next_stream, mortal_switch

    with mortal_switch() as sw:
        def body(runtime, r):
            x = np.arange(COUNT, dtype=np.float32) * (r + 1)
            allreduce(runtime, "first", x)
            if r == 1:
                deaf_from_the_next_stream(runtime.collectives.offload)
            second = allreduce(runtime, "second", x)
            if r == 0:
                sw.kill()
            third = allreduce(runtime, "third", np.full(COUNT, 2.0, np.float32))
            return second, third, runtime.stats()

        results = on_runtimes(2, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                              switch_silence=0.5, timeout=10.0)
    (second0, third0, stats0), (second1, third1, stats1) = results
    assert second0.tolist() == (np.arange(COUNT, dtype=np.float32) * 3).tolist()
    assert second1.tobytes() == second0.tobytes()
    assert third0.tolist() == third1.tolist() == [4.0] * COUNT
    assert [s["switch"]["rescued_calls"] for s in (stats0, stats1)] == [0, 1]
    assert stats0["last_call"]["engine"] == stats1["last_call"]["engine"] == "gloo"


@pytest.mark.parametrize("carry", [False, True])
def test_in_quorum_mode_the_ranks_run_ahead_of_a_late_one_which_takes_the_result_later(
        carry):
    """Quorum 2 of 3 with a software switch (docs/quorum.md, Running ahead). Step 1:
    every rank reduces "g" (now known). Step 2: rank 2 submits only once rank 0 holds its
    result, so ranks 0 and 1 must go on without it (else this test times out): they get
    the mean of their own two, and so does rank 2 when it submits, its own values
    dropped; its background thread took part in the call all the same. Step 3, rank 2
    late again: at quorum_max_steps 1 the others wait for it, and the call runs in sync,
    counting every rank. Step 4, rank 2 late again: the others finish and shut down
    before it submits, and it still takes their result. With ``carry``
    (carry_late_inputs, as DistributedOptimizer asks for its gradients) rank 2's step-2
    input is added to its step-3 one, not dropped."""
    import threading
    ran_ahead, finished = threading.Event(), threading.Event()

    def body(runtime, r):
        x = 1000
        if carry:
            runtime.carry_late_inputs(["g"])
        # (every rank the same values: the switch's quorum may count any 2 of them)
        steps = [allreduce(runtime, "g", np.full(x, 2.0, np.float32), Op.AVERAGE)]
        if r == 2:
            assert ran_ahead.wait(20), "ranks 0 and 1 waited for rank 2"
        steps.append(allreduce(runtime, "g", np.full(x, 10.0 * (r + 1), np.float32),
                               Op.AVERAGE))
        if r == 0:
            ran_ahead.set()
        if r == 2:
            time.sleep(0.3)  # late again, at the bound: the others wait for it
        steps.append(allreduce(runtime, "g", np.full(x, 4.0 * r, np.float32), Op.AVERAGE))
        stats = runtime.stats()
        # Step 4: rank 2 late once more, and the others finish and shut down meanwhile;
        # what they ran without it is still its to take.
        if r == 2:
            assert finished.wait(20)
            time.sleep(0.3)
        steps.append(allreduce(runtime, "g", np.full(x, 8.0 * (r + 1), np.float32),
                               Op.AVERAGE))
        if r == 0:
            finished.set()
        return steps, stats

    with switch_thread() as sw:
        results = on_runtimes(3, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                              timeout=10.0, quorum=2, quorum_grace=0.02,
                              quorum_max_steps=1)
    for r, (steps, stats) in enumerate(results):
        step3 = (0 + 4 + 8 + (30 if carry else 0)) / 3
        assert [s[0] for s in steps] == [2.0, 15.0, step3, 12.0], (r, [s[:3] for s in steps])
        assert all((s == s[0]).all() for s in steps)
        assert stats["tensors without some rank"] == 1, stats
        assert stats["tensors without this rank"] == (r == 2), stats
        assert stats["late inputs carried"] == (r == 2 and carry), stats
        assert stats["last_call"]["engine"] == "ina", stats["last_call"]


def test_a_late_ranks_carried_inputs_come_in_as_their_mean_at_its_next_contribution():
    """Quorum 2 of 3, quorum_max_steps 2, rank 2 carrying "g" (carry_late_inputs): late
    at steps 2 and 3, its inputs there (30, then 60) are kept; at step 4 the bound makes
    the others wait for it, and it adds its own input (3) plus the mean of those carried
    (45): one step's weight, late."""
    import threading
    gates = [threading.Event() for _ in range(2)]
    inputs = [[2.0] * 3, [10.0, 20.0, 30.0], [20.0, 40.0, 60.0], [1.0, 2.0, 3.0]]

    def body(runtime, r):
        runtime.carry_late_inputs(["g"])
        out = []
        for step, values in enumerate(inputs):
            if r == 2 and step in (1, 2):
                assert gates[step - 1].wait(20), f"step {step + 1} waited for rank 2"
            out.append(allreduce(runtime, "g", np.full(100, values[r], np.float32),
                                 Op.AVERAGE)[0])
            if r == 0 and step in (1, 2):
                gates[step - 1].set()
        return out, runtime.stats()

    with switch_thread() as sw:
        results = on_runtimes(3, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                              timeout=10.0, quorum=2, quorum_grace=0.02,
                              quorum_max_steps=2)
    for r, (out, stats) in enumerate(results):
        assert out == [2.0, 15.0, 30.0, (1 + 2 + 3 + 45) / 3], (r, out)
        assert stats["late inputs carried"] == (2 if r == 2 else 0), stats


@pytest.mark.parametrize("ordered", [False, True], ids=["negotiated", "program-order"])
def test_calls_made_ready_in_the_last_ones_drain_go_back_to_back_with_exact_sums(ordered):
    """Three ranks, a software switch, fusion off: each step submits four tensors at
    once (one round, four calls; in program order, four submissions), one of them
    prescaled. From the second step on the runtime makes each next call ready in the
    drain of the one before (its input filled in and prescaled), and the switch engine
    starts it there: most calls go adopted, and every sum is the exact one, prescale
    applied once."""
    sizes, steps = [6000, 6000, 9000, 3000], 5

    def body(runtime, r):
        rng = np.random.default_rng(r)
        out = []
        for _ in range(steps):
            xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
            with runtime.together():
                handles = []
                for i, x in enumerate(xs):
                    request = OpRequest("allreduce", f"g{i}", "float32", x.dtype, x.shape,
                                        Op.SUM, prescale=2.0 if i == 1 else 1.0)
                    handles.append(runtime.submit(request, send=x, recv=np.empty_like(x)))
            out.append([h.wait(runtime.wait_seconds(), "g") for h in handles])
        return out, runtime.stats()["switch"]

    with switch_thread() as sw:
        results = on_runtimes(3, body, ordered, switch="%s:%d" % sw.address,
                              switch_min_bytes=0, fusion_threshold=0)
    rngs = [np.random.default_rng(r) for r in range(3)]
    for step in range(steps):
        draws = [[g.standard_normal(n).astype(np.float32) for n in sizes] for g in rngs]
        for i in range(len(sizes)):
            exact = sum(d[i].astype(np.float64) for d in draws) * (2.0 if i == 1 else 1.0)
            for r in range(3):
                got = results[r][0][step][i]
                np.testing.assert_allclose(got, exact, rtol=0,
                                           atol=np.abs(exact).max() * 1e-5)
    for _, state in results:
        assert state["adopted_calls"] >= 8, state  # (of the 16 after the first step)
        assert state["mismatched_predictions"] == state["rescued_calls"] == 0


def test_a_late_submission_that_differs_from_what_ran_without_it_fails_on_that_rank():
    """Quorum 2 of 3, running ahead: ranks 0 and 1 run step 2's "g" without rank 2,
    whose late submission of "g" then has another length. It fails on rank 2 alone
    (the others had gone on already), with an OperationError that names the call as
    run and says the submission differs; the runtimes go on, and a new tensor after it
    is reduced on every rank."""
    import threading
    ran_ahead = threading.Event()

    def body(runtime, r):
        x = 1000
        allreduce(runtime, "g", np.full(x, 2.0, np.float32), Op.AVERAGE)
        if r == 2:
            assert ran_ahead.wait(20), "ranks 0 and 1 waited for rank 2"
            with pytest.raises(OperationError) as late:
                allreduce(runtime, "g", np.full(x // 2, 1.0, np.float32), Op.AVERAGE)
            error = str(late.value)
        else:
            second = allreduce(runtime, "g", np.full(x, 10.0 * (r + 1), np.float32),
                               Op.AVERAGE)
            assert (second == 15.0).all(), second[:3]
            if r == 0:
                ran_ahead.set()
            error = None
        after = allreduce(runtime, "h", np.full(7, float(r), np.float32))
        return error, after

    with switch_thread() as sw:
        results = on_runtimes(3, body, switch="%s:%d" % sw.address, switch_min_bytes=0,
                              timeout=10.0, quorum=2, quorum_grace=0.02)
    error = results[2][0]
    assert "was run without this rank as the others submitted it (1000 x float32)" in error
    assert "this rank's submission differs" in error
    assert [e for e, _ in results[:2]] == [None, None]
    assert all(after.tolist() == [3.0] * 7 for _, after in results)
