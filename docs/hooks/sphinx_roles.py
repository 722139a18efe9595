"""A griffe extension for the API reference: Sphinx roles in docstrings become links.

The package's docstrings follow the Google style, and some name other objects the Sphinx way
(``:class:`~notebook_launcher.errors.RankFailedError```). mkdocstrings renders Markdown, so each
such role is rewritten as a cross-reference, which mkdocs-autorefs turns into a link where the
object has a page, and plain code where it has none.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|exc|mod|data|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")


def _cross_reference(match: re.Match[str]) -> str:
    target = match["target"].strip()
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    if "." not in target:
        return f"`{shown}`"
    return f"[`{shown}`][{target}]"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_cross_reference, obj.docstring.value)
