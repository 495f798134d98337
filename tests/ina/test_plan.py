"""ina/plan.py: a call's plan, and each share's stream plan cut from it: its slices of the
input, the output and the exponents, the call's values, the number as packets carry it."""
from __future__ import annotations

import numpy as np

from ina_collectives.collectives.waiting import Deadline
from ina_collectives.ina.plan import CallPlan
from ina_collectives.ina.preparing import Prepared, Share

K, G = 4, 2


def test_each_shares_stream_plan_is_its_slices_and_the_calls_values():
    x = np.arange(5 * K - 1, dtype=np.float32)        # 5 chunks, the last short
    shares = [Share(0, 0, 2, ready=1), Share(1, 2, 5, ready=-1)]
    prepared = Prepared(x, np.float32, K, G, shares, np.arange(5 * G, dtype=np.int16),
                        np.zeros(1, np.int16), False)
    out = np.zeros_like(x)
    agreed = np.arange(100, 100 + 5 * G, dtype=np.int16)
    learn = np.zeros(8, np.int16)
    plan = CallPlan(prepared, out, agreed, Deadline(5.0), average=True, value_bits=16,
                    number=0x1_0003, quorum=2, ident=9, learn=learn, nonfinite=True,
                    absent=True)
    first, second = plan.stream(shares[0]), plan.stream(shares[1])
    assert first.x.tolist() == x[:2 * K].tolist() and second.x.tolist() == x[2 * K:].tolist()
    assert first.local.tolist() == [0, 1, 2, 3] and second.agreed.tolist() == list(
        range(104, 110))
    second.out[:] = 1.0  # (a view: the stream writes the call's output)
    assert out[2 * K:].tolist() == [1.0] * (3 * K - 1) and out[:2 * K].tolist() == [0.0] * 8
    for stream, ready in ((first, 1), (second, -1)):
        assert (stream.average, stream.value_bits, stream.call, stream.quorum, stream.ready,
                stream.ident, stream.nonfinite, stream.absent) == (
            True, 16, 3, 2, ready, 9, True, True)
        assert stream.learn is learn
