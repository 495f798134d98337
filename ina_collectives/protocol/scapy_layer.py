"""The INA header as a scapy Layer, for dissecting captures and crafting test packets.

Import it as ``ina_collectives.protocol.INA``; this module loads scapy, the core never
does. Its fields are made from header.FIELDS, the one table of the format.
"""
from __future__ import annotations

from scapy.fields import (
    ByteField,
    Field,
    FieldListField,
    FlagsField,
    IntField,
    ShortField,
    SignedIntField,
    SignedShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from . import header as P

_DEFAULTS = {"version": P.PROTOCOL_VERSION, "proposal": P.PROPOSAL_NONE, "count": None}
_TYPES = {(8, False): ByteField, (16, False): ShortField, (16, True): SignedShortField,
          (32, False): IntField, (32, True): SignedIntField}


def _scapy_field(f: P.Field) -> Field:
    if f.name == "flags":
        return FlagsField("flags", 0, f.bits, list(P.FLAG_NAMES))
    return _TYPES[f.bits, f.signed](f.name, _DEFAULTS.get(f.name, 0))


class INA(Packet):
    name = "INA"
    fields_desc = [_scapy_field(f) for f in P.FIELDS] + [
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
