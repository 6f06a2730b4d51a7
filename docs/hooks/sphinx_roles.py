"""MkDocs hook: the docstrings' Sphinx roles (``:class:`~a.b.C```, ``:func:`f```) shown as
code, not as raw role text, in the API reference that mkdocstrings renders.

mkdocstrings renders ``:class:`~a.b.C``` as ``:class:<code>~a.b.C</code>``; this hook keeps
``<code>C</code>`` (the last name for ``~``, the whole path otherwise), as Sphinx would.
"""

from __future__ import annotations

import re
from typing import Any

# (a role that opens a docstring section's paragraph may have lost its first colon)
ROLE = re.compile(r"(?::|(?<=<p>))(?:class|func|meth|attr|data|mod|exc|obj|py:\w+):"
                  r"<code>(~?)([^<]*)</code>")


def shorten(match: re.Match[str]) -> str:
    """The role's target as ``<code>``, shortened to its last name after ``~``."""
    tilde, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite the page's Sphinx roles (MkDocs ``on_page_content`` event)."""
    return ROLE.sub(shorten, html)
