"""The INA header as a scapy Layer, for dissecting captures and crafting test packets.

Import it as ``ina_collectives.protocol.INA``; this module loads scapy, the core never does.
"""
from __future__ import annotations

from scapy.fields import (ByteField, FieldListField, FlagsField, ShortField,
                          SignedIntField, SignedShortField, XByteField, IntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from . import protocol as P


class INA(Packet):
    name = "INA"
    fields_desc = [
        ByteField("version", P.PROTOCOL_VERSION),
        FlagsField("flags", 0, 8, ["RESULT", "RETRANSMIT", "CONTROL"]),
        ShortField("job", 0),
        ShortField("worker", 0),
        ByteField("slot_version", 0),
        XByteField("reserved1", 0),
        IntField("slot", 0),
        IntField("offset", 0),
        ShortField("count", None),
        SignedShortField("exponent", 0),
        SignedShortField("proposal", P.PROPOSAL_NONE),
        ShortField("reserved2", 0),
        FieldListField("values", [], SignedIntField("", 0),
                       count_from=lambda pkt: pkt.count),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.count is None:  # default: as many as the values given
            n = len(self.values)
            pkt = pkt[:P.OFF_COUNT] + n.to_bytes(2, "big") + pkt[P.OFF_COUNT + 2:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf("INA job %job% worker %worker% slot %slot%/%slot_version% "
                            "offset %offset% count %count% e=%exponent% %flags%")


bind_layers(UDP, INA, dport=P.UDP_PORT)
bind_layers(UDP, INA, sport=P.UDP_PORT)
