"""structlog set-up shared by every service: one JSON object per line on stderr.

Contract:
    setup_logging(service, level="INFO", json=True)
    log = get_logger(__name__, node_id="decode-0")     # extra keys bound to every line
    structlog.contextvars.bind_contextvars(request_id=rid)   # or: with request_context(rid): ...
    log.info("claim_granted", lease_id=...)

Every line carries ``timestamp`` (UTC ISO), ``level``, ``service``, ``logger``, ``event`` and, when
an OpenTelemetry span is current, ``trace_id`` (32 hex) and ``span_id`` (16 hex); ``request_id``
and anything else bound with structlog's contextvars ride along. Records of stdlib ``logging``
(nats-py, uvicorn, vLLM) go through the same renderer. ``json=False`` renders for humans.
Stdout is left to the commands' own output.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator

import structlog
from opentelemetry import trace

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_trace_ids(logger, method_name, event_dict):
    """structlog processor: trace_id/span_id of the current OpenTelemetry span."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def _add_service(service: str):
    def add_service(logger, method_name, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    return add_service


def _add_logger_name(logger, method_name, event_dict):
    event_dict["logger"] = logger.name
    return event_dict


def setup_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    """Configure structlog and stdlib logging for this process (call once, at start)."""
    level = level.upper()
    if level not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(_LEVELS)}")
    common = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
        add_trace_ids,
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    exc_info = structlog.processors.format_exc_info if json else _identity
    # The services' own lines are rendered by structlog and written straight to stderr: no stdlib
    # LogRecord, caller lookup, handler lock or logger registry on the way (a request's lines are
    # on its first token's path; through stdlib logging one cost ~0.25 ms there).
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            _add_logger_name,
            *common,
            structlog.processors.StackInfoRenderer(),
            exc_info,
            renderer,
        ],
        logger_factory=_StderrLogger,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        cache_logger_on_first_use=False,
    )
    # Records of stdlib logging (nats-py, uvicorn, vLLM) go through the same renderer.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, *common],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            exc_info,
            renderer,
        ],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _StderrHandler):  # set up before: replaced, never doubled
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


class _StderrLogger:
    """structlog's output: one line to whatever ``sys.stderr`` is at the time (redirections apply)."""

    def __init__(self, name: str = "", *_args) -> None:
        self.name = name

    _lock = threading.Lock()  # one line at a time from every thread, as stdlib's handler locks

    def msg(self, message: str) -> None:
        with self._lock:
            stream = sys.stderr
            stream.write(message + "\n")
            stream.flush()

    debug = info = warning = warn = error = critical = exception = fatal = failure = err = log = msg


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (redirections apply)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _identity(logger, method_name, event_dict):
    return event_dict


def get_logger(name: str, **bind) -> structlog.stdlib.BoundLogger:
    """A logger named ``name`` with ``bind`` attached to every line."""
    return structlog.get_logger(name).bind(**bind) if bind else structlog.get_logger(name)


@contextlib.contextmanager
def request_context(request_id: str, **extra) -> Iterator[None]:
    """Bind ``request_id`` (and ``extra``) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **extra):
        yield
