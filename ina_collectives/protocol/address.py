"""Socket addresses in the forms the layers exchange: 'host:port' text, and the network
byte order integers the compiled loops store in ``sockaddr_in``."""
from __future__ import annotations

import socket
import struct

from .header import UDP_PORT


def parse_address(text: str, default_port: int = UDP_PORT) -> tuple[str, int]:
    """'host:port' (or 'host', for the default port) as a resolved socket address."""
    host, _, port = text.strip().rpartition(":")
    if not host:
        host, port = text.strip(), str(default_port)
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"switch address {text!r}: the port {port!r} is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"switch address {text!r}: port {number} is out of range")
    try:
        resolved = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"switch address {text!r}: cannot resolve {host!r}: {exc}") from None
    return resolved, number


def is_mac(text: object) -> bool:
    """Whether ``text`` is a MAC address as the control plane writes one:
    'aa:bb:cc:dd:ee:ff', six pairs of hex digits."""
    if not isinstance(text, str):
        return False
    pairs = text.split(":")
    return len(pairs) == 6 and all(
        len(p) == 2 and all(c in "0123456789abcdefABCDEF" for c in p) for p in pairs)


def parse_addresses(text: str, default_port: int = UDP_PORT) -> list[tuple[str, int]]:
    """'host:port,host:port,...': the aggregators a job stripes its calls across
    (INA_SWITCH), each resolved; one address is a list of one. Repeats are refused (a
    job's chunks on one aggregator twice would meet in the same cells)."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"switch address {text!r} names no aggregator")
    addresses = [parse_address(part, default_port) for part in parts]
    for i, address in enumerate(addresses):
        if address in addresses[:i]:
            raise ValueError(f"switch addresses {text!r} name {address[0]}:{address[1]} "
                             "twice")
    return addresses


def address_list_text(addresses: list[tuple[str, int]]) -> str:
    """The INA_SWITCH text of a list of addresses."""
    return ",".join(f"{host}:{port}" for host, port in addresses)


def ipv4_be(host: str) -> int:
    """A dotted IPv4 address as ``sin_addr.s_addr`` holds it (network order, read as a
    native integer)."""
    return struct.unpack("=I", socket.inet_aton(host))[0]


def ipv4_int_be(value: int) -> int:
    """An IPv4 address given as its 32-bit number (as P4Runtime carries it), as
    ``sin_addr.s_addr`` holds it."""
    return struct.unpack("=I", value.to_bytes(4, "big"))[0]


def port_be(port: int) -> int:
    """A port as ``sin_port`` holds it."""
    return socket.htons(port)


def sockaddr_be(address: tuple[str, int]) -> tuple[int, int]:
    """(host, port) as the (s_addr, sin_port) pair the compiled loops take."""
    return ipv4_be(address[0]), port_be(address[1])


def address_text(addr_be: int, port_be_: int) -> str:
    """The inverse of sockaddr_be, as 'host:port'."""
    return f"{socket.inet_ntoa(struct.pack('=I', addr_be))}:{socket.ntohs(port_be_)}"


LOOPBACK_BE = ipv4_be("127.0.0.1")


SOCKET_BUFFER_BYTES = 4 << 20  # net.core.rmem_max here; the defaults overflow at line rate


def udp_socket(host: str = "0.0.0.0", port: int = 0) -> socket.socket:
    """A bound UDP socket with send and receive buffers large enough for a window of
    packets (worker) or n windows (switch); OSError names the address if it is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind UDP {host}:{port}: {exc.strerror}") from None
    return sock


# Python's socket module lacks the constant (Linux <netinet/udp.h>).
UDP_GRO = 104
# IP_MTU (Linux <linux/in.h>), where Python's socket module lacks it.
IP_MTU = getattr(socket, "IP_MTU", 14)


def path_mtu(address: tuple[str, int]) -> int:
    """The MTU of the path to ``address`` as this host knows it: its route's interface
    MTU, or smaller where path MTU discovery has learned of a smaller hop (the kernel's
    route cache); 65536 on loopback. OSError when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(address)  # (UDP: a route lookup, nothing is sent)
        return sock.getsockopt(socket.IPPROTO_IP, IP_MTU)


def enable_gro(sock: socket.socket) -> bool:
    """Ask the kernel to coalesce received datagrams of one flow (UDP_GRO); whether it
    took it. The compiled receive loops split what it coalesces."""
    try:
        sock.setsockopt(socket.IPPROTO_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True
