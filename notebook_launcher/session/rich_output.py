"""Rich output from the ranks: ``display(...)``, IPython's HTML/Markdown/Image and matplotlib
figures, sent to the kernel as MIME bundles and shown in the cell, labelled with the rank.

On a rank, ``display`` is a builtin (as in a notebook). A rank forked from the kernel also
has the kernel's IPython, whose ``IPython.display.display`` then publishes here. Figures are
drawn by a backend of this package (``figure_backend``): ``plt.show()`` sends them, and those
still open when a cell ends are sent then, as the notebook's inline backend does. Bundles are
shown as the rank made them: the notebook's own sanitiser applies to HTML, and the rank's
label is plain text.
"""

from __future__ import annotations

import base64
import builtins
import io
import sys
from typing import Any, Callable

from notebook_launcher.after_import import after_import
from notebook_launcher.session.protocol import RichOutput

BACKEND = "module://notebook_launcher.session.figure_backend"
_REPRS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)


# The rank's side ------------------------------------------------------------------------

_send: Callable[[RichOutput], None] | None = None


def start(send: Callable[[RichOutput], None]) -> None:
    """Called once by a session rank: ``display``, IPython's display and figures go to ``send``."""
    global _send
    _send = send
    builtins.display = display  # type: ignore[attr-defined]
    shells = sys.modules.get("IPython.core.interactiveshell")
    if shells is not None and shells.InteractiveShell.initialized():
        shells.InteractiveShell.instance().display_pub = _Publisher()  # the kernel's, inherited
    else:  # a rank started afresh: without a shell, IPython's display() would print a repr
        for name in _IPYTHON_DISPLAYS:
            after_import(name, _display_here)
    import os

    os.environ["MPLBACKEND"] = BACKEND  # the kernel's inline backend cannot reach the notebook
    if "matplotlib" in sys.modules:
        import matplotlib

        matplotlib.use(BACKEND)
    for name in _NOTEBOOK_BARS:
        after_import(name, _text_bars)


# IPython's modules that define or re-export display(); a name imported from one before
# the rank started keeps IPython's own.
_IPYTHON_DISPLAYS = ("IPython.core.display_functions", "IPython.core.display", "IPython.display")


def _display_here(module: Any) -> None:
    if hasattr(module, "display"):
        module.display = display


# tqdm's modules that pick (or are) its notebook widget, which needs a frontend the rank
# has not: there a bar is drawn as text, and the kernel shows it as a bar (progress_bars).
_NOTEBOOK_BARS = ("tqdm.autonotebook", "tqdm.notebook", "tqdm.auto")


def _text_bars(module: Any) -> None:
    from tqdm import asyncio, std

    if module.__name__ == "tqdm.auto":  # tqdm.auto's bars also iterate asynchronously
        module.tqdm, module.trange = asyncio.tqdm, asyncio.trange
        return
    module.tqdm, module.trange = std.tqdm, std.trange
    if module.__name__ == "tqdm.notebook":
        module.tqdm_notebook, module.tnrange = std.tqdm, std.trange


def display(*objects: Any, **_: Any) -> None:
    """Show each object in the cell, as rich as it can be shown (the notebook's ``display``)."""
    for value in objects:
        data, metadata = bundle(value)
        publish(data, metadata)


def publish(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    if _send is not None:
        _send(RichOutput(dict(data), dict(metadata or {})))


def bundle(value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MIME bundle of ``value`` from its ``_repr_*_`` methods (IPython's protocol)."""
    figure = _figure_png(value)
    if figure is not None:
        return {"image/png": figure, "text/plain": repr(value)}, {}
    data: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    method = getattr(value, "_repr_mimebundle_", None)
    if callable(method):
        try:
            found = method(include=None, exclude=None)
        except Exception:
            found = None
        if isinstance(found, tuple):
            found, extra = found
            metadata.update(extra or {})
        if isinstance(found, dict):
            data.update(found)
    for mime, name in _REPRS:
        method = getattr(value, name, None)
        if mime in data or not callable(method):
            continue
        try:
            found = method()
        except Exception:
            continue
        if isinstance(found, tuple):
            found, extra = found
            metadata[mime] = extra
        if found is not None:
            data[mime] = found
    for mime in ("image/png", "image/jpeg"):
        if isinstance(data.get(mime), bytes):
            data[mime] = base64.b64encode(data[mime]).decode("ascii")
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(value)
        except Exception as error:
            data["text/plain"] = f"<{type(value).__name__} (repr failed: {error})>"
    return data, metadata


def flush_figures() -> None:
    """Send the figures still open and close them (at ``plt.show()`` and at each cell's end)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or _send is None:
        return
    for number in pyplot.get_fignums():
        display(pyplot.figure(number))
    pyplot.close("all")


def _figure_png(value: Any) -> str | None:
    figure_module = sys.modules.get("matplotlib.figure")
    if figure_module is None or not isinstance(value, figure_module.Figure):
        return None
    buffer = io.BytesIO()
    value.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _Publisher:
    """Stands in for the kernel's display publisher that a forked rank inherited."""

    def publish(
        self, data: dict[str, Any], metadata: dict[str, Any] | None = None, **_: Any
    ) -> None:
        publish(data, metadata)

    def clear_output(self, wait: bool = False) -> None:
        pass


# The kernel's side ----------------------------------------------------------------------


def show(rank: int, output: RichOutput) -> None:
    """In the cell: the rank's label (plain text), then the bundle as the rank sent it."""
    try:
        from IPython.display import publish_display_data
    except ImportError:  # no IPython: the text form
        print(f"[rank{rank}]: {output.data.get('text/plain', '')}")
        return
    from IPython.core.getipython import get_ipython

    if get_ipython() is None:
        print(f"[rank{rank}]: {output.data.get('text/plain', '')}")
        return
    publish_display_data({"text/plain": f"[rank{rank}]:"}, {"notebook_launcher": {"rank": rank}})
    metadata = dict(output.metadata)
    metadata["notebook_launcher"] = {"rank": rank}
    publish_display_data(output.data, metadata)
