"""Small fixes to the HTML that Jupyter Book 1 produces, kept in one place.

- sphinx-thebe registers its inline configuration script each time Sphinx reads
  documents; when sphinxcontrib-bibtex makes Sphinx read a second time, every page
  declares ``const THEBE_JS_URL`` twice and the browser logs a SyntaxError. We drop
  repeated scripts from each page (same file, same attributes, same inline body; an inline script may carry a
  file name of None or "", which count as the same).
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx


def _dedupe_scripts(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    unique = []
    for js in scripts:
        attrs = getattr(js, "attributes", {}) or {}
        key = (str(getattr(js, "filename", js) or ""), tuple(sorted((k, str(v)) for k, v in attrs.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    # In place: handlers that run after this one (sphinx.ext.mathjax) append to this list.
    scripts[:] = unique


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("html-page-context", _dedupe_scripts, priority=100)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
