"""The INA wire protocol, one format for every aggregator (docs/protocol.md).

``header``: the one table of the header's fields and everything derived from it;
``control``: join/leave/probe/fault packets and the request-reply exchange; ``address``:
socket addresses as text and as the compiled loops hold them. The names of all three are
re-exported here, so ``from ina_collectives import protocol as P; P.HEADER_BYTES`` reads
as before. ``INA``, the header as a scapy Layer, is loaded on first use: the core never
imports scapy.
"""
from __future__ import annotations

from typing import Any

from .address import (  # noqa: F401
    LOOPBACK_BE,
    SOCKET_BUFFER_BYTES,
    address_list_text,
    address_text,
    enable_gro,
    ipv4_be,
    ipv4_int_be,
    is_mac,
    parse_address,
    parse_addresses,
    path_mtu,
    port_be,
    sockaddr_be,
    udp_socket,
)
from .control import *  # noqa: F401,F403
from .header import *  # noqa: F401,F403


def __getattr__(name: str) -> Any:
    if name == "INA":
        from .scapy_layer import INA
        return INA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
