"""Storage options of a Delta table (local or S3): building S3 options, masking and scrubbing
secret values, and the native pyarrow filesystem reads go through.

Reads go through pyarrow datasets over a native pyarrow filesystem (local or ``S3FileSystem``),
not delta-rs' default Python filesystem handler: with that handler the interpreter sometimes
aborts at exit ("terminate called without an active exception", delta-rs issue #2184).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from cg_pipelines.core.errors import UsageError

__all__ = ["MASK", "PUBLIC_OPTIONS", "mask_options", "option_name", "s3_filesystem",
           "s3_options", "safe_uri", "scrubbed", "table_filesystem"]

#: What a secret value is shown as.
MASK: Final = "***"

#: Storage option names (lower case, without an ``aws_`` prefix) whose values are not secret
#: and may be shown in ``repr``; every other value is masked.
PUBLIC_OPTIONS: Final = frozenset(
    {
        "region", "default_region", "endpoint", "endpoint_url", "allow_http",
        "conditional_put", "virtual_hosted_style_request", "s3_express", "imdsv1_fallback",
        "unsigned_payload", "skip_signature", "checksum_algorithm", "timeout", "connect_timeout",
    }
)


def option_name(key: str) -> str:
    """``AWS_ACCESS_KEY_ID`` / ``aws_access_key_id`` / ``access_key_id`` → ``access_key_id``."""
    k = key.lower()
    return k[4:] if k.startswith("aws_") else k


def mask_options(options: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``options`` with every value not known to be public replaced by ``***``."""
    return {k: (v if option_name(k) in PUBLIC_OPTIONS else MASK) for k, v in options.items()}


def s3_options(
    endpoint_url: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    region: str = "us-east-1",
    allow_http: bool = False,
) -> dict[str, str]:
    """delta-rs storage options for S3 or an S3-compatible endpoint (moto, MinIO).

    Nothing about locking is set: delta-rs 1.x commits log entries with a conditional put
    (``If-None-Match: *``) by default, which is what makes concurrent commits safe; do NOT
    add ``AWS_S3_ALLOW_UNSAFE_RENAME`` or a locking provider.

    Args:
        endpoint_url: e.g. ``http://127.0.0.1:5000``; None for AWS itself.
        access_key_id, secret_access_key: static credentials; None to use the environment's
            (delta-rs reads ``AWS_*`` variables and instance metadata).
        region: the bucket's region.
        allow_http: required for an ``http://`` endpoint.

    Returns:
        ``{"AWS_REGION": ..., ["AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY", "AWS_ALLOW_HTTP"]}``.

    Raises:
        UsageError: an ``http://`` endpoint without ``allow_http`` (delta-rs would fail later
            with an opaque "builder error").
    """
    if endpoint_url and endpoint_url.lower().startswith("http://") and not allow_http:
        raise UsageError("an http:// endpoint needs allow_http=True")
    opts = {"AWS_REGION": region}
    if endpoint_url:
        opts["AWS_ENDPOINT_URL"] = endpoint_url
    if access_key_id:
        opts["AWS_ACCESS_KEY_ID"] = access_key_id
    if secret_access_key:
        opts["AWS_SECRET_ACCESS_KEY"] = secret_access_key
    if allow_http:
        opts["AWS_ALLOW_HTTP"] = "true"
    return opts


def s3_filesystem(options: Mapping[str, str]) -> pafs.S3FileSystem | None:
    """pyarrow's S3 filesystem for the storage ``options``, or None if some option has no
    pyarrow equivalent."""
    kw: dict[str, str | None] = {}
    names = {option_name(k): v for k, v in options.items()}
    mapping = {
        "access_key_id": "access_key", "secret_access_key": "secret_key",
        "session_token": "session_token", "token": "session_token",
        "region": "region", "default_region": "region",
    }
    for name, value in names.items():
        if name in mapping:
            kw[mapping[name]] = value
        elif name in ("endpoint", "endpoint_url"):
            ep = urlsplit(value)
            if ep.scheme:
                kw["scheme"], kw["endpoint_override"] = ep.scheme, ep.netloc + ep.path
            else:
                kw["endpoint_override"] = value
        elif name != "allow_http":
            return None
    return pafs.S3FileSystem(**kw)


def table_filesystem(uri: str, options: Mapping[str, str]) -> pafs.FileSystem | None:
    """A native pyarrow filesystem rooted at the table ``uri``, or None (delta-rs' handler) for
    URIs or storage options this sink cannot translate."""
    parts = urlsplit(uri)
    fs: pafs.FileSystem | None = None
    if parts.scheme in ("", "file"):
        path = parts.path if parts.scheme == "file" else uri
        fs = pafs.SubTreeFileSystem(os.path.abspath(path), pafs.LocalFileSystem())
    elif parts.scheme in ("s3", "s3a"):
        s3 = s3_filesystem(options)
        if s3 is not None:
            fs = pafs.SubTreeFileSystem(f"{parts.netloc}{parts.path}".rstrip("/"), s3)
    return fs


def safe_uri(uri: str) -> str:
    """The URI without any user:password part."""
    parts = urlsplit(uri)
    if parts.password or parts.username:
        host = parts.hostname or ""
        return parts._replace(netloc=f"{MASK}@{host}").geturl()
    return uri


@contextmanager
def scrubbed(options: Mapping[str, str], keep: tuple[type[BaseException], ...] = ()
             ) -> Iterator[None]:
    """Re-raise errors whose message contains a secret value of ``options``, scrubbed (the
    exception types in ``keep`` unchanged)."""
    try:
        yield
    except keep:
        raise
    except Exception as e:
        msg = str(e)
        secrets = [v for k, v in options.items()
                   if option_name(k) not in PUBLIC_OPTIONS and len(v) >= 4]
        if not any(s in msg for s in secrets):
            raise
        for s in secrets:
            msg = msg.replace(s, MASK)
        try:
            clean = type(e)(msg)
        except Exception:
            clean = RuntimeError(f"{type(e).__name__}: {msg}")
        raise clean from None
