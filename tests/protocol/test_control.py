"""protocol/control.py's request: a port nothing listens on is named at once (ICMP port
unreachable, heard on an unconnected socket only while the request waits), a silent one
after the timeout, and the socket hears no ICMP errors after the request."""
from __future__ import annotations

import socket
import time

import pytest

from ina_collectives.errors import AggregatorUnavailable
from ina_collectives.protocol import control


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_a_port_nothing_listens_on_is_named_at_once(closed_udp_port):
    with _socket() as sock:
        started = time.monotonic()
        with pytest.raises(AggregatorUnavailable,
                           match=f"no aggregator listens at 127.0.0.1:{closed_udp_port} "
                                 r"\(port unreachable\)"):
            control.control_request(sock, ("127.0.0.1", closed_udp_port), 7, 0,
                                    [control.CTRL_PROBE], 30.0, "probe")
        assert time.monotonic() - started < 10  # (not the 30 s timeout)
        # After the request the socket hears no ICMP errors: a send to the closed port
        # and a receive get nothing but the timeout (the data path's reads see none).
        sock.sendto(b"x", ("127.0.0.1", closed_udp_port))
        time.sleep(0.05)
        sock.settimeout(0.1)
        with pytest.raises(TimeoutError):
            sock.recvfrom(64)


def test_a_silent_port_is_waited_for_up_to_the_timeout():
    with _socket() as silent, _socket() as sock:
        started = time.monotonic()
        with pytest.raises(AggregatorUnavailable, match=r"did not answer the join within "
                                                        r"0\.4 s"):
            control.control_request(sock, silent.getsockname(), 7, 0,
                                    [control.CTRL_JOIN, 2, 64, 1, 32, 32], 0.4, "join")
        assert time.monotonic() - started >= 0.4
