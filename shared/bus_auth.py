"""How a service proves itself to nats-server: credentials and TLS material read from files.

Contract:
    auth = BusAuth(user="router", password_file="/run/secrets/router", tls_ca="ca.pem").validate()
        # ValueError naming the flag when the settings cannot work (a file missing, a user without
        # a password file, a client certificate without its key, ...)
    kwargs = auth.connect_kwargs()     # nats-py connect() keyword arguments; the files are read now
    auth.who                           # "router", "nkey seed file F" or "" (for error messages)

Nothing secret ever rides on a command line: flags name files (``--nats-password-file``,
``--nats-creds-file``), whose contents are read when the bus connects. ``creds_file`` is either a
NATS ``.creds`` file (user JWT and nkey seed, from ``nsc``) or a bare nkey seed (``SU...``); both
need the ``nkeys`` package. With ``tls_ca`` (and optionally ``tls_cert`` + ``tls_key`` for servers
that verify clients) the connection is TLS and the server's certificate is checked against that CA.

Pure: no network I/O.
"""

from __future__ import annotations

import importlib.util
import os
import ssl
from dataclasses import dataclass
from typing import Any

_JWT_MARKER = "BEGIN NATS USER JWT"


@dataclass(frozen=True)
class BusAuth:
    user: str = ""
    password_file: str = ""
    creds_file: str = ""  # NATS .creds (JWT + nkey seed) or a bare nkey seed
    tls_ca: str = ""  # CA bundle that signed the server's certificate; "" with cert: system CAs
    tls_cert: str = ""  # client certificate (servers with tls verify)
    tls_key: str = ""

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    @property
    def who(self) -> str:
        if self.user:
            return self.user
        return f"nkey/creds file {self.creds_file}" if self.creds_file else ""

    def validate(self) -> BusAuth:
        """Raise ValueError naming the flag that cannot work; return self."""
        if self.password_file and not self.user:
            raise ValueError("--nats-password-file needs --nats-user (whose password it holds)")
        if self.user and not self.password_file:
            raise ValueError(f"--nats-user {self.user} needs --nats-password-file (a file holding "
                             "the password; never put the password itself on a command line)")
        if self.user and self.creds_file:
            raise ValueError("--nats-user and --nats-creds-file are two ways to log in: give one")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together (client certificate "
                             "and its private key)")
        for flag, path in (("--nats-password-file", self.password_file),
                           ("--nats-creds-file", self.creds_file), ("--nats-tls-ca", self.tls_ca),
                           ("--nats-tls-cert", self.tls_cert), ("--nats-tls-key", self.tls_key)):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: no such readable file")
        if self.creds_file and importlib.util.find_spec("nkeys") is None:
            raise ValueError("--nats-creds-file needs the nkeys package: pip install nkeys")
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (server certificate checked against ``tls_ca``), or None."""
        if not self.is_tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or None)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's ``connect()``; reads the files now."""
        kwargs: dict[str, Any] = {}
        if self.user:
            kwargs["user"] = self.user
            kwargs["password"] = read_secret(self.password_file)
        if self.creds_file:
            with open(self.creds_file, encoding="utf-8", errors="replace") as f:
                is_jwt = _JWT_MARKER in f.read()
            kwargs["user_credentials" if is_jwt else "nkeys_seed"] = self.creds_file
        ctx = self.ssl_context()
        if ctx is not None:
            kwargs["tls"] = ctx
        return kwargs


def read_secret(path: str) -> str:
    """The contents of a secret file, without the trailing newline an editor adds."""
    with open(path, encoding="utf-8") as f:
        return f.read().rstrip("\r\n")
