"""The storage option keys a Delta table's object store takes, per URI scheme, and the check
that refuses a key no store reads (delta-rs passes unknown keys on and object_store ignores
them: ``AWS_REGOIN`` or ``AWS_ENDPOINT_URL_`` would be dropped silently and the table reached
through the defaults, e.g. real AWS instead of the endpoint meant).

Sources (names compared case-insensitively, as object_store parses them):

* object_store (apache/arrow-rs-object-store, ``FromStr`` of ``AmazonS3ConfigKey``,
  ``AzureConfigKey``, ``GoogleConfigKey`` and ``ClientConfigKey``): each provider's keys, and
  the HTTP client's keys bare or with the provider's prefix (``aws_``, ``azure_``,
  ``google_``).
* delta-rs (``crates/aws/src/constants.rs``, ``crates/core/src/logstore/storage``,
  ``crates/mount``): its own S3 keys (locking, DynamoDB, profiles, pools), retry
  (``max_retries``, ``retry_timeout``, ``backoff_config.*``), concurrency, certificate,
  runtime and mount keys.

A key only another provider reads is refused too (``AZURE_STORAGE_ACCOUNT_NAME`` on an
``s3://`` table). A local table takes any known key (it reads none).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from cg_pipelines.core.errors import ConfigError

__all__ = ["PROVIDER_KEYS", "SCHEME_PROVIDER", "check_storage_options", "known_keys"]

_CLIENT: Final = frozenset({
    "allow_http", "allow_invalid_certificates", "disable_system_certificates",
    "connect_timeout", "default_content_type", "http1_only", "http2_only",
    "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle",
    "http2_max_frame_size", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
    "proxy_ca_certificate", "proxy_excludes", "randomize_addresses", "read_timeout", "timeout",
    "user_agent"})
"""object_store's HTTP client keys (every provider; also with the provider's prefix)."""

_DELTA_RS: Final = frozenset({
    "max_retries", "retry_timeout", "backoff_config.init_backoff", "backoff_config.max_backoff",
    "backoff_config.base", "backoff.init_backoff", "backoff.max_backoff", "backoff.base",
    "init_backoff", "max_backoff", "base", "max_concurrency", "concurrency_limit",
    "certificate_path", "multi_threaded", "worker_threads", "thread_name", "enable_io",
    "enable_time"})
"""delta-rs' own keys for every store (retry, concurrency, certificate, runtime)."""

_S3: Final = frozenset({
    # object_store
    "aws_access_key_id", "access_key_id", "aws_secret_access_key", "secret_access_key",
    "aws_default_region", "default_region", "aws_region", "region", "aws_bucket",
    "aws_bucket_name", "bucket_name", "bucket", "aws_endpoint_url", "aws_endpoint",
    "endpoint_url", "endpoint", "aws_endpoint_url_s3", "aws_session_token", "aws_token",
    "session_token", "token", "aws_virtual_hosted_style_request",
    "virtual_hosted_style_request", "aws_s3_express", "s3_express", "aws_imdsv1_fallback",
    "imdsv1_fallback", "aws_metadata_endpoint", "metadata_endpoint", "aws_unsigned_payload",
    "unsigned_payload", "aws_checksum_algorithm", "checksum_algorithm",
    "aws_container_credentials_relative_uri", "container_credentials_relative_uri",
    "aws_container_credentials_full_uri", "container_credentials_full_uri",
    "aws_container_authorization_token_file", "container_authorization_token_file",
    "aws_web_identity_token_file", "web_identity_token_file", "aws_role_arn", "role_arn",
    "aws_role_session_name", "role_session_name", "aws_endpoint_url_sts", "endpoint_url_sts",
    "aws_skip_signature", "skip_signature", "aws_copy_if_not_exists", "copy_if_not_exists",
    "aws_conditional_put", "conditional_put", "aws_disable_tagging", "disable_tagging",
    "aws_disable_bulk_delete", "disable_bulk_delete", "aws_request_payer", "request_payer",
    "aws_server_side_encryption", "server_side_encryption", "aws_sse_kms_key_id",
    "sse_kms_key_id", "aws_sse_bucket_key_enabled", "sse_bucket_key_enabled",
    "aws_sse_customer_key_base64", "sse_customer_key_base64",
    # delta-rs (crates/aws/src/constants.rs)
    "aws_endpoint_url_dynamodb", "aws_region_dynamodb", "aws_access_key_id_dynamodb",
    "aws_secret_access_key_dynamodb", "aws_session_token_dynamodb", "aws_profile",
    "aws_s3_addressing_style", "aws_s3_locking_provider", "aws_iam_role_arn",
    "aws_s3_assume_role_arn", "aws_iam_role_session_name", "aws_s3_role_session_name",
    "aws_s3_pool_idle_timeout_seconds", "aws_sts_pool_idle_timeout_seconds",
    "aws_s3_get_internal_server_error_retries", "aws_s3_allow_unsafe_rename",
    "aws_ec2_metadata_disabled", "aws_ec2_metadata_timeout", "aws_force_credential_load",
    "delta_dynamo_table_name", "delta_dynamo_billing_mode",
    "delta_dynamo_max_elapsed_request_time"})

