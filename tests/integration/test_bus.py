"""The bus client against a real nats-server."""

from __future__ import annotations

import urllib.request


def test_session_server_has_jetstream(nats_server, nats_url):
    assert nats_url == nats_server.url and nats_url.startswith("nats://127.0.0.1:")
    with urllib.request.urlopen(f"{nats_server.monitor_url}/healthz?js-enabled-only=true") as resp:
        assert resp.status == 200


def test_private_server_restarts_on_same_port(make_nats_server):
    server = make_nats_server()
    url = server.url
    server.restart()
    assert server.url == url and server.is_running
    server.stop()
    assert not server.is_running
