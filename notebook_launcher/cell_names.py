"""A rank's traceback names a notebook cell as the notebook shows it: ``In[3]``.

Code defined in a cell runs on the ranks (a function given to a launch, a function or class
a session cell uses) with the file name the kernel compiled it under, which differs by
version and says nothing of the cell: ``<ipython-input-3-a1b2c3>`` (IPython 7 alone),
``/tmp/ipykernel_4150/1948125720.py`` (ipykernel's compiler, on every IPython it runs). The
kernel knows which cell each name is; ranks do not (under spawn and forkserver they are not
even a copy of it), so names are rewritten in the kernel, where the traceback is shown.

How the kernel knows, found by what its compiler offers rather than by its version:
IPython 8 and later answer ``format_code_name(name)`` (what their own tracebacks use);
IPython 7 does not, and there each stored cell's name is computed again with the compiler's
own ``get_code_name`` (raw cell, transformed cell, number), the latest cell first.

IPython is never imported here: the launcher runs in scripts too, where no cell exists.
"""

from __future__ import annotations

import re
import sys
from typing import Any

_FILE = re.compile(r'File "([^"\n]+)"')
_IN = re.compile(r"In\[(\d+)\]\Z")


def name_cells(traceback_text: str) -> str:
    """``traceback_text`` with each file that is a cell of this kernel named ``In[n]``."""
    shell = _shell()
    if shell is None or 'File "' not in traceback_text:
        return traceback_text
    found: dict[str, int | None] = {}

    def named(match: re.Match[str]) -> str:
        filename = match.group(1)
        if filename not in found:
            found[filename] = cell_number(shell, filename)
        number = found[filename]
        return match.group(0) if number is None else f'File "In[{number}]"'

    return _FILE.sub(named, traceback_text)


def cell_of(filename: str) -> int | None:
    """The number of this kernel's cell compiled as ``filename`` (None: not a cell, or no kernel)."""
    shell = _shell()
    return None if shell is None else cell_number(shell, filename)


def cell_number(shell: Any, filename: str) -> int | None:
    """The execution count of the cell the kernel compiled as ``filename`` (None: no cell)."""
    try:
        compiler = shell.compile
        formatted = getattr(compiler, "format_code_name", None)
        if formatted is not None:
            named = formatted(filename)
            shown = _IN.match(named[1]) if named else None
            return int(shown.group(1)) if shown else None
        history = shell.history_manager
        raw, parsed = history.input_hist_raw, history.input_hist_parsed
        for number in range(min(len(raw), len(parsed)) - 1, 0, -1):
            if compiler.get_code_name(raw[number], parsed[number], number) == filename:
                return number
    except Exception:  # a shell unlike IPython's: the file's own name is still right
        return None
    return None


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return None
    try:
        return get_ipython()
    except Exception:
        return None
