"""``python -m cg_pipelines.cli``: the same as the ``cg`` command."""

from cg_pipelines.cli import main

main()
