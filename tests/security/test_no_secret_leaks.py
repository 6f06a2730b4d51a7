"""Secrets never appear in logs, exceptions, Dagster run records or CLI output.

Distinctive secret values (passwords, tokens, NKey seeds, the creds file's seed) are used on
success and failure paths; everything a user or an operator could see is collected and grepped:
``cg`` stdout/stderr (text and ``--json``, flags and environment variables, admin and member
commands), the library's exceptions (``str``, ``repr``, formatted traceback with causes), every
Python log record at DEBUG (nats-py's, asyncio's, ours, Dagster's) including the reconnect
warnings of a live connection, the ``repr`` of the option objects and resources, and the Dagster
runs' event logs, run records and job snapshots. Each collection is checked to be non-empty and
to contain what it should (so the grep is not vacuous).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from dagster import DagsterInstance, EnvVar, materialize, serialize_value

from cg_pipelines.dagster import NatsResource
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.local.nats_server import NatsServer
from resources import build_resources
from tests.security.modes import (
    PASSWORD,
    PKI,
    TOKEN,
    USER,
    WRONG_PASSWORD,
    WRONG_TOKEN,
    cg,
    clean_env,
    cli_args,
    resource_for,
    server_config,
)
from tests.security.probe import nats_probe


def all_secrets(pki: PKI) -> list[str]:
    seeds = [Path(p).read_text().strip() for p in (pki.nkey_seed, pki.unknown_nkey_seed)]
    creds_lines = Path(pki.creds).read_text().splitlines()
    creds_seed = creds_lines[creds_lines.index("-----BEGIN USER NKEY SEED-----") + 1]
    return [PASSWORD, WRONG_PASSWORD, TOKEN, WRONG_TOKEN, *seeds, creds_seed]


def assert_no_secret(texts: Iterable[str], secrets: list[str], *, must_contain: list[str]) -> str:
    """Join ``texts``; fail if empty, if a ``must_contain`` string is missing (the grep would
    be vacuous) or if any secret occurs. Returns the joined text."""
    texts = list(texts)
    assert texts and all(isinstance(t, str) for t in texts)
    joined = "\n".join(texts)
    assert joined.strip(), "nothing collected"
    for want in must_contain:
        assert want in joined, f"expected {want!r} in the collected output"
    for s in secrets:
        assert s and s not in joined, "a secret leaked:\n" + joined.replace(s, "<<SECRET>>")
    return joined


def with_url_credentials(url: str, user: str, password: str) -> str:
    return url.replace("nats://", f"nats://{user}:{password}@")


def exception_texts(e: BaseException) -> list[str]:
    return [str(e), repr(e), "".join(traceback.format_exception(e))]


# ------------------------------------------------------------------------------------------ CLI


def test_cli_output_has_no_secret(auth_server: Callable[[str], NatsServer], pki: PKI) -> None:
    pw_url, tok_url = auth_server("user_password").url, auth_server("token").url
    nk_url, creds_url = auth_server("nkey").url, auth_server("creds").url
    good_pw = ConnectOptions(pw_url, user=USER, password=PASSWORD)
    runs = [
        # success, flags: text and JSON
        cg(*cli_args(good_pw), "elastic", "ls", "S"),
        cg(*cli_args(good_pw), "--json", "elastic", "ls", "S"),
        cg(*cli_args(good_pw), "--json", "static", "info", "S", "nogroup"),  # exit 2 path
        cg(*cli_args(ConnectOptions(tok_url, token=TOKEN)), "--json", "elastic", "ls", "S"),
        cg(*cli_args(ConnectOptions(nk_url, nkey_seed=pki.nkey_seed)), "elastic", "ls", "S"),
        cg(*cli_args(ConnectOptions(creds_url, creds=pki.creds)), "elastic", "ls", "S"),
        # success, environment
        cg("elastic", "ls", "S", env=clean_env(NATS_URL=pw_url, NATS_USER=USER,
                                               NATS_PASSWORD=PASSWORD)),
        cg("--json", "elastic", "ls", "S", env=clean_env(NATS_URL=tok_url, NATS_TOKEN=TOKEN)),
        cg("elastic", "ls", "S", env=clean_env(NATS_URL=with_url_credentials(pw_url, USER,
                                                                              PASSWORD))),
        # failures: rejected secrets, by flag, environment, URL
        cg(*cli_args(ConnectOptions(pw_url, user=USER, password=WRONG_PASSWORD)),
           "elastic", "ls", "S"),
        cg(*cli_args(ConnectOptions(pw_url, user=USER, password=WRONG_PASSWORD)),
           "--json", "elastic", "create", "S", "g", "--max-members", "2"),
        cg("elastic", "ls", "S", env=clean_env(NATS_URL=pw_url, NATS_USER=USER,
                                               NATS_PASSWORD=WRONG_PASSWORD)),
        cg("--server", with_url_credentials(pw_url, USER, WRONG_PASSWORD), "elastic", "ls", "S"),
        cg(*cli_args(ConnectOptions(tok_url, token=WRONG_TOKEN)), "elastic", "ls", "S"),
        cg("--json", "elastic", "ls", "S", env=clean_env(NATS_URL=tok_url, NATS_TOKEN=WRONG_TOKEN)),
        cg(*cli_args(ConnectOptions(nk_url, nkey_seed=pki.unknown_nkey_seed)), "elastic", "ls",
           "S"),
        # the wrong secret for the mode: a token to a user/password server and vice versa
        cg(*cli_args(ConnectOptions(pw_url, token=TOKEN)), "elastic", "ls", "S"),
        cg(*cli_args(ConnectOptions(tok_url, user=USER, password=PASSWORD)), "elastic", "ls",
           "S"),
        # a member command (it logs warnings through the root logger)
        cg(*cli_args(ConnectOptions(pw_url, user=USER, password=WRONG_PASSWORD)),
           "elastic", "consume", "S", "g", "m1", "--count", "1"),
        # unreachable, credentials in the URL and flags
        cg("--server", with_url_credentials("nats://127.0.0.1:1", USER, PASSWORD),
           "--token", TOKEN, "elastic", "ls", "S"),
    ]
    codes = [r.returncode for r in runs]
    assert codes == [0, 0, 2, 0, 0, 0, 0, 0, 0] + [1] * 11, codes
    assert_no_secret([t for r in runs for t in (r.stdout, r.stderr)], all_secrets(pki),
                     must_contain=["no elastic consumer groups on S", "[]",
                                   "authorization violation", "user/password (user 'alice')",
                                   "rejected token", "NKey seed file", "nats://***@127.0.0.1",
                                   "cannot connect to nats://***@127.0.0.1:1"])


# -------------------------------------------------------------------- library: errors and logs


async def test_library_errors_logs_and_reprs_have_no_secret(
        auth_server: Callable[[str], NatsServer], pki: PKI, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    pw_url, tok_url = auth_server("user_password").url, auth_server("token").url
    texts: list[str] = []
    good = [ConnectOptions(pw_url, user=USER, password=PASSWORD),
            ConnectOptions(with_url_credentials(pw_url, USER, PASSWORD)),
            ConnectOptions(tok_url, token=TOKEN),
            ConnectOptions(auth_server("nkey").url, nkey_seed=pki.nkey_seed),
            ConnectOptions(auth_server("creds").url, creds=pki.creds)]
    bad = [ConnectOptions(pw_url, user=USER, password=WRONG_PASSWORD),
           ConnectOptions(with_url_credentials(pw_url, USER, WRONG_PASSWORD)),
           ConnectOptions(pw_url, token=TOKEN),
           ConnectOptions(tok_url, token=WRONG_TOKEN),
           ConnectOptions(tok_url, user=USER, password=PASSWORD),
           ConnectOptions(auth_server("nkey").url, nkey_seed=pki.unknown_nkey_seed),
           ConnectOptions(auth_server("nkey").url, nkey_seed=pki.creds),  # not a seed file
           ConnectOptions(auth_server("tls").url, tls_ca=pki.other_ca.cert, user=USER,
                          password=PASSWORD),
           ConnectOptions(with_url_credentials("nats://127.0.0.1:1", USER, PASSWORD),
                          token=TOKEN)]  # unreachable
    with caplog.at_level(logging.DEBUG):
        for opts in good:
            texts.append(repr(opts))
            nc = await opts.connect()
            await nc.jetstream(timeout=5).account_info()
            await nc.close()
        for opts in bad:
            texts.append(repr(opts))
            with pytest.raises(Exception) as info:  # each has its own type
                await opts.connect()
            texts += exception_texts(info.value)
        await _reconnect_with_secret_in_url(tmp_path, pki, lambda: any(
            r.levelno == logging.WARNING and r.name == "cg_pipelines.jetstream.connect"
            for r in caplog.records))
    records = caplog.records
    texts += [caplog.text] + [logging.Formatter().format(r) for r in records]
    joined = assert_no_secret(texts, all_secrets(pki), must_contain=[
        "ConnectOptions(", "NatsAuthError", "authorization violation", "NatsTLSError",
        "NoServersError", "Traceback", "nats://***@127.0.0.1",
        "ConnectionRefusedError",  # the reconnect loop's warnings were captured
    ])
    assert any(r.levelno == logging.WARNING and r.name == "cg_pipelines.jetstream.connect"
               for r in records), joined[-2000:]


async def _reconnect_with_secret_in_url(tmp_path: Path, pki: PKI,
                                        warned: Callable[[], bool]) -> None:
    """A live connection (password in the URL) loses its server and reconnects: the reconnect
    loop's errors are logged (warnings) - they must not carry the URL's secret."""
    srv = NatsServer(tmp_path / "nats", config_text=server_config("user_password", pki))
    srv.start()
    try:
        opts = ConnectOptions(with_url_credentials(srv.url, USER, PASSWORD))
        nc = await opts.connect()
        srv.stop()
        deadline = time.monotonic() + 20
        while not warned() and time.monotonic() < deadline:  # a failed reconnect was logged
            await asyncio.sleep(0.05)
        assert warned(), "no reconnect warning"
        srv.start()
        while not nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert nc.is_connected, "did not reconnect"
        await nc.jetstream(timeout=5).account_info()
        await nc.close()
    finally:
        srv.stop()


def test_resource_repr_has_no_secret(pki: PKI) -> None:
    plain = NatsResource(servers="nats://127.0.0.1:4222", user=USER, password=PASSWORD,
                         token=TOKEN)
    env = NatsResource(servers="nats://127.0.0.1:4222", user=USER,
                       password=EnvVar("CG_TEST_NATS_PASSWORD"))
    in_url = NatsResource(servers=with_url_credentials("nats://127.0.0.1:4222", USER, PASSWORD)
                          + "," + with_url_credentials("nats://127.0.0.2:4222", TOKEN, ""))
    texts = [repr(plain), str(plain), repr(plain.connect_options()), repr(env), repr(in_url),
             str(in_url), repr(in_url.connect_options()), str(in_url.connect_options())]
    assert_no_secret(texts, all_secrets(pki), must_contain=[
        "NatsResource(", "alice", "nats://***@127.0.0.1:4222,nats://***@127.0.0.2:4222",
        "password='***'", "token='***'"])


# ----------------------------------------------------------------------------------- Dagster


def _run_records(instance: DagsterInstance, run_id: str) -> list[str]:
    """Everything Dagster stored about a run: each event (message, metadata, errors) as text
    and serialized, the run record (config, tags), the job and execution plan snapshots."""
    out: list[str] = []
    for entry in instance.all_logs(run_id):
        out += [entry.message or "", str(entry), serialize_value(entry)]
    run = instance.get_run_by_id(run_id)
    assert run is not None
    out.append(serialize_value(run))
    if run.job_snapshot_id:
        out.append(serialize_value(instance.get_job_snapshot(run.job_snapshot_id)))
    if run.execution_plan_snapshot_id:
        out.append(serialize_value(
            instance.get_execution_plan_snapshot(run.execution_plan_snapshot_id)))
    return out


def test_dagster_runs_have_no_secret(auth_server: Callable[[str], NatsServer], pki: PKI,
                                     monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    pw_url, tok_url = auth_server("user_password").url, auth_server("token").url
    cases = [  # (connection, expected success)
        (ConnectOptions(pw_url, user=USER, password=PASSWORD), True),
        (ConnectOptions(tok_url, token=TOKEN), True),
        (ConnectOptions(pw_url, user=USER, password=WRONG_PASSWORD), False),
        (ConnectOptions(tok_url, token=WRONG_TOKEN), False),
    ]
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG), DagsterInstance.ephemeral() as instance:
        for opts, ok in cases:
            res, env = resource_for(opts)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            result = materialize([nats_probe], resources={"nats": res}, instance=instance,
                                 raise_on_error=False)
            assert result.success is ok
            texts += [str(e) for e in result.all_events] + _run_records(instance,
                                                                          result.run_id)
        # the project's own Definitions resource, from the environment
        monkeypatch.setenv("NATS_URL", pw_url)
        monkeypatch.setenv("NATS_USER", USER)
        monkeypatch.setenv("NATS_PASSWORD", PASSWORD)
        nats_res = build_resources()["nats"]
        result = materialize([nats_probe], resources={"nats": nats_res}, instance=instance)
        assert result.success
        texts += [str(e) for e in result.all_events] + _run_records(instance, result.run_id)
    captured = capfd.readouterr()
    texts += [caplog.text, captured.out, captured.err]
    assert_no_secret(texts, all_secrets(pki), must_contain=[
        "connected to NATS with user/password (user 'alice')", "connected to NATS with token",
        "NatsResource(", "authorization violation", "NatsAuthError", "STEP_FAILURE",
        "CG_TEST_NATS_PASSWORD", "CG_TEST_NATS_TOKEN",  # EnvVar names in the snapshots
    ])


def test_definitions_read_secrets_through_envvar(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"NATS_URL": "nats://app:url-SECRET-789@127.0.0.1:4222", "NATS_USER": USER,
           "NATS_PASSWORD": PASSWORD, "NATS_TOKEN": TOKEN, "NATS_NKEY": "/run/secrets/user.nk",
           "NATS_CREDS": "/run/secrets/user.creds", "NATS_CA": "/etc/ca.pem",
           "NATS_CERT": "/etc/client.pem", "NATS_KEY": "/run/secrets/client-key.pem"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = build_resources()["nats"]
    assert isinstance(res, NatsResource)
    as_env = {"servers": "NATS_URL", "password": "NATS_PASSWORD", "token": "NATS_TOKEN",
              "nkey_seed_file": "NATS_NKEY", "creds_file": "NATS_CREDS", "tls_key": "NATS_KEY"}
    for name, var in as_env.items():
        value = getattr(res, name)
        assert isinstance(value, EnvVar), (name, type(value))
        assert value.env_var_name == var
    assert (res.user, res.tls_ca, res.tls_cert) == (USER, "/etc/ca.pem", "/etc/client.pem")
    # and nothing of the secret values is stored in the resource
    stored = [v.env_var_name if isinstance(v, EnvVar) else repr(v) for v in res.__dict__.values()]
    assert_no_secret([repr(res), *stored], [PASSWORD, TOKEN, "url-SECRET-789"],
                     must_contain=["NATS_PASSWORD", "NATS_TOKEN"])
    # unset secrets stay unset (None), not empty EnvVars
    for k in ("NATS_PASSWORD", "NATS_TOKEN", "NATS_NKEY", "NATS_CREDS", "NATS_KEY", "NATS_URL"):
        monkeypatch.delenv(k)
    bare = build_resources()["nats"]
    assert (bare.password, bare.token, bare.nkey_seed_file, bare.creds_file) == (None,) * 4
    assert bare.servers == "nats://127.0.0.1:4222"
