"""The flights-weather join example (``python -m joinjob``, issue 39) and the runnable snippet
of docs/joins.md, each on a real nats-server of its own.

The job runs as a reader would run it (a subprocess, its own state directory) on the first
three days of 2013 with small batches, so keys continue from their committed rows across
batches and phases; its own verification against the pandas reference must print 0
mismatches. The verification itself is checked not to be vacuous, and the transform and the
reference are held to "the last published observation of an hour wins" on a duplicated hour.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.state import attach_state
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from flights import weather as fw
from flights.data import load_flights
from tests.support.dagster_dev import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240.0  # a loaded two-core machine; the job takes about 10 s alone


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("CG_") and k != "CG_TEST_SESSION_TOKEN"
                   or k.startswith("NATS_") and k != "NATS_SERVER_BIN")}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra}


def _run(cmd: list[str], cwd: Path, log: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run ``cmd`` in its own process group, output to ``log``; (exit status, output)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, 10.0, first=signal.SIGINT)
            rc = -1
        finally:
            stop_process_group(proc, 5.0)
    return rc, log.read_text(errors="replace")


def test_join_job_verifies_against_pandas(tmp_path: Path) -> None:
    state = tmp_path / "state"
    rc, out = _run([sys.executable, "-m", "joinjob", "--days", "3", "--batch", "50",
                    "--state-dir", str(state)], ROOT, tmp_path / "joinjob.log", _clean_env())
    assert rc == 0, out[-4000:]
    assert re.search(r"^verified: 213 rows, 0 mismatches \(flights 2,699, weather 211\)$",
                     out, re.M), out[-4000:]
    assert re.search(r"^co-partitioned set flights/hourly, weather/hourly: 8 partitions", out,
                     re.M), out
    # both directions of the join went through the committed row (an earlier batch's)
    m = re.search(r"^joined through the committed row .*: ([\d,]+) flights found their hour's "
                  r"weather there, ([\d,]+) observations found their hour's flights", out, re.M)
    assert m and all(int(g.replace(",", "")) > 0 for g in m.groups()), out
    assert re.search(r"^wall time: load [\d.]+ s, publish [\d.]+ s, runs [\d.]+ s, verify", out,
                     re.M), out

    # the verification is not vacuous: a lost row, a changed value, a duplicate are found
    table = DeltaSink(str(state / "joinjob" / "warehouse" / "flights_weather")).read()
    flights = fw.first_days(load_flights(), 3)
    weather = fw.first_days(fw.load_weather(), 3)
    want = fw.reference(flights, weather, fw.publish_plan(flights, weather).weather_order)
    assert fw.compare(table, want)[0] == 0
    assert fw.compare(table.slice(1), want)[0] == 1
    assert fw.compare(pa.concat_tables([table, table.slice(0, 1)]), want)[0] == 1
    i = table.schema.get_field_index("flights")
    assert fw.compare(table.set_column(i, "flights", pc.add(table["flights"], 1)),
                      want)[0] == table.num_rows
    assert int(pc.sum(table["flights"]).as_py()) == len(flights)
    assert int(pc.sum(table["weather_obs"]).as_py()) == len(weather)


FL_SCHEMA = pa.schema([(fw.KEY, pa.string()), ("dep_delay", pa.int64()),
                       ("arr_delay", pa.int64()), ("_seq", pa.int64())])
WX_SCHEMA = pa.schema([(fw.KEY, pa.string()), *((c, pa.float64()) for c in fw.WEATHER_COLUMNS),
                       ("_seq", pa.int64())])


def _batch(rows: list[dict[str, object]], schema: pa.Schema, committed: pa.Table | None
           ) -> pa.Table:
    """Decoded rows of one input (``_seq`` 1, 2, ...) with the key's committed row attached
    as the engine attaches it (``last_<column>``)."""
    t = pa.Table.from_pylist([{**r, "_seq": i + 1} for i, r in enumerate(rows)], schema=schema)
    return attach_state(t, committed if committed is not None else fw.STATE.empty(), fw.STATE)


def test_last_published_observation_wins_in_transform_and_reference() -> None:
    """1 a.m. on 2013-11-03 has two observations at every airport (daylight saving time
    ends). Whichever is published last wins, in the same batch or the next one, and the
    reference agrees for either publish order."""
    key = "EWR 2013-11-03 01"
    obs = [{fw.KEY: key, "temp": 50.0, "wind_speed": 5.0, "precip": 0.0, "visib": 10.0},
           {fw.KEY: key, "temp": 48.0, "wind_speed": None, "precip": 0.0, "visib": 9.0}]
    flight = [{fw.KEY: key, "dep_delay": 3, "arr_delay": None}]
    ctx = None  # the transform does not use its context
    # one batch with both observations and the flight
    one = fw.transform({fw.FLIGHTS: _batch(flight, FL_SCHEMA, None),
                        fw.WEATHER: _batch(obs, WX_SCHEMA, None)}, ctx)
    # two batches: the first observation with the flight, then the second on its own
    first = fw.transform({fw.FLIGHTS: _batch(flight, FL_SCHEMA, None),
                          fw.WEATHER: _batch(obs[:1], WX_SCHEMA, None)}, ctx)
    second = fw.transform({fw.FLIGHTS: _batch([], FL_SCHEMA, first),
                           fw.WEATHER: _batch(obs[1:], WX_SCHEMA, first)}, ctx)
    for got in (one, second):
        row = got.to_pylist()[0]
        assert (row["temp"], row["wind_speed"], row["visib"]) == (48.0, None, 9.0), row
        assert (row["weather_obs"], row["flights"], row["dep_delay_sum"], row["arr_delay_n"]) \
            == (2, 1, 3, 0), row
    weather = pd.DataFrame([{"origin": "EWR", "year": 2013, "month": 11, "day": 3, "hour": 1,
                             **{c: o[c] if o[c] is not None else np.nan
                                for c in fw.WEATHER_COLUMNS}} for o in obs])
    flights = pd.DataFrame([{"origin": "EWR", "year": 2013, "month": 11, "day": 3, "hour": 1,
                             "dep_delay": 3.0, "arr_delay": np.nan}])
    for order, temp in (([0, 1], 48.0), ([1, 0], 50.0)):
        ref = fw.reference(flights, weather, np.array(order))
        assert ref.loc[0, "temp"] == temp and ref.loc[0, "weather_obs"] == 2
        assert (ref.loc[0, "flights"], ref.loc[0, "dep_delay_sum"]) == (1, 3)


def _docs_snippet() -> str:
    text = (ROOT / "docs" / "joins.md").read_text()
    blocks = re.findall(r"^```python\n(# joins_example\.py.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, "docs/joins.md: one python block starting '# joins_example.py'"
    return blocks[0]


def test_docs_join_snippet_runs_as_written(tmp_path: Path) -> None:
    """The page's snippet, as written, against a fresh nats-server; its output is the page's
    (the block after ``python joins_example.py``)."""
    (tmp_path / "joins_example.py").write_text(_docs_snippet())
    with NatsServer(tmp_path / "nats", port=0) as srv:
        rc, out = _run([sys.executable, "joins_example.py"], tmp_path, tmp_path / "out.log",
                       _clean_env(NATS_URL=srv.url))
    assert rc == 0, out[-4000:]
    text = (ROOT / "docs" / "joins.md").read_text()
    shown = re.search(r"^python joins_example\.py\n```\n\n.*?```text\n(.*?)```", text,
                      re.M | re.S)
    assert shown, "docs/joins.md shows no output after `python joins_example.py`"
    assert out.strip().splitlines()[-10:] == shown.group(1).strip().splitlines(), out


def test_docs_dagster_definitions_load(tmp_path: Path) -> None:
    """The "In Dagster" block of docs/joins.md, as written beside joins_example.py, gives the
    asset and what a group asset has: its three jobs and three sensors (issue 50)."""
    text = (ROOT / "docs" / "joins.md").read_text()
    blocks = re.findall(r"^```python\n(# joins_defs\.py.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, "docs/joins.md: one python block starting '# joins_defs.py'"
    (tmp_path / "joins_example.py").write_text(_docs_snippet())
    (tmp_path / "joins_defs.py").write_text(blocks[0])
    code = ("import joins_defs as d; r = d.defs.get_repository_def(); "
            "print(sorted(j.name for j in r.get_all_jobs() if not j.name.startswith('__')), "
            "[s.name for s in r.sensor_defs], "
            "d.defs.resolve_assets_def('auctions').partitions_def.get_partition_keys())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "NATS_URL": "nats://x:1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("['auctions_checks', 'auctions_job', 'auctions_rebuild'] "
                                  "['auctions_backlog', 'auctions_membership', "
                                  "'auctions_run_retention'] "
                                  "['join-0', 'join-1', 'join-2', 'join-3']")
