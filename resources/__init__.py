"""The example deployment's resources, from the environment (its composition root reads
``CG_*`` and ``NATS_*`` variables; the library never does).

``NATS_URL`` (default ``nats://127.0.0.1:4222``), secrets ``NATS_PASSWORD`` / ``NATS_TOKEN``
through ``EnvVar`` (so are ``NATS_URL``, which may embed credentials, and the paths of the
credential files ``NATS_NKEY`` (NKey seed), ``NATS_CREDS`` and ``NATS_KEY`` (TLS client key)),
``NATS_USER``, ``NATS_CA``, ``NATS_CERT``; the warehouse root from ``CG_WAREHOUSE`` (default
``<state dir>/warehouse``; ``s3://...`` with ``CG_S3_ENDPOINT`` and ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` through ``EnvVar``); served members from ``CG_MEMBERS`` (comma
separated; empty = all); the Spark master from ``CG_SPARK_MASTER`` (default ``local[2]``) or
Spark Connect from ``CG_SPARK_REMOTE``, extra Spark settings from ``CG_SPARK_CONF``
(``k=v,k=v``), the JVM class archive from ``CG_SPARK_CLASS_ARCHIVE`` (default
``<state dir>/spark/classes.jsa``, which ``scripts/setup.sh`` builds), the window in which
runs of one partition share a Spark Connect server session from ``CG_SPARK_SESSION_REUSE_S``
(seconds, default 1800; ``0``: a fresh session per run); ``CG_SPARK_KEEP=1``
keeps the SparkSession between in-process runs (the main job); ``CG_BATCH_MAX_MSGS`` sets the
first messages per batch (default 20,000; 50,000 with ``CG_SPARK_REMOTE``) and
``CG_ADAPTIVE_MAX_MSGS`` the most a batch grows to (``0``: no growing). ``CG_TABLE_FORMAT=iceberg``
makes the warehouse Apache Iceberg (:class:`~cg_pipelines.dagster.iceberg.IcebergWarehouseResource`:
data under ``CG_WAREHOUSE``, catalog ``CG_ICEBERG_CATALOG`` — a SQLAlchemy URL, default SQLite in
the warehouse) instead of Delta.
"""

from __future__ import annotations

import os

from dagster import EnvVar

from cg_pipelines.dagster import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
)


def _secret(name: str) -> EnvVar | None:
    return EnvVar(name) if os.environ.get(name) else None


def _spark_conf(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` as a dict (empty text: none)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    return {k.strip(): v.strip() for k, v in pairs}


def state_dir() -> str:
    """The example's state directory: ``$CG_STATE_DIR`` or ``.state``."""
    return os.environ.get("CG_STATE_DIR", ".state")


def class_archive() -> str:
    """The Spark JVM class archive: ``$CG_SPARK_CLASS_ARCHIVE`` or
    ``<state dir>/spark/classes.jsa`` (used only if it exists)."""
    return os.environ.get("CG_SPARK_CLASS_ARCHIVE") or os.path.join(state_dir(), "spark",
                                                                     "classes.jsa")


def _iceberg_warehouse(root: str) -> object:
    from cg_pipelines.dagster.iceberg import IcebergWarehouseResource

    return IcebergWarehouseResource(
        warehouse=root, catalog_uri=_secret("CG_ICEBERG_CATALOG"),
        s3_endpoint=os.environ.get("CG_S3_ENDPOINT") or None,
        aws_access_key_id=_secret("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=_secret("AWS_SECRET_ACCESS_KEY"),
        allow_http=os.environ.get("CG_S3_ALLOW_HTTP", "") == "1")


def build_resources() -> dict[str, object]:
    """Resources from the environment (see module docstring)."""
    root = os.environ.get("CG_WAREHOUSE", os.path.join(state_dir(), "warehouse"))
    return {
        "nats": NatsResource(
            servers=_secret("NATS_URL") or "nats://127.0.0.1:4222",
            user=os.environ.get("NATS_USER") or None,
            password=_secret("NATS_PASSWORD"),
            token=_secret("NATS_TOKEN"),
            nkey_seed_file=_secret("NATS_NKEY"),
            creds_file=_secret("NATS_CREDS"),
            tls_ca=os.environ.get("NATS_CA") or None,
            tls_cert=os.environ.get("NATS_CERT") or None,
            tls_key=_secret("NATS_KEY"),
        ),
        "spark": SparkResource(master=os.environ.get("CG_SPARK_MASTER", "local[2]"),
                               remote=os.environ.get("CG_SPARK_REMOTE") or None,
                               spark_config=_spark_conf(os.environ.get("CG_SPARK_CONF", "")),
                               class_archive=class_archive(),
                               session_reuse_s=float(os.environ.get("CG_SPARK_SESSION_REUSE_S",
                                                                    "1800")),
                               stop_on_teardown=os.environ.get("CG_SPARK_KEEP", "") != "1"),
        "warehouse": _iceberg_warehouse(root) if os.environ.get(
            "CG_TABLE_FORMAT", "delta") == "iceberg" else DeltaWarehouseResource(
            root=root,
            s3_endpoint=os.environ.get("CG_S3_ENDPOINT") or None,
            aws_access_key_id=_secret("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=_secret("AWS_SECRET_ACCESS_KEY"),
            allow_http=os.environ.get("CG_S3_ALLOW_HTTP", "") == "1",
        ),
        "partition_runs": PartitionRunsResource(
            members=[m.strip() for m in os.environ.get("CG_MEMBERS", "").split(",") if m.strip()],
            batch_max_msgs=int(os.environ.get("CG_BATCH_MAX_MSGS") or (
                # a thin client pays a few Spark jobs' overhead per batch on the shared
                # server: a whole ~40k-message backlog in one batch (docs/SCALE.md)
                "50000" if os.environ.get("CG_SPARK_REMOTE") else "20000")),
            adaptive_max_msgs=int(os.environ.get("CG_ADAPTIVE_MAX_MSGS", "200000")) or None,
        ),
    }
