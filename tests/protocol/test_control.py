"""protocol/control.py's request: a port nothing listens on is named at once (ICMP port
unreachable, heard on an unconnected socket only while the request waits), a silent one
after the timeout, and the socket hears no ICMP errors after the request."""
from __future__ import annotations

import errno
import os
import socket
import threading
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


class _NoRoomFirst(socket.socket):
    """A UDP socket whose first ``refusals`` sends fail as a full qdisc fails them with
    IP_RECVERR set (ENOBUFS), the datagram not sent."""

    def __init__(self, refusals: int):
        super().__init__(socket.AF_INET, socket.SOCK_DGRAM)
        self.refusals = refusals

    def sendto(self, data, address):  # type: ignore[override]
        if self.refusals:
            self.refusals -= 1
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        return super().sendto(data, address)


def test_a_send_refused_for_want_of_buffers_is_a_loss_and_retried():
    # (CI's lossy netsim run: a probe's send met ENOBUFS from the shaped link's qdisc and
    # the call went to MPI as "aggregator unavailable".)
    with _socket() as server, _NoRoomFirst(refusals=2) as sock:
        sock.bind(("127.0.0.1", 0))
        got: list[bytes] = []

        def answer() -> None:
            server.settimeout(5.0)
            data, peer = server.recvfrom(65536)
            got.append(data)
            head, body = control.read_control(data)
            server.sendto(control.control_packet(head["job"], 0, [int(body[0]), 0],
                                                 reply=True), peer)

        thread = threading.Thread(target=answer)
        thread.start()
        reply = control.control_request(sock, server.getsockname(), 7, 0,
                                        [control.CTRL_PROBE], 5.0, "probe")
        thread.join()
        assert reply.status == 0 and sock.refusals == 0 and len(got) == 1


def test_a_send_refused_for_another_reason_names_it():
    with _NoRoomFirst(refusals=0) as sock:
        sock.bind(("127.0.0.1", 0))
        with pytest.raises(AggregatorUnavailable, match="cannot send the probe to the "
                                                        "aggregator at 255.255.255.255:9"):
            # (a broadcast-less socket refuses the limited broadcast address: EACCES)
            control.control_request(sock, ("255.255.255.255", 9), 7, 0,
                                    [control.CTRL_PROBE], 1.0, "probe")
