"""Test-only key material made on the fly: a self-signed CA with server and client
certificates (``cryptography``), and NATS operator/account/user JWTs signed with NKeys
(``nkeys``) for an operator-mode server with a ``.creds`` file."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import time
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# ------------------------------------------------------------------------------------- TLS


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


@dataclass(frozen=True)
class CertPair:
    cert: str  # PEM certificate path
    key: str  # PEM private key path


class CA:
    """A self-signed certificate authority writing its files under ``directory``."""

    def __init__(self, directory: Path, name: str = "cg-test-ca") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = _key()
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = _write_cert(self._cert, self.dir / f"{name}.pem")

    def issue(self, cn: str, *, server: bool) -> CertPair:
        """A leaf certificate for ``cn``: a server one (SAN 127.0.0.1 and localhost) or a
        client one."""
        key = _key()
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
        )
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(IPv4Address("127.0.0.1"))]),
                critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        return CertPair(_write_cert(cert, self.dir / f"{cn}.pem"),
                        _write_key(key, self.dir / f"{cn}-key.pem"))


# ------------------------------------------------------------------------------- NKeys/JWT


def new_keypair(prefix: int) -> nkeys.KeyPair:
    """A fresh NKey pair (``prefix``: ``nkeys.PREFIX_BYTE_USER`` / ``_ACCOUNT`` / ...)."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_jwt(signer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A NATS v2 JWT (``alg: ed25519-nkey``) for ``subject`` signed by ``signer``."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": signer.public_key.decode(),
                              "name": name, "sub": subject, "nats": {**nats, "version": 2}}
    # jti: base32 of the SHA-512/256 hash of the claims without jti (as nats-io/jwt does).
    digest = hashlib.new("sha512_256", json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(claims).encode())
    sig = signer.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{_b64(sig)}"


@dataclass(frozen=True)
class Operator:
    """An operator with one JetStream-enabled account for an operator-mode server."""

    operator_jwt: str
    account_pub: str
    account_jwt: str
    account_kp: nkeys.KeyPair
    system_pub: str
    system_jwt: str

    @classmethod
    def create(cls) -> Operator:
        op = new_keypair(nkeys.PREFIX_BYTE_OPERATOR)
        acc = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        op_pub, acc_pub = op.public_key.decode(), acc.public_key.decode()
        op_jwt = encode_jwt(op, op_pub, "cg-test-operator", {"type": "operator"})
        unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                     "wildcards": True, "conn": -1, "leaf": -1,
                     "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        acc_jwt = encode_jwt(op, acc_pub, "cg-test-account", {
            "type": "account", "limits": unlimited,
            "default_permissions": {"pub": {}, "sub": {}}})
        # JetStream in operator mode needs a system account.
        sys_pub = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT).public_key.decode()
        sys_jwt = encode_jwt(op, sys_pub, "SYS", {"type": "account", "limits": {
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": True, "conn": -1, "leaf": -1}})
        return cls(op_jwt, acc_pub, acc_jwt, acc, sys_pub, sys_jwt)

    def server_config(self) -> str:
        """nats-server configuration lines for operator mode with an in-memory resolver."""
        return (f"operator: {self.operator_jwt}\n"
                f"system_account: {self.system_pub}\n"
                f"resolver: MEMORY\n"
                f"resolver_preload: {{\n  {self.account_pub}: {self.account_jwt}\n"
                f"  {self.system_pub}: {self.system_jwt}\n}}\n")

    def user_creds(self, path: Path, name: str = "cg-test-user",
                   signer: nkeys.KeyPair | None = None) -> str:
        """Write a ``.creds`` file for a new user of the account (signed by ``signer``,
        default the account key; another key gives credentials the server rejects)."""
        user = new_keypair(nkeys.PREFIX_BYTE_USER)
        jwt = encode_jwt(signer or self.account_kp, user.public_key.decode(), name, {
            "type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n"
            f"{jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n")
        return str(path)
