"""Fixtures of the security tests: a self-signed CA made here (server and client certificates,
plus a second, untrusted CA), NKeys and an operator with a ``.creds`` user, and one real
nats-server per auth mode (JetStream on, loopback, random port, store in a temp dir), started on
first use and stopped at the end of the session. A missing nats-server binary fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import nkeys
import pytest

from cg_pipelines.local.nats_server import NatsServer
from tests.security.modes import MODES, PKI, AuthMode, auth_mode, server_config
from tests.security.pki import CA, Operator, new_keypair


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA(d / "ca", "cg-test-ca"), CA(d / "other", "other-ca")
    known, unknown = new_keypair(nkeys.PREFIX_BYTE_USER), new_keypair(nkeys.PREFIX_BYTE_USER)
    (d / "user.nk").write_bytes(known.seed + b"\n")
    (d / "unknown.nk").write_bytes(unknown.seed + b"\n")
    op = Operator.create()
    return PKI(ca=ca, other_ca=other, server=ca.issue("server", server=True),
               client=ca.issue("client", server=False),
               foreign_client=other.issue("foreign-client", server=False),
               nkey_seed=str(d / "user.nk"), unknown_nkey_seed=str(d / "unknown.nk"),
               operator=op, creds=op.user_creds(d / "user.creds"),
               foreign_creds=op.user_creds(d / "foreign.creds",
                                           signer=new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)))


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory,
                pki: PKI) -> Iterator[Callable[[str], NatsServer]]:
    """``auth_server(mode)``: the session's running server of that mode (started on first use;
    modes: ``plain`` and :data:`MODES`)."""
    started: dict[str, NatsServer] = {}

    def get(mode: str) -> NatsServer:
        if mode not in started:
            srv = NatsServer(tmp_path_factory.mktemp(f"nats-{mode}"), port=0,
                             config_text=server_config(mode, pki))
            srv.start()
            started[mode] = srv
        return started[mode]

    try:
        yield get
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, auth_server: Callable[[str], NatsServer],
         pki: PKI, monkeypatch: pytest.MonkeyPatch) -> AuthMode:
    """Each auth mode in turn, its server running and its EnvVars set."""
    m = auth_mode(request.param, auth_server(request.param).url, pki)
    for k, v in m.env.items():
        monkeypatch.setenv(k, v)
    return m


