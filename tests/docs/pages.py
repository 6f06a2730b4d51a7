"""Runs a documentation page as a reader would, from a fresh install of the built wheel.

A :class:`Page` plays a markdown page's fenced blocks in page order in a new directory, with a
new virtual environment of its own (nothing of this repository's venv or source is on its
paths): every ``pip install`` line of the page runs in that venv with ``cg-pipelines``
replaced by the wheel ``pip wheel`` built from this checkout, so what a reader's install
brings is what the page's commands get.

The page's rules (checked here):

- A block fenced with a title (```` ```bash title="..." ````, shown above the block on the
  site) is a fragment to read, not to run: a production setting, a piece of a file, a cron
  job; its title says so. Every other ``python`` and ``bash`` block runs.
- A Python block whose first line is ``# <path>.py`` (or ``# <path>.py: what it is``) is saved
  under that path, relative to the current directory; a command of the page must use it
  (``python <name>.py``, ``dagster ... -f <name>.py``, or a ``dg``/``python`` command that
  imports it from a project), or an ``export`` must name its folder (``export
  AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags`` uses ``# dags/<name>.py``). Any other Python block
  runs where it stands.
- ``bash`` blocks run line by line (``\\`` continuations joined), each command as written
  with the venv's ``bin`` first on ``PATH``, except:

  - ``cg dev &``: the test's own nats-server (a free port, so runs never collide on 4222)
    stands in for it, and ``export NATS_URL=...`` is set to that server's URL;
  - ``dg dev`` / ``dagster dev``: started, waited for until its web server answers HTTP on
    its port (``--port``, default 3000), then stopped with its whole process group;
  - any other command ending with ``&`` (``airflow standalone > airflow.log 2>&1 &``): started
    in the background in a process group of its own, its output to the file it is redirected
    to (else ``.<command>-<subcommand>.log``); ``airflow standalone`` / ``airflow api-server``
    is waited for until ``GET /api/v2/monitor/health`` answers 200 (at most
    :data:`AIRFLOW_START_TIMEOUT_S`). Background commands run until the page's end, then
    their process groups get SIGTERM, and SIGKILL after :data:`STOP_TIMEOUT_S`. A command
    that fails or times out while they run fails with the tails of their logs and of the
    newest task log under ``$AIRFLOW_HOME/logs``;
  - Airflow's ports: free ports stand in for them, so that pages and the real-Airflow tests
    running beside them (``pytest -n 2``) never collide. Every page's environment gets
    ``AIRFLOW__API__PORT`` (the api-server; 8080 by default),
    ``AIRFLOW__CORE__EXECUTION_API_SERVER_URL`` on that port (what tasks call), and
    ``AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT`` / ``TRIGGER_LOG_SERVER_PORT`` (8793 and 8794 by
    default); a page's ``export AIRFLOW__API__BASE_URL=http://127.0.0.1:8080`` gets the free
    API port in place of its own, and an ``export`` of one of those port settings is
    ignored;
  - ``cd``, ``export`` (``$VAR`` expanded) and ``mkdir`` change this runner's state;
  - the README's repository commands (``bash scripts/setup.sh ...``) are CI's own.

``CG_DOCS_PIP_CONSTRAINTS`` (a constraints file) is added to every ``pip install`` when set,
and ``CG_DOCS_WHEEL`` names a wheel already built: ``scripts/stack_matrix.sh`` uses them to run
the README's example at the oldest allowed versions.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cg_pipelines.local.spawn import with_default_signals
from tests.support.dagster_dev import free_port, stop_process_group

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.M | re.S)
VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")
SAVED = re.compile(r"# ([\w./-]+\.py)(:|$)")
RUNNABLE = ("cg", "dagster", "dg", "create-dagster", "python", "pip", "mkdir", "airflow")
SERVERS = (["dg", "dev"], ["dagster", "dev"])
AIRFLOW_SERVERS = (["airflow", "standalone"], ["airflow", "api-server"])
AIRFLOW_PORTS = ("AIRFLOW__API__PORT", "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
                 "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT")
"""Airflow's fixed listening ports (8080, 8793, 8794 by default): free ones stand in."""
CONSTRAINTS_VAR = "CG_DOCS_PIP_CONSTRAINTS"
WHEEL_VAR = "CG_DOCS_WHEEL"
COMMAND_TIMEOUT_S = 600.0
SERVE_TIMEOUT_S = 180.0
AIRFLOW_START_TIMEOUT_S = 300.0
"""Seconds ``airflow standalone`` may take until its API answers (``db migrate`` included;
50-60 on a loaded 2-core host)."""
STOP_TIMEOUT_S = 20.0
"""Seconds a background command's process group has between SIGTERM and SIGKILL."""
TAIL_CHARS = 3000


@dataclass(frozen=True)
class Fence:
    """One fenced block: its language, whether it is a titled fragment, its text."""

    lang: str
    fragment: bool
    text: str


def fences(page: Path) -> list[Fence]:
    """The fenced code blocks of a markdown page, in page order."""
    return [Fence(m.group(1), "title=" in m.group(2), m.group(3))
            for m in FENCE.finditer(page.read_text())]


