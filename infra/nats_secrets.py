"""Secrets for a NATS deployment with TLS and one user per service, written as files.

Contract:
    secrets = make_secrets(out_dir, hosts=("127.0.0.1", "localhost", "nats"))
        # out_dir/ca.pem, server-cert.pem, server-key.pem (a self-signed CA and a server
        # certificate for ``hosts``) and one <user>.password per user of infra/nats/nats.conf.
        # Files already there are kept (a second run changes nothing); keys and passwords are 0600.
    secrets.password_file("router") ; secrets.server_env()    # XL_NATS_<USER>_PASSWORD for nats-server
    secrets.client_args("router")    # ["--nats-user", "router", "--nats-password-file", F, "--nats-tls-ca", CA]
    make_client_cert(out_dir, "router")  # out_dir/router-cert.pem + router-key.pem, signed by the CA

``expresslane nats-secrets OUT_DIR [--host NAME ...]`` writes them (for docker-compose.secure.yml).
The CA's private key is kept in out_dir/ca-key.pem (0600) so client certificates can be added.
Needs the ``cryptography`` package.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets as token_source
from dataclasses import dataclass
from pathlib import Path

USERS = ("router", "coordinator", "decode", "prefill", "tools")  # infra/nats/nats.conf
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "nats")
VALID_DAYS = 825


@dataclass(frozen=True)
class NatsSecrets:
    out_dir: Path

    @property
    def ca(self) -> Path:
        return self.out_dir / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.out_dir / "server-cert.pem"

    @property
    def server_key(self) -> Path:
        return self.out_dir / "server-key.pem"

    def password_file(self, user: str) -> Path:
        return self.out_dir / f"{user}.password"

    def server_env(self) -> dict[str, str]:
        """The passwords as nats.conf reads them (nats-server's environment, never its flags)."""
        return {f"XL_NATS_{u.upper()}_PASSWORD": self.password_file(u).read_text().strip()
                for u in USERS}

    def client_args(self, user: str) -> list[str]:
        """A service's bus flags: file paths only."""
        return ["--nats-user", user, "--nats-password-file", str(self.password_file(user)),
                "--nats-tls-ca", str(self.ca)]


def make_secrets(out_dir: str | os.PathLike, hosts: tuple[str, ...] = DEFAULT_HOSTS,
                 users: tuple[str, ...] = USERS) -> NatsSecrets:
    """Write what is missing of the CA, the server certificate and the passwords (see module doc)."""
    out = NatsSecrets(Path(out_dir))
    out.out_dir.mkdir(parents=True, exist_ok=True)
    for user in users:
        if not out.password_file(user).exists():
            _write(out.password_file(user), new_password().encode() + b"\n", 0o600)
    if not (out.ca.exists() and out.server_cert.exists() and out.server_key.exists()):
        ca_key, ca_cert = _make_ca(out.out_dir)
        key, cert = _sign(ca_key, ca_cert, "expresslane nats-server", hosts, is_server=True)
        _write(out.server_key, _key_pem(key), 0o600)
        _write(out.server_cert, _cert_pem(cert), 0o644)
    return out


def new_password() -> str:
    """192 random bits as a letter and hex digits: nats-server parses an environment variable's value
    as a config value, so a password starting with a digit or holding punctuation breaks it."""
    return "xl" + token_source.token_hex(24)


def make_client_cert(out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """A client certificate for ``name`` signed by out_dir's CA; returns (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    out_dir = Path(out_dir)
    ca_cert = x509.load_pem_x509_certificate((out_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((out_dir / "ca-key.pem").read_bytes(), None)
    key, cert = _sign(ca_key, ca_cert, name, (), is_server=False)
    cert_path, key_path = out_dir / f"{name}-cert.pem", out_dir / f"{name}-key.pem"
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, _cert_pem(cert), 0o644)
    return cert_path, key_path


# ---------------------------------------------------------------------- certificates


def _make_ca(out_dir: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "expresslane NATS CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(out_dir / "ca-key.pem", _key_pem(key), 0o600)
    _write(out_dir / "ca.pem", _cert_pem(cert), 0o644)
    return key, cert


def _sign(ca_key, ca_cert, common_name: str, hosts, *, is_server: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if is_server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]),
                                        critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


# ---------------------------------------------------------------------- `expresslane nats-secrets`


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="expresslane nats-secrets",
        description="Write a self-signed CA, a nats-server TLS certificate and one random password "
        "per NATS user into OUT_DIR (what is already there is kept).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--host", action="append", default=None,
                        help=f"a name or address clients reach the server by (repeat; default "
                        f"{' '.join(DEFAULT_HOSTS)})")
    args = parser.parse_args(argv)
    out = make_secrets(args.out_dir, hosts=tuple(args.host or DEFAULT_HOSTS))
    print(f"NATS secrets in {out.out_dir}: {out.ca.name}, {out.server_cert.name}, "
          f"{out.server_key.name}, " + ", ".join(out.password_file(u).name for u in USERS))
    return 0
