"""INA packets: every header field, sub-block pair and value the fast path writes, for
both value widths, checked through the scapy Layer; results parsed back, and malformed or
foreign ones rejected without touching the output."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ina_collectives import protocol as P
from ina_collectives.ina import kernels as kernel_module
from ina_collectives.protocol import INA
from ina_collectives.protocol.scapy_layer import INAPair
from tests.conftest import BACKENDS


def ring(rows: int, k: int, block: int = P.DEFAULT_BLOCK, bits: int = 32) -> np.ndarray:
    return np.zeros((rows, P.packet_bytes(k, block, bits)), np.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 500), k=st.integers(1, 64), slots=st.integers(1, 9),
       n=st.integers(1, 32), version_base=st.integers(0, 1), job=st.integers(0, 65535),
       worker=st.integers(0, 65535), flags=st.sampled_from([0, P.FLAG_RETRANSMIT]),
       epoch=st.integers(0, 65535),
       dtype=st.sampled_from(["float16", "float32", "float64", "int32"]),
       block=st.sampled_from(P.BLOCK_SIZES), bits=st.sampled_from(P.VALUE_BITS),
       data=st.data())
def test_every_header_field_as_scapy_reads_it(backend, size, k, slots, n, version_base, job,
                                              worker, flags, epoch, dtype, block, bits, data):
    kernels = kernel_module.load(backend)
    if dtype == "int32":
        bits = 32  # int32 tensors pass unscaled: 32-bit values only
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 100).astype(dtype)
    local, _ = kernels.block_exponents(x, k, block)
    agreed = local + np.int16(data.draw(st.integers(0, 2)))
    g = -(-k // block)
    nb = local.size // g
    first = data.draw(st.integers(0, nb - 1))
    count = data.draw(st.integers(0, nb - first))
    rows = ring(max(count, 1), k, block, bits)
    lengths = kernels.pack_chunks(x, P.JobFormat(job, n, k, block, bits), agreed, local,
                                  first, count, rows,
                                  P.Stamp(worker, slots, version_base, flags, epoch))
    assert lengths.shape == (count,)
    payload_all = kernels.quantize(x, agreed, n, k, block, bits)
    for i, c in enumerate(range(first, first + count)):
        pkt = INA(rows[i, :lengths[i]].tobytes())
        start, stop = c * k, min(c * k + k, size)
        assert (pkt.version, int(pkt.flags), pkt.job, pkt.worker) == (
            P.PROTOCOL_VERSION, flags, job, worker)
        assert pkt.slot == c % slots
        assert pkt.slot_version == ((c // slots) + version_base) % 2
        assert (pkt.offset, pkt.count) == (start, stop - start)
        blocks = -(-(stop - start) // block)
        assert (pkt.blocks, pkt.value_bits, pkt.block) == (blocks, bits, block)
        assert [p.exponent for p in pkt.pairs] == agreed[c * g:c * g + blocks].tolist()
        nxt = c + slots
        assert [p.proposal for p in pkt.pairs] == (
            local[nxt * g:nxt * g + blocks].tolist() if nxt < nb
            else [P.PROPOSAL_NONE] * blocks)
        assert pkt.seq == 0 and pkt.epoch == epoch
        assert pkt.values == payload_all[start:stop].astype(np.int64).tolist()
        assert lengths[i] == P.packet_bytes(stop - start, block, bits) == len(pkt)


def test_scapy_builds_what_the_parser_takes(kernels):
    k, n = 4, 2
    values = [3 << 20, -(5 << 20), 7, 0]
    raw = bytes(INA(flags="RESULT", job=9, worker=0, slot=2, offset=4,
                    pairs=[INAPair(exponent=1)], values=values))
    rows = ring(1, k)
    rows[0, :len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.zeros(8, np.float32)
    status = kernels.unpack_results(rows, np.array([len(raw)]), out, P.JobFormat(9, n, k))
    assert status.tolist() == [P.PARSE_OK]
    shift = 30 - 1 - 1  # exponent 1, n = 2
    np.testing.assert_array_equal(out[4:], np.array(values) * 2.0**-shift)
    assert (out[:4] == 0).all()
    # 16-bit values, two sub-blocks of 2 with their own exponents
    raw = bytes(INA(flags="RESULT", job=9, offset=4, value_bits=16, block=2,
                    pairs=[INAPair(exponent=1), INAPair(exponent=-3)], values=[3, -5, 7, 1]))
    rows = ring(1, k, 2, 16)
    rows[0, :len(raw)] = np.frombuffer(raw, np.uint8)
    status = kernels.unpack_results(rows, np.array([len(raw)]), out,
                                    P.JobFormat(9, n, k, 2, 16))
    assert status.tolist() == [P.PARSE_OK]
    np.testing.assert_array_equal(out[4:], [3 * 2.0**-12, -5 * 2.0**-12, 7 * 2.0**-16, 2.0**-16])


def test_round_trip_through_results_with_average(kernels):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    k, n = 64, 1
    exps, _ = kernels.block_exponents(x, k, 32)
    rows = ring(16, k)
    lengths = kernels.pack_chunks(x, P.JobFormat(3, n, k), exps, exps, 0, 16, rows,
                                  P.Stamp(0, 16))
    rows[:, P.OFF_FLAGS] |= P.FLAG_RESULT
    out = np.full_like(x, np.nan)
    order = rng.permutation(16)  # results arrive in any order
    status = kernels.unpack_results(rows[order].copy(), lengths[order], out,
                                    P.JobFormat(3, n, k))
    assert (status == P.PARSE_OK).all()
    np.testing.assert_allclose(out, x, rtol=0, atol=2.0**-28)
    # Packed for n=4 and read back as AVERAGE: one worker's payload stands for the sum,
    # so the result is x / 4, with 1/n folded into the scale.
    lengths = kernels.pack_chunks(x, P.JobFormat(3, 4, k), exps, exps, 0, 16, rows,
                                  P.Stamp(0, 16))
    rows[:, P.OFF_FLAGS] |= P.FLAG_RESULT
    avg = np.empty_like(x)
    status = kernels.unpack_results(rows, lengths, avg, P.JobFormat(3, 4, k), average=True)
    assert (status == P.PARSE_OK).all()
    np.testing.assert_allclose(avg, x / 4, rtol=0, atol=2.0**-28)


def _result_row(k: int, exponent: int = 0, **fields) -> tuple[np.ndarray, int]:
    header = dict(flags=P.FLAG_RESULT, job=1, worker=0, slot_version=0, slot=0, offset=0,
                  count=k, blocks=1, value_bits=32, block=P.DEFAULT_BLOCK)
    header.update(fields)
    count = header["count"]
    pair = np.array([exponent, P.PROPOSAL_NONE], ">i2").tobytes()
    raw = P.pack_header(**header) + pair + np.arange(count, dtype=">i4").tobytes()
    rows = ring(1, k)
    rows[0, :len(raw)] = np.frombuffer(raw, np.uint8)
    return rows, len(raw)


@pytest.mark.parametrize("fields, length_delta, reason", [
    ({}, -(P.HEADER_BYTES + 16) + 10, P.PARSE_SHORT),
    ({"version": P.PROTOCOL_VERSION + 1}, 0, P.PARSE_VERSION),
    ({"version": P.PROTOCOL_VERSION - 1}, 0, P.PARSE_VERSION),
    ({"flags": 0}, 0, P.PARSE_NOT_RESULT),
    ({"flags": P.FLAG_RETRANSMIT}, 0, P.PARSE_NOT_RESULT),
    ({"job": 2}, 0, P.PARSE_JOB),
    ({"offset": 2}, 0, P.PARSE_MISALIGNED),
    ({"offset": 12}, 0, P.PARSE_RANGE),
    ({"count": 3}, 0, P.PARSE_COUNT),
    ({"blocks": 2}, 0, P.PARSE_COUNT),
    ({"blocks": 0}, 0, P.PARSE_COUNT),
    ({"value_bits": 16}, 0, P.PARSE_FORMAT),
    ({"block": 16}, 0, P.PARSE_FORMAT),
    ({}, -4, P.PARSE_COUNT),
    ({"exponent": 129}, 0, P.PARSE_EXPONENT),
    ({"exponent": -127}, 0, P.PARSE_EXPONENT),
])
def test_malformed_and_foreign_results_are_rejected_untouched(kernels, fields, length_delta,
                                                              reason):
    k = 4
    rows, length = _result_row(k, **fields)
    out = np.full(10, 7.0, np.float32)
    status = kernels.unpack_results(rows, np.array([length + length_delta]), out,
                                    P.JobFormat(1, 2, k))
    assert P.PARSE_STATUS[status[0]] == P.PARSE_STATUS[reason]
    assert (out == 7.0).all()


def test_garbage_never_crashes_or_writes_out_of_bounds(kernels):
    rng = np.random.default_rng(11)
    k = 8
    rows = rng.integers(0, 256, (200, P.packet_bytes(k, 4, 32)), dtype=np.uint8)
    rows[::2, P.OFF_VERSION] = P.PROTOCOL_VERSION
    rows[::2, P.OFF_FLAGS] = P.FLAG_RESULT
    rows[::4, P.OFF_JOB:P.OFF_JOB + 2] = 0
    lengths = rng.integers(0, rows.shape[1] + 50, 200).astype(np.int32)
    guard = np.zeros(40, np.float64)
    out = guard[10:30]
    rows[1::4, P.OFF_VALUE_BITS], rows[1::4, P.OFF_BLOCK] = 32, 4
    rows[1::4, P.OFF_BLOCKS:P.OFF_BLOCKS + 2] = [0, 2]
    kernels.unpack_results(rows, lengths, out, P.JobFormat(0, 3, k, 4, 32))
    assert (guard[:10] == 0).all() and (guard[30:] == 0).all()


def test_ring_and_chunk_arguments_are_checked(kernels):
    fmt = P.JobFormat(0, 2, 4)
    x = np.ones(10, np.float32)
    exps, _ = kernels.block_exponents(x, 4)
    with pytest.raises(ValueError, match="cannot hold a packet of 4 values"):
        kernels.pack_chunks(x, fmt, exps, exps, 0, 3, ring(3, 3), P.Stamp(0, 2))
    with pytest.raises(ValueError, match="do not fit a ring of 2 rows"):
        kernels.pack_chunks(x, fmt, exps, exps, 0, 3, ring(2, 4), P.Stamp(0, 2))
    with pytest.raises(ValueError, match="outside the tensor's 3 chunks"):
        kernels.pack_chunks(x, fmt, exps, exps, 2, 2, ring(2, 4), P.Stamp(0, 2))


def test_header_constants():
    assert P.HEADER.size == P.HEADER_BYTES == P.OFF_PAYLOAD == len(INA())
    for mtu in (1500, 9000, 65535):
        for block in P.BLOCK_SIZES:
            for bits in P.VALUE_BITS:
                k = P.elements_for_mtu(mtu, block, bits)  # the largest K that fits
                room = min(mtu - 28, P.MAX_DATAGRAM)
                assert P.packet_bytes(k, block, bits) <= room < P.packet_bytes(k + 1, block,
                                                                                bits)
    assert P.elements_for_mtu(1500) == 347  # 10 sub-blocks of 32 int32 and 27 values
    assert P.elements_for_mtu(65535) == P.MAX_ELEMENTS
    with pytest.raises(ValueError, match="MTU 40"):
        P.elements_for_mtu(40)
    fields = P.unpack_header(P.pack_header(flags=1, job=2, worker=3, slot_version=1, slot=4,
                                           offset=5, count=6, blocks=7, value_bits=16,
                                           block=8, epoch=65535, seq=9))
    assert fields == {"version": P.PROTOCOL_VERSION, "flags": 1, "job": 2, "worker": 3,
                      "slot_version": 1, "slot": 4, "offset": 5, "count": 6, "blocks": 7,
                      "value_bits": 16, "block": 8, "epoch": 65535, "seq": 9, "call": 0,
                      "quorum": 0, "mode_quorum": 0, "mode_generation": 0,
                      "contributors": 0}
    with pytest.raises(ValueError, match="at least 40 bytes"):
        P.unpack_header(b"\x01\x00")
