"""MkDocs hooks of the lonnymq site.

- ``<!-- lonnymq-help: policy set -->`` in a page becomes the live ``lonnymq policy set
  --help``, so the CLI reference cannot drift from the command. A subcommand the command has
  and the page does not render is a warning (a failed ``mkdocs build --strict``).
- Docstrings use reST roles (``:class:`Queue```), which Markdown renders as text: they become
  plain code spans.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from typing import Any

log = logging.getLogger("mkdocs.hooks.lonnymq")

HELP_MARKER = re.compile(r"<!-- lonnymq-help: ([a-z -]*?) -->")
ROLE = re.compile(r":(?:class|meth|mod|func|attr|exc|data|obj):<code>(~?)([\w.]*?)(\w+)</code>")
# A subcommand list in a usage line: "{set,clear,show} ..." (a choice of values has no "...").
SUBCOMMANDS = re.compile(r"\{([a-z,-]+)\}\s+\.\.\.")


def _help(words: list[str]) -> str:
    """What ``lonnymq WORDS --help`` prints, with no ``LONNYMQ_*`` variable set (they change
    the defaults shown) and a fixed width."""
    from lonnymq.cli import main

    saved = {k: v for k, v in os.environ.items() if k.startswith("LONNYMQ_")}
    width = os.environ.get("COLUMNS")
    for name in saved:
        del os.environ[name]
    os.environ["COLUMNS"] = "100"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*words, "--help"])
    finally:
        os.environ.update(saved)
        if width is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = width
    return out.getvalue().rstrip()


def _commands(words: list[str]) -> list[list[str]]:
    """Every command under ``lonnymq WORDS``, found in the ``{a,b,c}`` lists of the help."""
    names = dict.fromkeys(n for c in SUBCOMMANDS.findall(_help(words)) for n in c.split(","))
    found = [words]
    for name in names:
        found += _commands([*words, name])
    return found


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    markers = HELP_MARKER.findall(markdown)
    if not markers:
        return markdown
    shown = {m.strip() for m in markers}
    for words in _commands([]):
        name = " ".join(words)
        if name not in shown:
            log.warning("%s: no help shown for 'lonnymq %s'", page.file.src_path, name)

    def render(match: re.Match[str]) -> str:
        words = match.group(1).split()
        command = " ".join(["lonnymq", *words, "--help"])
        return f"```text\n$ {command}\n{_help(words)}\n```"

    return HELP_MARKER.sub(render, markdown)


def on_page_content(html: str, **_: Any) -> str:
    def plain(match: re.Match[str]) -> str:
        tilde, path, name = match.groups()
        return f"<code>{name if tilde else path + name}</code>"

    return ROLE.sub(plain, html)
