"""A local S3 endpoint for tests and development: moto's server mode in a thread.

``MotoS3Server`` runs moto's ``ThreadedMotoServer`` on 127.0.0.1 with a port the OS picks, in
this process (a thread, so no child process to signal). moto keeps its state in memory, in this
process, for all servers alike: use unique bucket names. Only dummy credentials are used.

Checked with moto 5.2.5: a ``PutObject`` with ``If-None-Match: *`` on an existing key answers
412 PreconditionFailed, which is what delta-rs' put-if-absent log commits rely on.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from cg_pipelines.core.errors import StateError
from cg_pipelines.sinks.delta import DeltaSink

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

__all__ = ["MotoS3Server", "DUMMY_ACCESS_KEY_ID", "DUMMY_SECRET_ACCESS_KEY", "DUMMY_REGION"]

DUMMY_ACCESS_KEY_ID: Final = "testing"
"""moto accepts any credentials; these are placeholders, never real ones."""
DUMMY_SECRET_ACCESS_KEY: Final = "testing"
DUMMY_REGION: Final = "us-east-1"


class MotoS3Server:
    """Context manager: a moto S3 server on ``127.0.0.1:<free port>``, stopped on exit.

    Example::

        with MotoS3Server() as s3:
            s3.create_bucket("tables")
            sink = DeltaSink("s3://tables/t", storage_options=s3.storage_options())
    """

    def __init__(self, *, quiet: bool = True) -> None:
        """
        Args:
            quiet: silence werkzeug's per-request log lines while the server runs.
        """
        self._quiet = quiet
        self._server: ThreadedMotoServer | None = None
        self._endpoint: str | None = None
        self._saved_level: int | None = None

    def start(self) -> MotoS3Server:
        """Start the server (port chosen by the OS, so no race for a free port).

        Raises:
            StateError: already started.
        """
        if self._server is not None:
            raise StateError("MotoS3Server already started")
        from moto.server import ThreadedMotoServer

        if self._quiet:
            wz = logging.getLogger("werkzeug")
            self._saved_level = wz.level
            wz.setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        self._server, self._endpoint = server, f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop the server and wait for its thread (idempotent)."""
        server, self._server = self._server, None
        try:
            if server is not None:
                server.stop()
        finally:
            if self._saved_level is not None:
                logging.getLogger("werkzeug").setLevel(self._saved_level)
                self._saved_level = None

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``.

        Raises:
            StateError: not started.
        """
        if self._server is None or self._endpoint is None:
            raise StateError("MotoS3Server not started")
        return self._endpoint

    def storage_options(self) -> dict[str, str]:
        """delta-rs storage options for this server (dummy credentials, plain HTTP)."""
        return DeltaSink.s3_options(
            self.endpoint_url, DUMMY_ACCESS_KEY_ID, DUMMY_SECRET_ACCESS_KEY,
            region=DUMMY_REGION, allow_http=True,
        )

    def client(self) -> Any:
        """A boto3 S3 client (``botocore.client.S3``) for this server (dummy credentials)."""
        import boto3  # type: ignore[import-untyped]  # boto3 ships no type hints (boto3-stubs: not a dependency)

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_ACCESS_KEY_ID,
            aws_secret_access_key=DUMMY_SECRET_ACCESS_KEY,
            region_name=DUMMY_REGION,
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3-63 chars, lower case; already existing is fine).

        Returns:
            ``s3://<name>``.
        """
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"
