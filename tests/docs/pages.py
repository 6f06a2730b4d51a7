"""Runs a documentation page as a reader would, from a fresh install of the built wheel.

A :class:`Page` plays a markdown page's fenced blocks in page order in a new directory, with a
new virtual environment of its own (nothing of this repository's venv or source is on its
paths): every ``pip install`` line of the page runs in that venv with ``cg-pipelines``
replaced by the wheel ``pip wheel`` built from this checkout, so what a reader's install
brings is what the page's commands get.

The page's rules (checked here):

- A Python block whose first line is ``# <path>.py`` (or ``# <path>.py: what it is``) is saved
  under that path, relative to the current directory; a command of the page must use it
  (``python <name>.py``, ``dagster ... -f <name>.py``, or a ``dg``/``python`` command that
  imports it from a project). Any other Python block runs where it stands.
- ``bash`` blocks run line by line (``\\`` continuations joined), each command as written
  with the venv's ``bin`` first on ``PATH``, except:

  - ``cg dev &``: the test's own nats-server (a free port, so runs never collide on 4222)
    stands in for it, and ``export NATS_URL=...`` is set to that server's URL;
  - ``dg dev`` / ``dagster dev``: started, waited for until its web server answers HTTP on
    its port (``--port``, default 3000), then stopped with its whole process group;
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
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.dagster_dev import stop_process_group

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")
SAVED = re.compile(r"# ([\w./-]+\.py)(:|$)")
RUNNABLE = ("cg", "dagster", "dg", "create-dagster", "python", "pip", "mkdir")
SERVERS = (["dg", "dev"], ["dagster", "dev"])
CONSTRAINTS_VAR = "CG_DOCS_PIP_CONSTRAINTS"
WHEEL_VAR = "CG_DOCS_WHEEL"
COMMAND_TIMEOUT_S = 600.0
SERVE_TIMEOUT_S = 180.0


def blocks(page: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown page: ``(language, text)`` in page order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


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


class Page:
    """Plays one page in ``cwd`` with the venv whose ``bin`` is given, against the nats-server
    at ``url``; ``wheel`` replaces ``cg-pipelines`` in the page's ``pip install`` lines."""

    def __init__(self, cwd: Path, url: str, wheel: Path, bin_dir: Path) -> None:
        self.cwd, self.url, self.wheel, self.bin = cwd, url, wheel, bin_dir
        self.saved: set[str] = set()
        self.words: set[str] = set()
        self.outputs: list[str] = []
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        home = cwd / ".dagster-test-home"  # the environment's, unless the page sets its own
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        self.env = {**env, "PATH": f"{bin_dir}:{env['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent),
                    "NATS_URL": url, "DAGSTER_HOME": str(home),
                    "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0"}

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
                self.env[name] = self.url if name == "NATS_URL" else self._expand(value)
            return
        assert words[0] in RUNNABLE, f"unexpected command: {shlex.join(words)}"
        words = [self._expand(w) for w in words]
        if words[0] == "pip":
            words = self._pip(words)
        self.words.update(words[1:])
        if words[:2] in SERVERS:
            self._serve(words)
            return
        t0 = time.monotonic()
        proc = subprocess.run(words, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        print(f"{time.monotonic() - t0:6.1f} s  {shlex.join(words)}")
        assert proc.returncode == 0, f"{shlex.join(words)} failed:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
        self.outputs.append(proc.stdout)

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

    # -- the page ---------------------------------------------------------------------------

    def play(self, page: Path) -> str:
        """Every block of the page in order; returns the commands' standard output."""
        for i, (lang, text) in enumerate(blocks(page)):
            if lang == "python":
                named = SAVED.match(text.splitlines()[0])
                name = named.group(1) if named else f"block{i}.py"
                path = self.cwd / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                if named:
                    self.saved.add(name)
                else:
                    self.run(["python", name])
            elif lang == "bash":
                for words in commands(text):
                    self.run(words)
        unused = {name for name in self.saved if not _used(name, self.words)}
        assert not unused, f"{page.name}: Python blocks no command uses: {sorted(unused)}"
        return "".join(self.outputs)


def _used(name: str, words: set[str]) -> bool:
    """Whether a saved file is named by a command: as a path (``python publish.py``) or as a
    module (``--processor orders_project.transforms:totals`` names
    ``src/orders_project/transforms.py``)."""
    module = name.removeprefix("src/").removesuffix(".py").replace("/", ".")
    return name in words or any(w.split(":")[0] == module for w in words)

