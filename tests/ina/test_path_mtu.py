"""Packets that fit the path: a rank reads its route's MTU (protocol.path_mtu), the
switch refuses a job whose packets exceed its own MTU towards a worker and says which K
fits, and a send refused for its size (EMSGSIZE) names the MTU and the fix. The job-wide
agreement (each rank's K, the smallest taken) runs in tests/integration/test_hosts.py
at MTU 1500 and 9000."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from ina_collectives import protocol as P
from ina_collectives.errors import AggregatorUnavailable
from ina_collectives.ina.link import WorkerLink
from tests.conftest import ROOT, needs_root


def test_loopback_takes_the_largest_packet_a_datagram_holds():
    mtu = P.path_mtu(("127.0.0.1", 9))
    assert mtu >= 65535
    assert P.elements_for_mtu(mtu) == P.MAX_ELEMENTS


def test_a_send_refused_for_its_size_names_the_mtu_and_the_fix():
    from ina_collectives._fast import transport

    link = WorkerLink(("127.0.0.1", 9), P.JobFormat(1, 2, P.MAX_ELEMENTS), 0, 8)
    try:
        reason = link._reason(transport.Result(transport.STATUS.index("a send failed"),
                                               error=errno.EMSGSIZE, failed_call="send"))
    finally:
        link.close()
    size = P.packet_bytes(P.MAX_ELEMENTS, P.DEFAULT_BLOCK, 32) + P.IP_UDP_HEADER_BYTES
    assert "Message too long" in reason, reason
    assert f"{size}-byte datagram" in reason and "INA_SWITCH_ELEMENTS" in reason, reason
    assert f"MTU {P.path_mtu(('127.0.0.1', 9))}" in reason, reason


def inside_a_1500_byte_namespace() -> None:
    """Run in a namespace whose loopback has MTU 1500 (the test below): a switch there
    refuses a job of 64 KiB packets, naming its MTU and the K that fits, and takes one
    of that K."""
    from tests.switch.test_server import switch_thread

    assert P.path_mtu(("127.0.0.1", 9)) == 1500
    fits = P.elements_for_mtu(1500)
    with switch_thread() as sw:
        big = WorkerLink(sw.address, P.JobFormat(5, 1, P.MAX_ELEMENTS), 0, 4)
        try:
            with pytest.raises(AggregatorUnavailable) as refused:
                big.join(2.0)
        finally:
            big.close()
        text = str(refused.value)
        assert "do not fit the switch's MTU" in text and "MTU 1500" in text, text
        assert f"K {fits} fits" in text, text
        assert sw.stats()["refusals"] == 1, sw.stats()
        small = WorkerLink(sw.address, P.JobFormat(6, 1, fits), 0, 4)
        try:
            small.join(2.0)
            small.leave()
        finally:
            small.close()
        assert sw.stats()["joins"] == 1, sw.stats()
    print("ok")


@needs_root
def test_a_switch_refuses_packets_over_its_mtu_and_names_the_k_that_fits():
    ns = f"inmtu{os.getpid() % 100000}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "mtu", "1500", "up"],
                       check=True, capture_output=True)
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c",
             "from tests.ina.test_path_mtu import inside_a_1500_byte_namespace as f; f()"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
            text=True, timeout=60)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout + done.stderr)
