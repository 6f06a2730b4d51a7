"""What the security tests share: distinctive secrets, the key material (:class:`PKI`), the
nats-server configuration per auth mode, and :class:`AuthMode` (how the library, the ``cg`` CLI
and the Dagster resource connect to a mode's server, with Dagster secrets as ``EnvVar`` only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nkeys
from dagster import EnvVar

from cg_pipelines.dagster import NatsResource
from cg_pipelines.jetstream.connect import ConnectOptions
from tests.security.pki import CA, CertPair, Operator

# Distinctive secrets: the leak tests grep every output for them.
PASSWORD = "s3cr3t-PASSWORD-xyz"
WRONG_PASSWORD = "wr0ng-PASSWORD-abc"
TOKEN = "tok-SECRET-123"
WRONG_TOKEN = "tok-WRONG-456"
USER = "alice"

CG = [sys.executable, "-m", "cg_pipelines.cli"]
MODES = ["user_password", "token", "nkey", "creds", "tls", "mtls"]


@dataclass(frozen=True)
class PKI:
    ca: CA
    other_ca: CA  # signed nothing the servers trust
    server: CertPair
    client: CertPair
    foreign_client: CertPair  # a client certificate signed by other_ca
    nkey_seed: str  # seed file of the user the nkey server knows
    unknown_nkey_seed: str  # seed file of a user it does not know
    operator: Operator
    creds: str  # .creds of a user of the operator's account
    foreign_creds: str  # .creds signed by an account the operator never signed


def nkey_public(seed_file: str) -> str:
    return nkeys.from_seed(bytearray(Path(seed_file).read_bytes().strip())).public_key.decode()


def server_config(mode: str, pki: PKI) -> str | None:
    """nats-server configuration for ``mode`` (None: no auth, plain TCP)."""
    tls = f'tls {{\n  cert_file: "{pki.server.cert}"\n  key_file: "{pki.server.key}"\n'
    return {
        "plain": None,
        "user_password": f'authorization {{ user: {USER}, password: "{PASSWORD}" }}\n',
        "token": f'authorization {{ token: "{TOKEN}" }}\n',
        "nkey": f"authorization {{ users = [ {{ nkey: {nkey_public(pki.nkey_seed)} }} ] }}\n",
        "creds": pki.operator.server_config(),
        "tls": tls + "}\n",
        "mtls": tls + f'  ca_file: "{pki.ca.cert}"\n  verify: true\n}}\n',
    }[mode]


@dataclass(frozen=True)
class AuthMode:
    """How each client of this project connects to one auth mode's server."""

    name: str
    url: str
    options: ConnectOptions  # the library
    cli_args: list[str]  # global ``cg`` options (after --server)
    resource: NatsResource  # Dagster; secrets as EnvVar
    # what the EnvVars read; values that must never be printed (kept out of test reports too)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)


def auth_mode(name: str, url: str, pki: PKI) -> AuthMode:
    """The working client settings for mode ``name`` against ``url``."""
    if name == "user_password":
        return AuthMode(name, url, ConnectOptions(url, user=USER, password=PASSWORD),
                        ["--user", USER, "--password", PASSWORD],
                        NatsResource(servers=url, user=USER,
                                     password=EnvVar("CG_TEST_NATS_PASSWORD")),
                        {"CG_TEST_NATS_PASSWORD": PASSWORD}, (PASSWORD,))
    if name == "token":
        return AuthMode(name, url, ConnectOptions(url, token=TOKEN), ["--token", TOKEN],
                        NatsResource(servers=url, token=EnvVar("CG_TEST_NATS_TOKEN")),
                        {"CG_TEST_NATS_TOKEN": TOKEN}, (TOKEN,))
    if name == "nkey":
        seed = Path(pki.nkey_seed).read_text().strip()
        return AuthMode(name, url, ConnectOptions(url, nkey_seed=pki.nkey_seed),
                        ["--nkey", pki.nkey_seed],
                        NatsResource(servers=url,
                                     nkey_seed_file=EnvVar("CG_TEST_NATS_NKEY")),
                        {"CG_TEST_NATS_NKEY": pki.nkey_seed}, (seed,))
    if name == "creds":
        return AuthMode(name, url, ConnectOptions(url, creds=pki.creds),
                        ["--creds", pki.creds],
                        NatsResource(servers=url, creds_file=EnvVar("CG_TEST_NATS_CREDS")),
                        {"CG_TEST_NATS_CREDS": pki.creds})
    if name == "tls":
        return AuthMode(name, url, ConnectOptions(url, tls_ca=pki.ca.cert),
                        ["--tls-ca", pki.ca.cert], NatsResource(servers=url, tls_ca=pki.ca.cert))
    if name == "mtls":
        c = pki.client
        return AuthMode(name, url, ConnectOptions(url, tls_ca=pki.ca.cert, tls_cert=c.cert,
                                                  tls_key=c.key),
                        ["--tls-ca", pki.ca.cert, "--tls-cert", c.cert, "--tls-key", c.key],
                        NatsResource(servers=url, tls_ca=pki.ca.cert, tls_cert=c.cert,
                                     tls_key=EnvVar("CG_TEST_NATS_KEY")),
                        {"CG_TEST_NATS_KEY": c.key})
    raise ValueError(name)


def clean_env(**extra: str) -> dict[str, str]:
    """The process environment without NATS_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return {**env, **extra}


def cg(*args: str, env: dict[str, str] | None = None,
       timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``cg ARGS`` (no NATS_* variables from the outer environment unless in ``env``)."""
    return subprocess.run([*CG, *args], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env())


_FLAGS = {"user": "--user", "password": "--password", "token": "--token", "nkey_seed": "--nkey",
          "creds": "--creds", "tls_ca": "--tls-ca", "tls_cert": "--tls-cert",
          "tls_key": "--tls-key"}


def cli_args(opts: ConnectOptions) -> list[str]:
    """The global ``cg`` options giving the same connection as ``opts``."""
    out = ["--server", opts.servers]
    for name, flag in _FLAGS.items():
        value = getattr(opts, name)
        if value:
            out += [flag, value]
    return out


def resource_for(opts: ConnectOptions) -> tuple[NatsResource, dict[str, str]]:
    """A Dagster resource for the same connection as ``opts``, the password and token as
    ``EnvVar``; returns it and the environment those read."""
    env = {}
    secret: dict[str, object] = {}
    for name in ("password", "token"):
        value = getattr(opts, name)
        if value:
            var = f"CG_TEST_NATS_{name.upper()}"
            env[var] = value
            secret[name] = EnvVar(var)
    res = NatsResource(servers=opts.servers, user=opts.user, creds_file=opts.creds,
                       nkey_seed_file=opts.nkey_seed, tls_ca=opts.tls_ca,
                       tls_cert=opts.tls_cert, tls_key=opts.tls_key, **secret)
    return res, env
