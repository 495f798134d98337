"""The INA header as a scapy Layer, for dissecting captures and crafting test packets.

Import it as ``ina_collectives.protocol.INA``; this module loads scapy, the core never
does. Its fields are made from header.FIELDS, the one table of the format; after them
come the sub-blocks' (exponent, proposal) pairs (``pairs``, ``INAPair``) and the values,
int32 or int16 as ``value_bits`` says. ``count`` and ``blocks`` left unset are filled in
from the values and pairs given.
"""
from __future__ import annotations

from scapy.fields import (
    ByteField,
    Field,
    FieldListField,
    FlagsField,
    IntField,
    LongField,
    MultipleTypeField,
    PacketListField,
    ShortField,
    SignedIntField,
    SignedShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from . import header as P

_DEFAULTS = {"version": P.PROTOCOL_VERSION, "count": None, "blocks": None,
             "value_bits": 32, "block": P.DEFAULT_BLOCK}
_TYPES = {(8, False): ByteField, (16, False): ShortField, (16, True): SignedShortField,
          (32, False): IntField, (32, True): SignedIntField, (64, False): LongField}


def _scapy_field(f: P.Field) -> Field:
    if f.name == "flags":
        return FlagsField("flags", 0, f.bits, list(P.FLAG_NAMES))
    return _TYPES[f.bits, f.signed](f.name, _DEFAULTS.get(f.name, 0))


class INAPair(Packet):
    """One sub-block's exponent and the proposal for the slot's next chunk."""
    name = "INA sub-block"
    fields_desc = [SignedShortField("exponent", 0),
                   SignedShortField("proposal", P.PROPOSAL_NONE)]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


def _values(width: type[Field]) -> FieldListField:
    return FieldListField("values", [], width("", 0), count_from=lambda pkt: pkt.count)


class INA(Packet):
    name = "INA"
    fields_desc = [_scapy_field(f) for f in P.FIELDS] + [
        PacketListField("pairs", [], INAPair, count_from=lambda pkt: pkt.blocks),
        MultipleTypeField([(_values(SignedShortField), lambda pkt: pkt.value_bits == 16)],
                          _values(SignedIntField)),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        # Defaults: as many as given (the offsets come from the one field table).
        for name, offset, n in (("count", P.OFF_COUNT, len(self.values)),
                                ("blocks", P.OFF_BLOCKS, len(self.pairs))):
            if getattr(self, name) is None:
                pkt = pkt[:offset] + n.to_bytes(2, "big") + pkt[offset + 2:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf("INA job %job% worker %worker% slot %slot%/%slot_version% "
                            "offset %offset% count %count% blocks %blocks% "
                            "int%value_bits% B %block% %flags%")


bind_layers(UDP, INA, dport=P.UDP_PORT)
bind_layers(UDP, INA, sport=P.UDP_PORT)
