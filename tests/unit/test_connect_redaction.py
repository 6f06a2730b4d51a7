"""Redaction of credentials in connection errors (issue 16): URL credentials are removed where
they stand, never by searching the text for the user name, and no text around them changes."""

from __future__ import annotations

import pytest

from cg_pipelines.jetstream.connect import (
    MIN_SCRUBBED_SECRET_LEN,
    ConnectOptions,
    NatsAuthError,
    redact_credentials,
)

SERVER_TEXT = "nats: 'Authorization Violation' at nats://127.0.0.1:4222: a data@x"


@pytest.mark.parametrize(("url", "text", "expected"), [
    # the case: user "a" garbled "authorization violation" into "***uthoriz***tion ..."
    ("nats://a:b@127.0.0.1:4222", "authorization violation at nats://a:b@127.0.0.1:4222",
     "authorization violation at nats://***@127.0.0.1:4222"),
    ("nats://a@127.0.0.1:4222", SERVER_TEXT + " nats://a@127.0.0.1:4222",
     SERVER_TEXT + " nats://***@127.0.0.1:4222"),
    # the userinfo as nats-py may print it, without the scheme
    ("nats://a:b@h:4222", "connect to a:b@h:4222 failed: a b", "connect to ***@h:4222 failed: a b"),
    # an unescaped "@" in the password: the whole userinfo goes
    ("nats://u:p@ss@h:4222", "nats://u:p@ss@h:4222 and u:p@ss@h", "nats://***@h:4222 and ***@h"),
    # credentials in another URL in the text (not ours) are removed too
    ("nats://h:4222", "redirected to tls://other:pw@h2:4443 by nats://h:4222",
     "redirected to tls://***@h2:4443 by nats://h:4222"),
])
def test_url_credentials_are_redacted_where_they_stand(url: str, text: str,
                                                       expected: str) -> None:
    assert ConnectOptions(url).scrub(text) == expected
    assert redact_credentials(text, [url]) == expected


def test_user_name_never_garbles_text() -> None:
    for user in ("a", "at", "nats", "127", "t"):
        opts = ConnectOptions(f"nats://{user}:pw@127.0.0.1:4222")
        assert opts.scrub(SERVER_TEXT) == SERVER_TEXT
        assert opts.display_servers == "nats://***@127.0.0.1:4222"


def test_separate_password_and_token_are_replaced_whole_and_only_when_long() -> None:
    secret = "s3cr3t-PASSWORD-xyz"
    opts = ConnectOptions("nats://127.0.0.1:4222", user="a", password=secret)
    assert opts.scrub(f"bad {secret}, {secret}2 '{secret}'") == (
        f"bad ***, {secret}2 '***'")  # a longer word that contains it is not the secret
    # Short values are ordinary words: never searched for (and never echoed by this module).
    short = "nats"
    assert len(short) < MIN_SCRUBBED_SECRET_LEN
    opts = ConnectOptions("nats://127.0.0.1:4222", token=short)
    assert opts.scrub(SERVER_TEXT) == SERVER_TEXT
    # A URL user name without a password is a token to nats-py: replaced like one.
    tok = "tok-SECRET-123"
    opts = ConnectOptions(f"nats://{tok}@127.0.0.1:4222")
    assert opts.scrub(f"token {tok} rejected") == "token *** rejected"


def test_typed_error_names_user_and_keeps_its_words() -> None:
    """The typed error is built from secret-free parts: a password that is a word of the
    message ("password") does not turn it into "user/***"."""
    opts = ConnectOptions("nats://a:password@127.0.0.1:4222,nats://127.0.0.2:4222",
                          user="a", password="password")
    err = opts._explain(Exception("nats: 'Authorization Violation'"))
    assert isinstance(err, NatsAuthError)
    assert str(err) == (
        "authorization violation at nats://***@127.0.0.1:4222,nats://127.0.0.2:4222: the server "
        "rejected user/password (user 'a'); check the user and password "
        "(NATS_USER / NATS_PASSWORD)")
    assert "password" not in err.server and "***" in repr(opts)
