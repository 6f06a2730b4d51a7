"""Warehouse resource: where Delta tables live (a local directory by default, or ``s3://``).

S3 credentials come from ``EnvVar``s; they are handed to delta-rs as storage options and never
logged (``DeltaSink`` masks them in ``repr`` and errors).
"""

from __future__ import annotations

import os

from dagster import ConfigurableResource
from pydantic import Field

from cg_pipelines.sinks.delta import DeltaSink


class WarehouseResource(ConfigurableResource):
    """Root of the Delta tables: ``<root>/<table>``."""

    root: str = Field(".state/warehouse", description="Local directory or s3://bucket/prefix.")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (e.g. MinIO, moto).")
    aws_access_key_id: str | None = Field(None, description="Use EnvVar.")
    aws_secret_access_key: str | None = Field(None, description="Use EnvVar.")
    aws_region: str = Field("us-east-1")
    allow_http: bool = Field(False, description="Allow a plain-http S3 endpoint.")

    def table_uri(self, table: str) -> str:
        """URI of ``table`` under the root (local roots are made absolute)."""
        if self.root.startswith("s3://"):
            return f"{self.root.rstrip('/')}/{table}"
        return os.path.join(os.path.abspath(self.root), table)

    def sink(self, table: str) -> DeltaSink:
        """A fenced Delta sink for ``table``."""
        options = None
        if self.root.startswith("s3://"):
            options = DeltaSink.s3_options(
                self.s3_endpoint, self.aws_access_key_id, self.aws_secret_access_key,
                region=self.aws_region, allow_http=self.allow_http)
        return DeltaSink(self.table_uri(table), storage_options=options)
