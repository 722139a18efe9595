"""What ipywidgets offers, found by looking at its widgets, not at its version.

Colab ships ipywidgets 7.7 and Kaggle 8.1, and neither lets a user change it, so the widgets
are built from what both offer; the few places where they differ are answered here:

- the style object of an ``HTML`` widget: ``HTMLStyle`` in 8 (colours, font size), the plain
  ``DescriptionStyle`` in 7;
- the titles of a ``Tab`` or ``Accordion``: a ``titles`` tuple in 8, a ``_titles`` dictionary
  keyed by the page's index as a string in 7 (what its ``set_title`` writes, one message for
  all the pages instead of one per page).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def html_style(widgets: Any) -> Any:
    """A new style object for ``widgets.HTML``, to be shared by several of them (each style is
    a model the kernel opens and sends)."""
    return widgets.HTML.class_traits()["style"].klass()


def set_titles(container: Any, titles: Sequence[str]) -> None:
    """Give the pages of a ``Tab`` or an ``Accordion`` their titles, in one update."""
    if container.has_trait("titles"):
        container.titles = tuple(titles)
    else:
        container._titles = {str(index): title for index, title in enumerate(titles)}


def titles(container: Any) -> tuple[str, ...]:
    """The titles of a ``Tab``'s or an ``Accordion``'s pages, in page order."""
    if container.has_trait("titles"):
        return tuple(container.titles)
    shown = container._titles
    return tuple(shown.get(str(index), "") for index in range(len(container.children)))