_AZURE: Final = frozenset({
    "azure_storage_account_key", "azure_storage_access_key", "azure_storage_master_key",
    "master_key", "account_key", "access_key", "azure_storage_account_name", "account_name",
    "azure_storage_client_id", "azure_client_id", "client_id", "azure_storage_client_secret",
    "azure_client_secret", "client_secret", "azure_storage_tenant_id",
    "azure_storage_authority_id", "azure_tenant_id", "azure_authority_id", "tenant_id",
    "authority_id", "azure_storage_authority_host", "azure_authority_host", "authority_host",
    "azure_storage_sas_key", "azure_storage_sas_token", "sas_key", "sas_token",
    "azure_storage_token", "bearer_token", "token", "azure_storage_use_emulator",
    "use_emulator", "azure_storage_endpoint", "azure_endpoint", "endpoint",
    "azure_msi_endpoint", "azure_identity_endpoint", "identity_endpoint", "msi_endpoint",
    "azure_object_id", "object_id", "azure_msi_resource_id", "msi_resource_id",
    "azure_federated_token_file", "federated_token_file", "azure_use_fabric_endpoint",
    "use_fabric_endpoint", "azure_use_azure_cli", "use_azure_cli", "azure_skip_signature",
    "skip_signature", "azure_container_name", "container_name", "azure_disable_tagging",
    "disable_tagging", "azure_fabric_token_service_url", "fabric_token_service_url",
    "azure_fabric_workload_host", "fabric_workload_host", "azure_fabric_session_token",
    "fabric_session_token", "azure_fabric_cluster_identifier", "fabric_cluster_identifier",
    "azure_credential_type", "credential_type", "azure_storage_encryption_key",
    "encryption_key"})

_GCS: Final = frozenset({
    "google_service_account", "service_account", "google_service_account_path",
    "service_account_path", "google_service_account_key", "service_account_key",
    "google_bucket", "google_bucket_name", "bucket", "bucket_name", "google_base_url",
    "base_url", "google_application_credentials", "application_credentials",
    "google_bearer_token", "bearer_token", "google_skip_signature", "skip_signature"})

_MOUNT: Final = frozenset({"allow_unsafe_rename", "mount_allow_unsafe_rename"})


def _with_client(provider: frozenset[str], prefix: str) -> frozenset[str]:
    return provider | _DELTA_RS | _CLIENT | {prefix + k for k in _CLIENT}


PROVIDER_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "s3": _with_client(_S3, "aws_"),
    "azure": _with_client(_AZURE, "azure_"),
    "gcs": _with_client(_GCS, "google_"),
    "local": _DELTA_RS | _MOUNT,
}
"""Provider -> the lower-case keys its store (object_store + delta-rs) reads."""

SCHEME_PROVIDER: Final[Mapping[str, str]] = {
    "s3": "s3", "s3a": "s3", "az": "azure", "abfs": "azure", "abfss": "azure",
    "azure": "azure", "adl": "azure", "gs": "gcs", "gcs": "gcs", "": "local",
    "file": "local"}
"""URI scheme -> provider (a scheme not listed is not checked)."""


def known_keys(uri: str) -> frozenset[str] | None:
    """The lower-case storage option keys the store of ``uri`` reads; None for a scheme this
    module does not know (e.g. ``memory://``, ``hdfs://``: not checked). A local path takes
    every known key (it reads none of a cloud's, and the same options may serve both)."""
    provider = SCHEME_PROVIDER.get(urlsplit(uri).scheme.lower())
    if provider is None:
        return None
    if provider == "local":
        return frozenset().union(*PROVIDER_KEYS.values())
    return PROVIDER_KEYS[provider]


def check_storage_options(uri: str, options: Mapping[str, str]) -> None:
    """Refuse storage options the store of table ``uri`` would ignore.

    Args:
        uri: the table root (``s3://``, ``abfss://``, ``gs://``, a local path ...).
        options: the storage options (keys in any case, ``AWS_REGION`` or ``region``).

    Raises:
        ConfigError: ``storage_options``: a key is not a string, a value is not a string,
            or a key is unknown to the store of ``uri`` (each unknown key named, with the
            nearest known key when there is one).
    """
    allowed = known_keys(uri)
    unknown: list[str] = []
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError("storage_options",
                              f"keys and values must be strings, got {key!r}: "
                              f"{type(value).__name__}")
        if allowed is not None and key.lower() not in allowed:
            near = difflib.get_close_matches(key.lower(), sorted(allowed), n=1, cutoff=0.75)
            hint = f" (did you mean {near[0].upper()}?)" if near else ""
            unknown.append(f"{key}{hint}")
    if unknown:
        scheme = urlsplit(uri).scheme or "a local path"
        raise ConfigError(
            "storage_options",
            f"unknown to the {scheme} store (its client would ignore them silently): "
            f"{', '.join(unknown)}; see cg_pipelines.core.storage_keys.PROVIDER_KEYS")
