"""``expresslane events``: a live view of the bus, for machines without the NATS CLI.

    expresslane events [--subject 'xl.>'] [--json] [--nats-url URL] [--count N] [--timeout-s S]

One line per message on stdout (time in UTC), flushed as it arrives:
    10:31:02.123  xl.req.r1.tokens  tokens  request_id=r1 index=0 token_ids=[1,2,3]  trace_id=4bf9...
Messages that are not expresslane events are shown raw with the decoding error. ``--json`` prints
one JSON object per line instead: ``{"subject", "time_ms", "traceparent", "event"}`` with the
message's own JSON as ``event`` (unchanged). A line on stderr says when the subscription is live.

Stops cleanly on Ctrl-C / SIGTERM (status 0). ``--count N`` exits 0 after N messages;
``--timeout-s S`` stops after S seconds: status 0, or 1 when ``--count`` messages did not all
arrive (usable as a health check: ``--subject xl.node.decode-0.avail --count 1 --timeout-s 5``).
Status 1 also when nats-server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import signal
import sys
import time

import msgspec

from shared import events, subjects
from shared.config import add_common_args, bus_auth, parse_args, positive_float, positive_int

MAX_VALUE_CHARS = 160


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expresslane events",
        description="Watch the bus: one decoded expresslane event per line until Ctrl-C.",
    )
    parser.add_argument("--subject", default=subjects.ALL,
                        help=f"subject to watch, wildcards allowed (default {subjects.ALL!r})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per message instead of a readable line")
    parser.add_argument("--count", type=positive_int, default=None,
                        help="exit after this many messages")
    parser.add_argument("--timeout-s", type=positive_float, default=None,
                        help="stop after this many seconds (status 1 if --count was not reached)")
    add_common_args(parser)
    return parser


# ---------------------------------------------------------------------- formatting (pure)


def format_value(value) -> str:
    """A field value as shown in a line: bare words, quoted strings, compact JSON otherwise."""
    if isinstance(value, str):
        text = value if value and not any(c.isspace() or c in "=\"'" for c in value) else repr(value)
    else:
        text = msgspec.json.encode(value).decode()
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}...({len(text)} chars)"
    return text


def _empty_default(field: msgspec.structs.FieldInfo, value) -> bool:
    """An optional list or map left empty (e.g. a token batch without logprobs): not shown."""
    has_default = field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT
    return has_default and isinstance(value, (list, dict)) and not value


def format_line(subject: str, data: bytes, headers: dict | None, received_s: float) -> str:
    """One readable line for one message."""
    stamp = datetime.datetime.fromtimestamp(received_s, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
    trace = _trace_id(headers)
    try:
        event = events.decode_any(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raw = data[:MAX_VALUE_CHARS].decode(errors="replace")
        line = f"{stamp}  {subject}  ?  {raw}  (not an expresslane event: {exc})"
    else:
        tag = msgspec.inspect.type_info(type(event)).tag
        fields = " ".join(
            f"{f.encode_name}={format_value(getattr(event, f.name))}"
            for f in msgspec.structs.fields(event) if not _empty_default(f, getattr(event, f.name))
        )
        line = f"{stamp}  {subject}  {tag}  {fields}"
    return f"{line}  trace_id={trace}" if trace else line


def format_json(subject: str, data: bytes, headers: dict | None, received_s: float) -> str:
    """One JSON object per message, the message's own JSON kept as it came."""
    try:
        msgspec.json.decode(data)
        payload: object = msgspec.Raw(data)
    except msgspec.DecodeError:
        payload = data.decode(errors="replace")
    doc = {
        "subject": subject,
        "time_ms": int(received_s * 1000),
        "traceparent": (headers or {}).get("traceparent", ""),
        "event": payload,
    }
    return msgspec.json.encode(doc).decode()


def _trace_id(headers: dict | None) -> str:
    parts = (headers or {}).get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 else ""


# ---------------------------------------------------------------------- I/O shell


async def watch(args: argparse.Namespace) -> int:
    from shared.bus import Bus, BusUnavailable, redact_url

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        bus = await Bus.connect(args.nats_url, name="expresslane-events", auth=bus_auth(args))
    except (BusUnavailable, ValueError) as exc:
        print(f"expresslane events: {exc}", file=sys.stderr)
        return 1
    render = format_json if args.json else format_line
    num_seen = 0

    async def on_message(msg) -> None:
        nonlocal num_seen
        if stop.is_set():
            return
        print(render(msg.subject, msg.data, msg.headers, time.time()), flush=True)
        num_seen += 1
        if args.count and num_seen >= args.count:
            stop.set()

    try:
        await bus.nc.subscribe(args.subject, cb=on_message)
        await bus.flush()
        print(f"watching {args.subject} on {redact_url(args.nats_url)} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), args.timeout_s)
    finally:
        await bus.close()
    if args.count and num_seen < args.count:
        print(f"expresslane events: saw {num_seen} of {args.count} messages on {args.subject} "
              f"within {args.timeout_s:g} s", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    from shared.log import setup_logging

    args = parse_args(build_parser(), argv)
    setup_logging("events", level="WARNING" if args.log_level == "INFO" else args.log_level,
                  json=args.log_format == "json")
    try:
        return asyncio.run(watch(args))
    except BrokenPipeError:  # piped into `head`: the reader is gone, so are we
        sys.stderr.close()
        return 0
