"""Wrong credentials and TLS mistakes are clear, typed errors, fast (no hang, no reconnect
loop): the library raises NatsAuthError / NatsTLSError / NatsConnectError naming the server and
the problem; ``cg`` exits 1 with one ``cg: error:`` line (no traceback); the Dagster resource
raises the same typed error."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from cg_pipelines.jetstream.connect import (
    ConnectOptions,
    NatsAuthError,
    NatsConnectError,
    NatsTLSError,
)
from cg_pipelines.local.nats_server import NatsServer
from tests.security.modes import (
    PKI,
    USER,
    WRONG_PASSWORD,
    WRONG_TOKEN,
    cg,
    cli_args,
    resource_for,
)

# Seconds within which a rejected connection must be reported (it takes well under 1 s; the
# bound only proves "no hang / no retry loop" on a loaded machine).
LIB_BOUND_S = 10.0
CLI_BOUND_S = 20.0  # includes the interpreter start


@dataclass(frozen=True)
class Case:
    name: str
    server: str  # auth mode of the server (see conftest.server_config)
    options: Callable[[str, PKI], ConnectOptions]  # (url, pki) -> client settings
    error: type[NatsConnectError]
    words: tuple[str, ...]  # all in the message


CASES = [
    Case("wrong_password", "user_password",
         lambda url, p: ConnectOptions(url, user=USER, password=WRONG_PASSWORD), NatsAuthError,
         ("authorization violation", "user/password (user 'alice')", "check the user and "
          "password")),
    Case("no_credentials", "user_password", lambda url, p: ConnectOptions(url), NatsAuthError,
         ("authorization violation", "requires authentication", "no credentials")),
    Case("wrong_password_in_url", "user_password",
         lambda url, p: ConnectOptions(url.replace("nats://", f"nats://{USER}:{WRONG_PASSWORD}@")),
         NatsAuthError, ("authorization violation", "nats://***@127.0.0.1:", "server URL")),
    Case("wrong_token", "token", lambda url, p: ConnectOptions(url, token=WRONG_TOKEN),
         NatsAuthError, ("authorization violation", "rejected token", "check the token")),
    Case("unknown_nkey", "nkey", lambda url, p: ConnectOptions(url, nkey_seed=p.unknown_nkey_seed),
         NatsAuthError, ("authorization violation", "NKey seed file", "unknown.nk")),
    Case("creds_of_unknown_account", "creds",
         lambda url, p: ConnectOptions(url, creds=p.foreign_creds), NatsAuthError,
         ("authorization violation", "creds file", "foreign.creds")),
    Case("tls_wrong_ca", "tls", lambda url, p: ConnectOptions(url, tls_ca=p.other_ca.cert),
         NatsTLSError, ("certificate verify failed", "check tls_ca", "other-ca.pem")),
    Case("tls_server_client_without_tls", "tls", lambda url, p: ConnectOptions(url),
         NatsTLSError, ("certificate verify failed", "the server uses TLS: give tls_ca")),
    Case("mtls_without_client_cert", "mtls",
         lambda url, p: ConnectOptions(url, tls_ca=p.ca.cert), NatsTLSError,
         ("requires a client certificate", "give tls_cert and tls_key")),
    Case("mtls_client_cert_of_other_ca", "mtls",
         lambda url, p: ConnectOptions(url, tls_ca=p.ca.cert, tls_cert=p.foreign_client.cert,
                                       tls_key=p.foreign_client.key), NatsTLSError,
         ("TLS with", "check the client certificate", "foreign-client.pem")),
    Case("tls_options_plain_server", "plain",
         lambda url, p: ConnectOptions(url, tls_ca=p.ca.cert), NatsTLSError,
         ("does not use TLS", "refusing a plaintext connection")),
    Case("creds_file_is_not_creds", "creds",
         lambda url, p: ConnectOptions(url, creds=p.nkey_seed), NatsConnectError,
         ("is not a NATS credentials file", "BEGIN NATS USER JWT")),
    Case("seed_file_is_creds", "nkey", lambda url, p: ConnectOptions(url, nkey_seed=p.creds),
         NatsConnectError, ("does not hold a valid NKey seed", "use creds")),
    Case("missing_seed_file", "nkey",
         lambda url, p: ConnectOptions(url, nkey_seed=p.nkey_seed + ".missing"),
         NatsConnectError, ("cannot read NKey seed file", "No such file")),
]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest, auth_server: Callable[[str], NatsServer],
         pki: PKI) -> tuple[Case, ConnectOptions]:
    c: Case = request.param
    return c, c.options(auth_server(c.server).url, pki)


async def test_library_raises_typed_error_fast(case: tuple[Case, ConnectOptions]) -> None:
    c, opts = case
    t0 = time.monotonic()
    with pytest.raises(c.error) as info:
        nc = await opts.connect()
        await nc.close()
    elapsed = time.monotonic() - t0
    assert elapsed < LIB_BOUND_S, f"{c.name}: {elapsed:.1f} s"
    assert type(info.value) is c.error
    msg = str(info.value)
    for w in c.words:
        assert w in msg, (w, msg)
    if c.error is not NatsConnectError:  # a server answered: it is named
        assert info.value.server and info.value.server in msg, msg


def test_cli_exits_1_with_one_line(case: tuple[Case, ConnectOptions]) -> None:
    c, opts = case
    t0 = time.monotonic()
    r = cg(*cli_args(opts), "elastic", "ls", "S")
    elapsed = time.monotonic() - t0
    assert elapsed < CLI_BOUND_S, f"{c.name}: {elapsed:.1f} s"
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cg: error: "), r.stderr
    for w in c.words:
        assert w in lines[0], (w, lines[0])


def test_dagster_resource_raises_typed_error(case: tuple[Case, ConnectOptions],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    c, opts = case
    res, env = resource_for(opts)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    resolved = res.process_config_and_initialize()  # EnvVars read here, as in a run
    t0 = time.monotonic()
    with pytest.raises(c.error) as info:
        resolved.run(lambda nc: nc.flush())
    assert time.monotonic() - t0 < LIB_BOUND_S
    for w in c.words:
        assert w in str(info.value), (w, str(info.value))


def test_unreachable_server_is_still_no_servers_error() -> None:
    """Not an auth problem: the reconnect attempts run, then nats-py's NoServersError (the CLI
    says "cannot connect to ...")."""
    r = cg("--server", "nats://127.0.0.1:1", "--user", USER, "--password", WRONG_PASSWORD,
           "elastic", "ls", "S")
    assert r.returncode == 1 and "cannot connect to nats://127.0.0.1:1" in r.stderr, r.stderr