def blocks(page: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown page: ``(language, text)`` in page order,
    fragments included."""
    return [(f.lang, f.text) for f in fences(page)]


def commands(bash: str) -> Iterator[list[str]]:
    """The commands of a bash block, as word lists (comments dropped, continuations joined)."""
    for line in bash.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout (``pip wheel --no-deps``, PEP 517), built into ``out``; or
    the one ``CG_DOCS_WHEEL`` names (``scripts/stack_matrix.sh``, which runs these tests
    from a copy outside the checkout)."""
    if given := os.environ.get(WHEEL_VAR):
        return Path(given)
    # from a copy of the sources: setuptools' build/ in the checkout may hold modules since
    # deleted, which a wheel built there would still ship
    src = out / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".state", "build", "dist", "*.egg-info", "__pycache__", "site"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = out.glob("cg_pipelines-*.whl")
    return wheel


def make_venv(path: Path) -> Path:
    """A new virtual environment at ``path`` (with pip); returns its ``bin`` directory."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin"


@dataclass
class Background:
    """A command of the page running in the background until the page's end."""

    words: list[str]
    proc: subprocess.Popen[bytes]
    log: Path


class Page:
    """Plays one page in ``cwd`` with the venv whose ``bin`` is given, against the nats-server
    at ``url``; ``wheel`` replaces ``cg-pipelines`` in the page's ``pip install`` lines."""

    def __init__(self, cwd: Path, url: str, wheel: Path, bin_dir: Path) -> None:
        self.cwd, self.url, self.wheel, self.bin = cwd, url, wheel, bin_dir
        self.saved: dict[str, Path] = {}
        self.words: set[str] = set()
        self.exported: set[str] = set()
        self.outputs: list[str] = []
        self.background: list[Background] = []
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        home = cwd / ".dagster-test-home"  # the environment's, unless the page sets its own
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        self.ports = {name: str(free_port()) for name in AIRFLOW_PORTS}
        api = f"http://127.0.0.1:{self.ports['AIRFLOW__API__PORT']}"
        self.env = {**env, "PATH": f"{bin_dir}:{env['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent),
                    "NATS_URL": url, "DAGSTER_HOME": str(home),
                    "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0", **self.ports,
                    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/"}

    # -- one command ------------------------------------------------------------------------

    def run(self, words: list[str]) -> None:
        """Run one command of a bash block (see the module docstring for the exceptions)."""
        if words[:2] == ["bash", "scripts/setup.sh"] or words[:2] == ["cg", "dev"]:
            return
        if words[0] == "cd":
            self.cwd = (self.cwd / words[1]).resolve()
            return
        if words[0] == "export":
            for assignment in words[1:]:
                name, _, value = assignment.partition("=")
                self.env[name] = self._exported(name, self._expand(value))
                self.exported.add(self.env[name])
            return
        assert words[0] in RUNNABLE, f"unexpected command: {shlex.join(words)}"
        words = [self._expand(w) for w in words]
        if words[0] == "pip":
            words = self._pip(words)
        self.words.update(words[1:])
        if words[:2] in SERVERS:
            self._serve(words)
            return
        if words[-1] == "&":
            self._background(words[:-1])
            return
        t0 = time.monotonic()
        try:
            proc = subprocess.run(words, cwd=self.cwd, env=self.env, capture_output=True,
                                  text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{shlex.join(words)} still running after "
                                 f"{COMMAND_TIMEOUT_S:g} s:\n{_text(e.stdout)[-TAIL_CHARS:]}\n"
                                 f"{_text(e.stderr)[-TAIL_CHARS:]}{self._tails()}") from None
        print(f"{time.monotonic() - t0:6.1f} s  {shlex.join(words)}")
        assert proc.returncode == 0, f"{shlex.join(words)} failed:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}{self._tails()}"
        self.outputs.append(proc.stdout)

    def _exported(self, name: str, value: str) -> str:
        """The value ``export NAME=value`` gets here (the test's NATS URL, free ports)."""
        if name == "NATS_URL":
            return self.url
        if name in self.ports:
            return self.ports[name]
        if name == "AIRFLOW__API__BASE_URL":
            url = urllib.parse.urlsplit(value)
            return url._replace(netloc=f"{url.hostname}:{self.ports['AIRFLOW__API__PORT']}"
                                ).geturl()
        return value

    def _expand(self, word: str) -> str:
        """``$NAME`` / ``${NAME}`` from the page's environment (``$PWD``: the current directory);
        an unset name is an error, as the page would not work."""
        def value(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2)
            if name == "PWD":
                return str(self.cwd)
            assert name in self.env, f"the page uses ${name}, which nothing set"
            return self.env[name]
        return VAR.sub(value, word)

    def _pip(self, words: list[str]) -> list[str]:
        """A page's ``pip install`` line for this venv and the built wheel."""
        out = [str(self.bin / "pip"), *words[1:]]
        for i, w in enumerate(out):
            if w == "cg-pipelines" or w.startswith("cg-pipelines["):
                out[i] = str(self.wheel) + w.removeprefix("cg-pipelines")
        if constraints := os.environ.get(CONSTRAINTS_VAR):
            out += ["-c", constraints]
        return [*out, "-q", "--disable-pip-version-check"]

    def _serve(self, words: list[str]) -> None:
        """Start a web server command, wait until it answers HTTP, stop its process group."""
        port = int(words[words.index("--port") + 1]) if "--port" in words else 3000
        log = self.cwd / f".{words[0]}-dev.log"
        t0 = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(words, cwd=self.cwd, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = None
            while status is None and proc.poll() is None and \
                    time.monotonic() - t0 < SERVE_TIMEOUT_S:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info",
                                                timeout=5) as answer:
                        status = answer.status
                except (urllib.error.URLError, OSError):
                    time.sleep(1)  # poll interval (deadline: SERVE_TIMEOUT_S)
            print(f"{time.monotonic() - t0:6.1f} s  {shlex.join(words)} (answered {status})")
            assert status == 200, f"{shlex.join(words)} did not answer on port {port}:\n" \
                                  f"{log.read_text(errors='replace')[-3000:]}"
        finally:
            stop_process_group(proc, timeout_s=20.0)

    def _background(self, words: list[str]) -> None:
        """Start ``words`` (``> FILE 2>&1`` redirects its output) in a process group of its
        own, kept until the page's end; an Airflow server is waited for until its API
        answers."""
        words = [w for w in words if w != "2>&1"]
        if ">" in words:
            i = words.index(">")
            words, log = words[:i] + words[i + 2:], self.cwd / words[i + 1]
        else:
            log = self.cwd / f".{'-'.join(words[:2])}.log"
        t0 = time.monotonic()
        with open(log, "ab") as out:  # the child keeps its own copy
            proc = subprocess.Popen(with_default_signals(words), cwd=self.cwd, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.background.append(Background(words, proc, log))
        if words[:2] not in AIRFLOW_SERVERS:
            return
        health = f"http://127.0.0.1:{self.env['AIRFLOW__API__PORT']}/api/v2/monitor/health"
        status = None
        while status is None and proc.poll() is None and \
                time.monotonic() - t0 < AIRFLOW_START_TIMEOUT_S:
            try:
                with urllib.request.urlopen(health, timeout=5) as answer:
                    status = answer.status
            except (urllib.error.URLError, OSError):
                time.sleep(1)  # poll interval (deadline: AIRFLOW_START_TIMEOUT_S)
        print(f"{time.monotonic() - t0:6.1f} s  {shlex.join(words)} (answered {status})")
        assert status == 200, f"{shlex.join(words)}: {health} did not answer (exit code " \
                              f"{proc.poll()}){self._tails()}"

    def _tails(self) -> str:
        """The ends of the background commands' logs and of the newest Airflow task log."""
        out = [f"\n--- {b.log.name} ({shlex.join(b.words)})\n"
               f"{b.log.read_text(errors='replace')[-TAIL_CHARS:]}"
               for b in self.background if b.log.exists()]
        home = self.env.get("AIRFLOW_HOME")
        logs = sorted((Path(home) / "logs").glob("dag_id=*/**/*.log"),
                      key=lambda p: p.stat().st_mtime) if home else []
        if logs:
            out.append(f"\n--- {logs[-1]}\n{logs[-1].read_text(errors='replace')[-TAIL_CHARS:]}")
        return "".join(out)

    def stop(self) -> None:
        """Stop the background commands: SIGTERM to each process group, SIGKILL after
        :data:`STOP_TIMEOUT_S`."""
        while self.background:
            stop_process_group(self.background.pop().proc, timeout_s=STOP_TIMEOUT_S)

    # -- the page ---------------------------------------------------------------------------

    def play(self, page: Path) -> str:
        """Every block of the page in order (fragments excepted); returns the commands'
        standard output. Background commands are stopped at the end."""
        try:
            for i, block in enumerate(fences(page)):
                if block.fragment:
                    continue
                if block.lang == "python":
                    named = SAVED.match(block.text.splitlines()[0])
                    name = named.group(1) if named else f"block{i}.py"
                    path = self.cwd / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(block.text)
                    if named:
                        self.saved[name] = path
                    else:
                        self.run(["python", name])
                elif block.lang == "bash":
                    for words in commands(block.text):
                        self.run(words)
        finally:
            self.stop()
        unused = {name for name, path in self.saved.items()
                  if not _used(name, self.words) and str(path.parent) not in self.exported}
        assert not unused, f"{page.name}: Python blocks no command uses: {sorted(unused)}"
        return "".join(self.outputs)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _used(name: str, words: set[str]) -> bool:
    """Whether a saved file is named by a command: as a path (``python publish.py``) or as a
    module (``--processor orders_project.transforms:totals`` names
    ``src/orders_project/transforms.py``)."""
    module = name.removeprefix("src/").removesuffix(".py").replace("/", ".")
    return name in words or any(w.split(":")[0] == module for w in words)
