"""The wire format written once (ina_collectives.protocol): every form made from the field
table agrees with it, control packets and addresses round-trip, bad input is named."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from ina_collectives import protocol as P
from ina_collectives.protocol import header
from tests.conftest import ROOT


def test_the_docs_show_exactly_the_field_table():
    docs = (ROOT / "docs" / "protocol.md").read_text()
    table = header.markdown_table()
    assert docs.count(table) == 1
    before, _, after = docs.partition(table)
    # Exactly: no stale row of the docs' table right above or below the generated one.
    assert before.endswith("\n") and not before.splitlines()[-1].startswith("|")
    assert after.startswith("\n") and not after.splitlines()[1].startswith("|")


def test_the_p4_program_declares_the_header_from_the_table():
    assert header.p4_header("ina_t") in (ROOT / "p4" / "ina_aggregator.p4").read_text()


def test_offsets_follow_the_widths():
    assert P.HEADER.size == P.HEADER_BYTES == sum(f.bits // 8 for f in P.FIELDS)
    at = 0
    for f in P.FIELDS:
        assert P.OFFSETS[f.name] == at and f.bits % 8 == 0
        at += f.bits // 8
    assert (P.OFF_JOB, P.OFF_SLOT, P.OFF_BLOCKS, P.OFF_EPOCH) == (
        P.OFFSETS["job"], P.OFFSETS["slot"], P.OFFSETS["blocks"], P.OFFSETS["epoch"])
    # Values after the pairs stay 4-byte aligned for any number of pairs.
    assert P.HEADER_BYTES % 4 == 0 and P.PAIR_BYTES % 4 == 0


@pytest.mark.parametrize("edge", ["low", "high"])
def test_pack_and_unpack_at_the_fields_edges(edge):
    values = {}
    for f in P.FIELDS:
        if f.name in P.RESERVED:
            continue
        lo, hi = ((-(1 << (f.bits - 1)), (1 << (f.bits - 1)) - 1) if f.signed
                  else (0, (1 << f.bits) - 1))
        values[f.name] = lo if edge == "low" else hi
    packed = P.pack_header(**values)
    assert len(packed) == P.HEADER_BYTES
    assert P.unpack_header(packed) == values
    assert P.unpack_header(packed + b"payload") == values


def test_values_past_a_fields_edges_are_refused_not_wrapped():
    base = {f.name: 0 for f in P.FIELDS if f.name not in P.RESERVED}
    for f in P.FIELDS:
        if f.name in P.RESERVED:
            continue
        lo, hi = ((-(1 << (f.bits - 1)), (1 << (f.bits - 1)) - 1) if f.signed
                  else (0, (1 << f.bits) - 1))
        for bad in (lo - 1, hi + 1):
            with pytest.raises(struct.error):
                P.pack_header(**{**base, f.name: bad})


def test_format_fields_round_trip():
    values = dict(version=P.PROTOCOL_VERSION, flags=P.FLAG_RESULT, job=3, worker=1,
                  slot_version=1, slot=7, offset=4096, count=12, blocks=3, value_bits=16,
                  block=4, epoch=65535, seq=255, call=65535, quorum=3, mode_quorum=2,
                  mode_generation=2**32 - 1, contributors=2**64 - 1)
    assert P.unpack_header(P.pack_header(**values)) == values
    assert P.packet_bytes(12, 4, 16) == 40 + 3 * 4 + 12 * 2
    with pytest.raises(ValueError, match="one of"):
        P.check_format(48, 32)
    with pytest.raises(ValueError, match="32 or 16"):
        P.check_format(32, 8)


def test_a_short_header_is_refused_by_length():
    with pytest.raises(ValueError, match="at least 40 bytes, got 5"):
        P.unpack_header(b"12345")


def test_control_packets_round_trip():
    packet = P.control_packet(7, 3, [P.CTRL_JOIN, 4, 362, 8])
    head, body = P.read_control(packet)
    assert head["flags"] == P.FLAG_CONTROL and (head["job"], head["worker"]) == (7, 3)
    assert body.tolist() == [P.CTRL_JOIN, 4, 362, 8] and head["count"] == 4
    reply_head, reply = P.read_control(P.control_packet(7, 3, [P.CTRL_JOIN, 0], reply=True))
    assert reply_head["flags"] == P.FLAG_CONTROL | P.FLAG_RESULT and reply.tolist() == [1, 0]
    _, partial = P.read_control(packet + b"\x01\x02")  # a trailing partial value: ignored
    assert partial.tolist() == body.tolist()
    assert P.status_text(P.JOIN_STATUS, 4) == "no room for the job"
    assert P.status_text(P.JOIN_STATUS, 99) == "code 99"


def test_fault_settings_round_trip_and_unknown_names_are_refused():
    faults = {"drop_in": 0.25, "delay_ms_out": 12.5, "reorder_out": 1e-6}
    values = P.encode_faults(faults)
    assert len(values) == len(P.FAULT_FIELDS)
    decoded = P.decode_faults(np.array(values, ">i4"))
    assert {k: v for k, v in decoded.items() if v} == faults
    with pytest.raises(ValueError, match="unknown fault.*jitter_in"):
        P.encode_faults({"jitter_in": 0.1})


def test_addresses():
    assert P.parse_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert P.parse_address("localhost") == ("127.0.0.1", P.UDP_PORT)
    assert P.address_text(*P.sockaddr_be(("127.0.0.2", 47474))) == "127.0.0.2:47474"
    assert P.ipv4_int_be(0x7F000001) == P.ipv4_be("127.0.0.1") == P.LOOPBACK_BE
    assert P.parse_address(" 127.0.0.1:9 ", default_port=1) == ("127.0.0.1", 9)
    assert P.parse_address("127.0.0.1", default_port=1) == ("127.0.0.1", 1)
    for host, port in [("0.0.0.0", 1), ("10.1.2.3", 47474), ("255.255.255.255", 65535)]:
        assert P.address_text(*P.sockaddr_be((host, port))) == f"{host}:{port}"
    for text, words in [("h:x", "the port 'x' is not a number"), ("h:0", "out of range"),
                        ("h:65536", "port 65536 is out of range"),
                        ("h:", "the port '' is not a number"),
                        ("no.such.host.invalid:1", "cannot resolve 'no.such.host.invalid'")]:
        with pytest.raises(ValueError, match=words):
            P.parse_address(text)


def test_udp_socket_names_an_address_in_use():
    with P.udp_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind UDP 127.0.0.1:{port}"):
            P.udp_socket("127.0.0.1", port)


def test_the_scapy_layer_has_the_tables_fields():
    ina = P.INA(job=5, epoch=9, values=[1, -2])
    names = [f.name for f in P.INA.fields_desc]
    assert names == [f.name for f in P.FIELDS] + ["pairs", "values"]
    raw = bytes(ina)
    assert P.unpack_header(raw)["epoch"] == 9 and P.unpack_header(raw)["count"] == 2


def test_a_list_of_aggregator_addresses():
    assert P.parse_addresses("127.0.0.1:5000, localhost:5001") == [
        ("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    assert P.parse_addresses("127.0.0.1") == [("127.0.0.1", P.UDP_PORT)]
    with pytest.raises(ValueError, match="name 127.0.0.1:5000 twice"):
        P.parse_addresses("127.0.0.1:5000,localhost:5000")
    with pytest.raises(ValueError, match="names no aggregator"):
        P.parse_addresses(" , ")
    with pytest.raises(ValueError, match="port 'x' is not a number"):
        P.parse_addresses("127.0.0.1:1,127.0.0.1:x")
