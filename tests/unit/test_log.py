"""Log lines: one JSON object each, with service, request_id and the current span's ids."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from shared.log import get_logger, request_context, setup_logging
from shared.tracing import build_tracer_provider


@pytest.fixture
def json_lines(capsys):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging("router", level="INFO", json=True)

    def read() -> list[dict]:
        return [json.loads(line) for line in capsys.readouterr().err.splitlines()]

    yield read
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_line_carries_service_request_and_trace(json_lines):
    tracer = build_tracer_provider("router", env={}).get_tracer("test")
    log = get_logger("services.router", node_id="decode-0")
    with request_context("req-1"), tracer.start_as_current_span("claim") as span:
        log.info("claim_granted", lease_id="l1")
        ctx = span.get_span_context()
    log.info("after", n=2)
    log.debug("not shown")
    first, second = json_lines()
    assert first == {
        "event": "claim_granted", "lease_id": "l1", "node_id": "decode-0", "request_id": "req-1",
        "level": "info", "logger": "services.router", "service": "router",
        "timestamp": first["timestamp"],
        "trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
    }
    assert first["timestamp"].endswith("Z")
    assert "request_id" not in second and "trace_id" not in second and second["n"] == 2


def test_stdlib_records_and_exceptions_are_json_too(json_lines):
    logging.getLogger("nats.aio.client").warning("reconnecting to %s", "nats://x:4222")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("t").exception("handler_failed")
    stdlib, failure = json_lines()
    assert stdlib["event"] == "reconnecting to nats://x:4222"
    assert (stdlib["service"], stdlib["level"], stdlib["logger"]) == (
        "router", "warning", "nats.aio.client")
    assert failure["level"] == "error" and "RuntimeError: boom" in failure["exception"]


def test_setting_up_again_replaces_the_handler(json_lines):
    setup_logging("router", level="INFO", json=True)
    get_logger("t").info("once")
    assert [line["event"] for line in json_lines()] == ["once"]


def test_bad_level_is_refused():
    with pytest.raises(ValueError, match="log level 'LOUD' is not one of DEBUG, INFO"):
        setup_logging("router", level="loud")
