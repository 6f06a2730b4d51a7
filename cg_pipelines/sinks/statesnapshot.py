"""Per-partition state snapshots of an append-mode Delta table: each key's last row, kept
beside the table so a state read costs O(files committed since the snapshot), not O(history).

Layout: ``<table>/_cg_state/<spec>/p<partition>.parquet``, one Parquet file per consumer-group
partition and state spec (``<spec>`` is a short hash of the key and order columns). The file
holds the last row (greatest order column) of every key over the rows of the data files it
*covers*, and in its schema metadata (key ``cg.state``, JSON): ``format`` (1), the table's
``table_id`` (Delta metadata id: a table re-created at the same URI never uses an old
snapshot), ``version`` (the Delta version it was taken at, for people), ``partition``,
``key``, ``order_by``, ``columns`` and ``covered`` (the data file paths, relative to the table
root as in the Delta log). Exactness does not depend on who writes it or when: see
:mod:`cg_pipelines.core.statesnap`. Delta VACUUM never deletes it (delta-rs skips directories
whose name starts with ``_``, checked on 1.6.6), readers of the table never see it (they read
the files the log names).

Writes are atomic: a local file is written under a temporary name and renamed; an S3 object
is one PUT (visible whole or not at all). Concurrent writers overwrite each other; every
version written is exact for the files it names.

Size: one row per key of the partition (the state columns only) plus the covered file list
(the partition's live files: bounded by compaction, see :mod:`cg_pipelines.sinks.maintenance`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = ["STATE_DIR", "KeyedSnapshot", "SnapshotStore"]

STATE_DIR: Final = "_cg_state"
"""Directory under the table root holding the state snapshots."""

_META_KEY: Final = b"cg.state"
_FORMAT: Final = 1


@dataclass(frozen=True)
class KeyedSnapshot:
    """Each key's last row over the data files ``covered`` (see the module docstring)."""

    rows: pa.Table
    covered: frozenset[str]
    table_id: str
    version: int


def spec_dir(key: str, order_by: str) -> str:
    """The directory name of a state spec: ``k<hash of key and order_by>``."""
    digest = hashlib.sha256(json.dumps([key, order_by]).encode()).hexdigest()[:16]
    return f"k{digest}"


class SnapshotStore:
    """Reads and writes the snapshots of one table through a pyarrow filesystem rooted at the
    table (:func:`~cg_pipelines.sinks.storage.table_filesystem`)."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self._fs = fs

    def path(self, key: str, order_by: str, partition: int) -> str:
        """The snapshot's path relative to the table root."""
        return f"{STATE_DIR}/{spec_dir(key, order_by)}/p{int(partition)}.parquet"

    def read(self, key: str, order_by: str, columns: list[str], partition: int,
             table_id: str) -> KeyedSnapshot | None:
        """The stored snapshot, or None when there is none, it is unreadable, it belongs to
        another table (``table_id``), another spec, or lacks one of ``columns``."""
        path = self.path(key, order_by, partition)
        try:
            with self._fs.open_input_file(path) as f:
                table = pq.read_table(f)
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowInvalid):
            return None  # a torn or foreign file: the state is read from the table instead
        meta = (table.schema.metadata or {}).get(_META_KEY)
        if meta is None:
            return None
        try:
            info = json.loads(meta)
        except ValueError:
            return None
        if (info.get("format") != _FORMAT or info.get("table_id") != table_id
                or info.get("key") != key or info.get("order_by") != order_by
                or int(info.get("partition", -1)) != int(partition)
                or any(c not in table.column_names for c in columns)):
            return None
        return KeyedSnapshot(table.replace_schema_metadata(None).select(columns),
                             frozenset(info["covered"]), table_id, int(info["version"]))

    def write(self, snap: KeyedSnapshot, key: str, order_by: str, partition: int) -> None:
        """Store ``snap`` atomically (see the module docstring).

        Raises:
            OSError / pyarrow errors: the file could not be written.
        """
        path = self.path(key, order_by, partition)
        info = {"format": _FORMAT, "table_id": snap.table_id, "version": snap.version,
                "partition": int(partition), "key": key, "order_by": order_by,
                "columns": snap.rows.column_names, "covered": sorted(snap.covered)}
        table = snap.rows.replace_schema_metadata({_META_KEY: json.dumps(info).encode()})
        parent = path.rsplit("/", 1)[0]
        self._fs.create_dir(parent, recursive=True)
        if _is_local(self._fs):
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}.parquet"
            try:
                with self._fs.open_output_stream(tmp) as out:
                    pq.write_table(table, out)
                self._fs.move(tmp, path)  # rename(2): atomic
            finally:
                if self._fs.get_file_info(tmp).type != pafs.FileType.NotFound:
                    self._fs.delete_file(tmp)
        else:
            with self._fs.open_output_stream(path) as out:
                pq.write_table(table, out)

    def specs(self, partition: int) -> list[tuple[str, str, list[str]]]:
        """``(key, order_by, columns)`` of every stored snapshot of ``partition`` (from their
        Parquet footers; unreadable files are skipped)."""
        found = []
        sel = pafs.FileSelector(STATE_DIR, allow_not_found=True, recursive=True)
        for info in self._fs.get_file_info(sel):
            if info.type != pafs.FileType.File or \
                    not info.path.endswith(f"/p{int(partition)}.parquet"):
                continue
            try:
                with self._fs.open_input_file(info.path) as f:
                    meta = pq.read_schema(f).metadata or {}
                spec = json.loads(meta[_META_KEY])
                found.append((str(spec["key"]), str(spec["order_by"]),
                              [str(c) for c in spec["columns"]]))
            except (OSError, KeyError, ValueError, pa.ArrowInvalid):
                continue
        return found

    def delete_all(self) -> None:
        """Remove every snapshot of the table (they are a cache: the next reads rebuild them)."""
        if self._fs.get_file_info(STATE_DIR).type != pafs.FileType.NotFound:
            self._fs.delete_dir(STATE_DIR)


def _is_local(fs: pafs.FileSystem) -> bool:
    base = fs.base_fs if isinstance(fs, pafs.SubTreeFileSystem) else fs
    return isinstance(base, pafs.LocalFileSystem)
