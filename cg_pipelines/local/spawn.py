"""Starting a server process from a process with threads: no Python code between fork and exec.

A ``preexec_fn`` runs Python in the forked child of a process that may have other threads
(Spark's py4j and gRPC threads, a thread pool running a transform, moto's server thread): a
lock one of them held at the fork stays held in the child, the child never reaches ``exec``
and the parent waits in ``subprocess.Popen`` forever (seen: a nats-server restarted from a
transform's thread, a CI run on a loaded machine, stuck until the test's timeout 14.5 min
later). Python's documentation says so: ``preexec_fn`` is not safe in the presence of threads.
Without one, Python starts the child with vfork/exec and runs none of its code in it.

What such a ``preexec_fn`` did is done instead by a fresh, single-threaded Python that then
``exec``\\ s the program, keeping its PID: SIGINT, SIGTERM and SIGHUP back to their default
dispositions and unblocked (an ignored or blocked signal survives ``exec``: a server started
from a shell's background job would ignore SIGINT), and, optionally, the kernel's SIGKILL when
the starting thread exits (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cg_pipelines.core.errors import UsageError

__all__ = ["with_default_signals"]

_EXEC = """\
import os, signal, sys
sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
for s in sigs:
    signal.signal(s, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, set(sigs))
if sys.argv[1] == "1" and sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def with_default_signals(argv: Sequence[str], *, die_with_parent: bool = False) -> list[str]:
    """The command line that runs ``argv`` (a program and its arguments; the program looked up
    on the ``PATH`` of the environment it is started with) with SIGINT, SIGTERM and SIGHUP at
    their default dispositions and unblocked, through this interpreter (``-S -c``: no site
    import, a few milliseconds), which ``exec``\\ s it: the started process's PID is the
    program's. ``die_with_parent``: on Linux, the kernel SIGKILLs it when the thread that
    started it exits (``PR_SET_PDEATHSIG``).

    Pass the result to :class:`subprocess.Popen` without a ``preexec_fn`` (see the module
    docstring).

    Raises:
        UsageError: ``argv`` is empty.
    """
    if not argv:
        raise UsageError("with_default_signals: argv must name a program")
    return [sys.executable, "-S", "-c", _EXEC, "1" if die_with_parent else "0", *map(str, argv)]
