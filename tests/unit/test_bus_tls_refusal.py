"""A first connect refused for the client's certificate is a TLS error whichever way the refusal
arrived: under TLS 1.3 the server checks the client's certificate after the client's handshake has
completed, so the client sees either the server's alert or a dropped connection, by timing."""

from __future__ import annotations

import ssl

import nats.errors
import pytest

from shared.bus import client_verification_refused

VERIFIES = {"tls_required": True, "tls_verify": True}
NO_VERIFY = {"tls_required": True}

CASES = [
    # errors seen, server INFO, TLS client -> the refusal (index into errors) or None
    pytest.param([BrokenPipeError(32, "Broken pipe")], VERIFIES, True, 0, id="dropped on write"),
    pytest.param([TimeoutError(), ConnectionResetError(104, "reset")], VERIFIES, True, 1, id="reset"),
    pytest.param([ssl.SSLEOFError(8, "EOF")], VERIFIES, True, 0, id="EOF in TLS"),
    pytest.param([nats.errors.UnexpectedEOF()], VERIFIES, True, 0, id="nats unexpected EOF"),
    pytest.param([BrokenPipeError(32, "Broken pipe")], NO_VERIFY, True, None, id="server does not verify clients"),
    pytest.param([BrokenPipeError(32, "Broken pipe")], VERIFIES, False, None, id="client without TLS"),
    pytest.param([BrokenPipeError(32, "Broken pipe")], {}, True, None, id="no INFO read"),
    pytest.param([ConnectionRefusedError(111, "refused")], VERIFIES, True, None, id="refused: nothing listens"),
    pytest.param([TimeoutError()], VERIFIES, True, None, id="timeout only"),
]


@pytest.mark.parametrize("errors,info,is_tls,want", CASES)
def test_client_verification_refused(errors, info, is_tls, want):
    got = client_verification_refused(errors, info, is_tls)
    assert got is (errors[want] if want is not None else None)
