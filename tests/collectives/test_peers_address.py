"""Where the backend's gloo groups bind (collectives.peers.gloo_address): gloo's own
choice whenever it is safe; the address on the route to a remote MASTER_ADDR otherwise
(tests/integration/test_hosts.py runs that across namespace hosts)."""
from __future__ import annotations

import pytest

from ina_collectives.collectives.peers import gloo_address


@pytest.mark.parametrize("env", [
    {},                                                        # no rendezvous host known
    {"MASTER_ADDR": "127.0.0.1"},                              # one machine
    {"MASTER_ADDR": "localhost"},
    {"MASTER_ADDR": "10.9.8.7", "GLOO_SOCKET_IFNAME": "eth0"},  # the user chose
    {"MASTER_ADDR": "no-such-host.invalid"},                   # gloo says it better
])
def test_gloo_chooses_where_that_is_safe(monkeypatch, env):
    for name in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert gloo_address() is None
