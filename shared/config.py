"""Command-line flags and ``EXPRESSLANE_*`` environment variables, parsed once and validated.

Contract:
    parser = argparse.ArgumentParser(prog="expresslane router")
    add_common_args(parser)      # --nats-url, the --nats-* credential and TLS files, --log-*
    parser.add_argument("--max-queue", type=positive_int, default=64)
    args = parse_args(parser, argv, env=os.environ)
    auth = bus_auth(args)        # shared.bus_auth.BusAuth, validated (ValueError names the flag)

Every long flag ``--foo-bar`` also reads ``EXPRESSLANE_FOO_BAR``; a flag on the command line wins
over the variable, the variable over the default. Values from the environment go through the
flag's ``type`` and ``choices`` like typed ones; a bad value exits with status 2 and a message
naming both the flag and the variable. Boolean flags (store_true/store_false) read 1/true/yes/on
and 0/false/no/off; list flags (nargs / append) read comma-separated values. A password in a
--nats-url given on the command line (which `ps` shows) draws a warning on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.parse
from collections.abc import Mapping, Sequence

from shared.bus_auth import BusAuth

ENV_PREFIX = "EXPRESSLANE_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NATS_SCHEMES = ("nats", "tls", "ws", "wss")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_var(flag: str) -> str:
    """``--foo-bar`` -> ``EXPRESSLANE_FOO_BAR``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


# ---------------------------------------------------------------------- value types


def nats_url(value: str) -> str:
    """One or more comma-separated nats://host:port URLs (credentials allowed)."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("empty: give a URL such as nats://127.0.0.1:4222")
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in _NATS_SCHEMES or not parts.hostname or port == -1:
            shown = url.split("@")[-1]
            raise argparse.ArgumentTypeError(
                f"{shown!r} is not a NATS URL: use nats://HOST:PORT, e.g. nats://127.0.0.1:4222"
            )
    return ",".join(urls)


def positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a whole number above 0")
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} must be a whole number, 0 or more")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} must be a number above 0")
    return number


def port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 1-65535 (0: any free port)")
    return number


# ---------------------------------------------------------------------- parser


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags every service has: --nats-url, --log-level, --log-format."""
    group = parser.add_argument_group("common")
    group.add_argument("--nats-url", type=nats_url, default=DEFAULT_NATS_URL,
                       help="NATS server(s), comma-separated (default "
                       f"{DEFAULT_NATS_URL}). A password in the URL (nats://user:password@host:4222) "
                       "is visible to every local user in `ps` when given as a flag: set it in "
                       f"{env_var('--nats-url')} instead, or use --nats-user with "
                       "--nats-password-file")
    group.add_argument("--nats-user", default="", help="NATS user (with --nats-password-file)")
    group.add_argument("--nats-password-file", default="",
                       help="file holding the NATS user's password")
    group.add_argument("--nats-creds-file", default="",
                       help="NATS .creds file (user JWT + nkey seed) or nkey seed file")
    group.add_argument("--nats-tls-ca", default="",
                       help="CA certificate(s) that signed nats-server's certificate: connect with "
                       "TLS and verify the server")
    group.add_argument("--nats-tls-cert", default="",
                       help="client certificate, for a server that verifies clients (with "
                       "--nats-tls-key)")
    group.add_argument("--nats-tls-key", default="", help="the client certificate's private key")
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                       help="log level (default INFO)")
    group.add_argument("--log-format", choices=("json", "console"), default="json",
                       help="json: one JSON object per line (default); console: for humans")
    return parser


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    env: Mapping[str, str] = os.environ,
) -> argparse.Namespace:
    """Parse ``argv`` with ``EXPRESSLANE_*`` values from ``env`` as defaults (see module doc).

    The parser is left as it was, so it can be parsed again with another environment."""
    if parser.epilog is None:
        parser.epilog = "Every --foo-bar flag can also be set with the variable EXPRESSLANE_FOO_BAR."
    args = list(sys.argv[1:] if argv is None else argv)
    from_env = argparse.Namespace()  # values already set here are kept unless a flag is given
    relaxed: list[argparse.Action] = []
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag == "--help" or env_var(flag) not in env:
            continue
        if isinstance(action, argparse._AppendAction) and _given(action, args):
            continue  # appending to the variable's values would not be "the flag wins"
        value = _from_env(parser, action, flag, env_var(flag), env[env_var(flag)])
        setattr(from_env, action.dest, value)
        if action.required:
            action.required = False
            relaxed.append(action)
    try:
        parsed = parser.parse_args(args, namespace=from_env)
    finally:
        for action in relaxed:
            action.required = True
    url_flags = [a for a in parser._actions if "--nats-url" in a.option_strings]
    if url_flags and _given(url_flags[0], args) and _has_password(getattr(parsed, "nats_url", "")):
        print(f"{parser.prog}: warning: --nats-url carries a password, which other local users can "
              f"read in `ps`; set {env_var('--nats-url')} or use --nats-password-file instead",
              file=sys.stderr)
    return parsed


def bus_auth(args: argparse.Namespace) -> BusAuth:
    """The --nats-* credential and TLS files of ``args``, checked; ValueError names the flag."""
    return BusAuth(
        user=args.nats_user, password_file=args.nats_password_file, creds_file=args.nats_creds_file,
        tls_ca=args.nats_tls_ca, tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key,
    ).validate()


def _has_password(url: str) -> bool:
    return any(urllib.parse.urlsplit(u.strip()).password for u in url.split(",") if u.strip())


def _given(action: argparse.Action, args: list[str]) -> bool:
    return any(a == o or a.startswith(o + "=") for a in args for o in action.option_strings)


def _from_env(parser, action: argparse.Action, flag: str, name: str, raw: str):
    def fail(why: str):
        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", raw)  # never echo a password
        parser.error(f"{name}={shown!r} (the variable for {flag}): {why}")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            fail("use one of 1/true/yes/on or 0/false/no/off")
        is_on = word in _TRUE
        return is_on if isinstance(action, argparse._StoreTrueAction) else not is_on
    is_list = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or (
        isinstance(action.nargs, int) and action.nargs > 1
    )
    items = [s.strip() for s in raw.split(",") if s.strip()] if is_list else [raw]
    values = []
    for item in items:
        try:
            value = action.type(item) if action.type else item
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            type_name = getattr(action.type, "__name__", "value")
            fail(str(exc) if isinstance(exc, argparse.ArgumentTypeError)
                 else f"not a valid {type_name}")
        if action.choices is not None and value not in action.choices:
            fail(f"choose from {', '.join(map(str, action.choices))}")
        values.append(value)
    return values if is_list else values[0]
