"""Predicted first windows through the software switch, worker by worker
(docs/protocol.md, One round trip): a call that goes without an opening sums in one round
trip when the prediction holds, sends a chunk again when a worker's values overflow it,
and tells every worker MISMATCH when the ranks' calls differ, an opening meeting a
predicted call included; loss on both ways changes none of it. Workers of a job joined
by hand (WorkerLink), their streams run in threads as the ranks run them in processes."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.ina import kernels
from ina_collectives.ina.link import Timers
from ina_collectives.ina.plan import StreamPlan
from ina_collectives.ina.prediction import CLEAN_CALLS, PREDICT_HEADROOM, Predictions
from ina_collectives.switch.faults import send_faults
from tests.ina.test_link import joined, per_worker
from tests.switch.test_server import switch_thread

K, S, N = 64, 4, 3
G = P.sub_blocks(K, P.DEFAULT_BLOCK)
IDENT = (1 << 40) | 4242
FAST = kernels.load("fast")
TIMERS = Timers(0.02, 0.002, 0.5, 5.0)


@pytest.fixture
def job():
    """N joined workers of a fresh job on a switch of its own, and the switch."""
    with switch_thread() as sw, joined(sw.address, 710, N, K, S, 11) as links:
        assert all(link.predicts for link in links)
        yield sw, links


def inputs(chunks: int, scale: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(chunks * K) * scale).astype(np.float32) for _ in range(N)]


def own(x: np.ndarray) -> np.ndarray:
    return FAST.block_exponents(x, K, P.DEFAULT_BLOCK)[0]


def stream_all(links, xs, first, idents=None, call=1, silence=5.0, nonfinite=None):
    """Every worker's predicted stream at once: ``first``, the first window's predicted
    exponents (alike on every worker); [(result, out, learned)] by worker."""
    got: list = [None] * len(links)

    def one(w: int) -> None:
        x = xs[w]
        local = own(x)
        agreed = np.full_like(local, P.PROPOSAL_NONE)
        agreed[:min(first.size, agreed.size)] = first[:agreed.size]
        out = np.full_like(x, np.nan)
        learn = np.full(2 * S * G, P.PROPOSAL_NONE, np.int16)
        timers = Timers(TIMERS.first, TIMERS.least, TIMERS.most, silence)
        result = links[w].stream(
            StreamPlan(x, out, local, agreed, call=call,
                       ident=(idents or [IDENT] * len(links))[w], learn=learn,
                       nonfinite=bool(nonfinite and nonfinite[w])),
            timers, 30.0)
        got[w] = result, out, learn
    per_worker(len(links), one)
    return got


def window_max(xs, chunks: int) -> np.ndarray:
    """What the first window's results teach: per sub-block, the max over the workers
    of each first-window chunk's own exponent (its slot's last chunk proposes it)."""
    exps = np.max([own(x) for x in xs], axis=0).reshape(chunks, G)
    return exps[:min(S, chunks)].reshape(-1)


def check_sum(xs, got) -> None:
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for result, out, _ in got:
        assert result.ok, result.reason
        np.testing.assert_allclose(out, total, rtol=0, atol=np.abs(total).max() * 1e-6)


@pytest.mark.parametrize("chunks", [3, 7])  # one window; two windows (proposals ahead)
def test_a_call_whose_prediction_holds_sums_in_one_round_trip_and_learns(job, chunks):
    sw, links = job
    xs = inputs(chunks)
    taught = window_max(xs, chunks)
    first = (taught + PREDICT_HEADROOM)[:min(S, chunks) * G]
    got = stream_all(links, xs, first)
    check_sum(xs, got)
    for result, _, learned in got:
        assert result.counters["overflows"] == 0 and result.counters["predicted"] == 1
        assert result.counters["sent"] == chunks  # each chunk once: no opening, no resend
        np.testing.assert_array_equal(learned[:first.size], first)  # summed with
        np.testing.assert_array_equal(learned[S * G:S * G + taught.size], taught)
    assert sw.stats()["openings"] == 0


def test_a_prediction_a_worker_overflows_sends_that_chunk_again(job):
    sw, links = job
    xs = inputs(3)
    xs[1][K:2 * K] *= 16  # chunk 1 of worker 1: four exponents over the prediction
    first = window_max(inputs(3), 3) + PREDICT_HEADROOM
    got = stream_all(links, xs, first)
    check_sum(xs, got)
    assert [g[0].counters["overflows"] for g in got] == [1] * N  # every worker, chunk 1
    np.testing.assert_array_equal(got[0][2][S * G:S * G + 3 * G], window_max(xs, 3))
    used = got[0][2][G:2 * G]  # chunk 1 went again with the max exponents
    np.testing.assert_array_equal(used, np.maximum(first[G:2 * G], window_max(xs, 3)[G:2 * G]))
    # The slots moved on alike (chunk 1's slot twice): the next call goes as well.
    assert len({tuple(link.wire.versions) for link in links}) == 1
    got = stream_all(links, xs, window_max(xs, 3) + PREDICT_HEADROOM, call=2)
    check_sum(xs, got)
    assert [g[0].counters["overflows"] for g in got] == [0] * N


@pytest.mark.parametrize("where", [1, 2 * K + 3])
def test_a_nan_in_one_workers_first_window_reaches_every_worker(job, where):
    """No agreement saw the first window: the worker whose input holds a NaN proposes
    NONFINITE_MARK in every packet, so every worker's results say so (the engine then
    takes the call to the exact path on every rank alike)."""
    sw, links = job
    xs = inputs(3)
    xs[1][where] = np.nan
    got = stream_all(links, xs, window_max(inputs(3), 3) + PREDICT_HEADROOM,
                     nonfinite=[False, True, False])
    for result, _, learned in got:
        assert result.ok and result.counters["nonfinite_seen"] == 1, result.counters
        assert (learned[S * G:S * G + 3 * G] == P.NONFINITE_MARK).any()


@pytest.mark.parametrize("how", ["identity", "length"])
def test_predicted_calls_that_differ_tell_every_worker(job, how):
    sw, links = job
    xs = inputs(3)
    idents = [IDENT] * N
    if how == "identity":
        idents[-1] = IDENT + 1
    else:  # the last worker's call is one chunk (and its identity says so)
        xs[-1] = xs[-1][:K]
        idents[-1] = IDENT + 2
    first = window_max(inputs(3), 3) + PREDICT_HEADROOM
    got = stream_all(links, xs, first, idents)
    assert [g[0].reason for g in got] == ["mismatch"] * N, [g[0] for g in got]
    assert [g[0].counters["retransmitted"] for g in got] == [0] * N  # none waited


def test_an_opening_that_meets_a_predicted_call_is_a_mismatch_for_both(job):
    """N - 1 workers send their first window predicted, one opens its call (it has no
    prediction: the ranks' calls differ): every worker learns MISMATCH."""
    sw, links = job
    xs = inputs(3)
    first = window_max(xs, 3) + PREDICT_HEADROOM
    opened: list = [None]

    def opener() -> None:
        proposals = np.full((S, G), P.PROPOSAL_NONE, np.int16)
        opened[0] = links[-1].opening(IDENT + 9, proposals, 1, TIMERS, 30.0).reason
    t = threading.Thread(target=opener)
    t.start()
    got = stream_all(links[:-1], xs[:-1], first)
    t.join(60)
    assert [g[0].reason for g in got] + opened == ["mismatch"] * N


def test_loss_both_ways_with_overflows_gives_the_same_sums(job):
    """A quarter of the packets lost each way while chunks overflow: late copies of the
    predicted first tries are dropped as stale, never reopening a cell the second try
    left, and every call's sums are right."""
    sw, links = job
    send_faults(sw.address, drop_in=0.25, drop_out=0.25)
    overflows = 0
    try:
        for call in range(1, 7):
            xs = inputs(5, seed=call)
            xs[call % N][(call % 5) * K:(call % 5 + 1) * K] *= 64  # (chunk 4: not predicted)
            first = window_max(inputs(5, seed=0), 5) + PREDICT_HEADROOM
            # (A quarter lost each way: the silence bound raised, as a CI run once ran
            # into 5 s of a window's packets and results lost with their retries.)
            got = stream_all(links, xs, first[:S * G], call=call, silence=20.0)
            check_sum(xs, got)
            overflows += got[0][0].counters["overflows"]
    finally:
        send_faults(sw.address)
    assert overflows >= 5 and sum(sw.stats()["drops"].values()) > 0


def test_the_table_predicts_alike_adapts_its_headroom_and_forgets():
    table = Predictions(size=2, headroom=2)
    shape = ("layout", K, S, 1)
    needs = np.array([3, -5, 128, -126], np.int16)
    assert table.predict(1, shape, 4, np.float32) is None
    table.learn(1, shape, needs)
    np.testing.assert_array_equal(table.predict(1, shape, 4, np.float32), needs)  # exact
    assert table.predict(1, ("other", K, S, 1), 4, np.float32) is None
    for headroom in (1, 2, 2):  # each call that overflowed adds a bit, up to the most
        table.learn(1, shape, needs, overflowed=True)
        assert table.headroom(1, shape) == headroom
    np.testing.assert_array_equal(table.predict(1, shape, 4, np.float32),
                                  [5, -3, 128, -124])  # (clipped at float32's largest)
    for _ in range(CLEAN_CALLS):  # a run of clean calls takes one back
        table.learn(1, shape, needs)
    assert table.headroom(1, shape) == 1
    # Where the needs are not known, the exponents the call was summed with.
    table.learn(1, shape, np.array([3, P.PROPOSAL_NONE, 0, 0], np.int16),
                np.array([9, 9, 9, 9], np.int16))
    np.testing.assert_array_equal(table.predict(1, shape, 4, np.float32), [4, 9, 1, 1])
    table.learn(1, shape, np.array([3, P.PROPOSAL_NONE, 0, 0], np.int16))
    assert table.predict(1, shape, 4, np.float32) is None
    table.learn(1, shape, needs)
    table.learn(1, shape, np.array([P.NONFINITE_MARK, 0, 0, 0], np.int16))
    assert table.predict(1, shape, 4, np.float32) is None  # a NaN's window: nothing kept
    for ident in (1, 2, 3):
        table.learn(ident, shape, np.zeros(4, np.int16))
    assert len(table) == 2 and table.predict(1, shape, 4, np.float32) is None
    table.clear()
    assert len(table) == 0


def test_calls_of_one_identity_in_a_row_are_predicted_by_their_place():
    """A model's same-shaped layers make calls of one identity in a row, their gradients
    at different scales: each place in the run is predicted from its own call of the
    step before, not from the call just before it (which overflowed most first windows
    of a 16-layer MLP: 6 chunks of 8 a call). A place not learned yet takes the
    identity's latest call, so that a loop over one tensor predicts from its first
    repeat."""
    table = Predictions(size=64, headroom=2)
    shape = ("layout", K, S, 1)
    layers = [np.full(4, e, np.int16) for e in (-3, 4, -9)]  # three layers' scales
    for place, needs in enumerate(layers):  # the first step: nothing to predict from
        if place:
            np.testing.assert_array_equal(
                table.predict(7, shape, 4, np.float32, place), layers[place - 1])
        table.learn(7, shape, needs, place=place)
    for place, needs in enumerate(layers):  # every step after: each from its own
        np.testing.assert_array_equal(table.predict(7, shape, 4, np.float32, place), needs)
        table.learn(7, shape, needs, place=place)
    np.testing.assert_array_equal(table.predict(7, shape, 4, np.float32, 5), layers[-1])
    table.learn(7, shape, layers[0], overflowed=True, place=1)  # headroom by place
    assert table.headroom(7, shape, 1) == 1 and table.headroom(7, shape, 0) == 0
    # A caller's key (the Horovod runtime's tensor names) in place of the run's place:
    # the same tensor is predicted from its own last call in whatever order it comes.
    for key, needs in (("fc2", layers[2]), ("fc1", layers[1])):
        table.learn(7, shape, needs, place=(key,))
    for key, needs in (("fc1", layers[1]), ("fc2", layers[2])):
        np.testing.assert_array_equal(table.predict(7, shape, 4, np.float32, (key,)), needs)


def test_with_headroom_the_first_window_is_within_the_bound_of_its_exponents(job):
    """A prediction h bits above the exponents the values need: the first window's error
    stays within the bound of the exponents it was summed with (2^h times the bound of
    exact ones, docs/quantization.md), and the chunks after it within the exact bound."""
    from ina_collectives.ina.reference import blockfp

    sw, links = job
    h, chunks = 2, 6
    xs = inputs(chunks, seed=5)
    needs = np.max([own(x) for x in xs], axis=0)
    got = stream_all(links, xs, window_max(xs, chunks) + h)
    check = np.sum([x.astype(np.float64) for x in xs], axis=0)
    summed = needs.copy()
    summed[:S * G] += h
    for exps, span in ((summed, slice(0, S * K)), (needs, slice(S * K, chunks * K))):
        per_element = blockfp.element_exponents(exps, chunks * K, K, P.DEFAULT_BLOCK)
        for result, out, _ in got:
            assert result.ok and result.counters["overflows"] == 0, result.reason
            bound = blockfp.error_bound(N, per_element, np.float32, out)
            error = np.abs(out.astype(np.float64) - check)
            assert (error[span] <= bound[span] * (1 + 1e-9)).all()
