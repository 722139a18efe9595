"""Where a thread's Python code is: the innermost line of the user's own code on its stack,
and the function that line is in, or the one it is calling.

Read from another thread with ``sys._current_frames()``: a main thread blocked inside a C++
collective (gloo's all_reduce, a barrier) or in ``time.sleep`` has let go of Python's lock
and still shows its Python frames, so a stuck rank can say where it is. A session's status
(``%distributed where``) and a launch stopped by its ``timeout=`` or the stop button both say
it this way; what counts as the user's code is theirs to tell (a session's cells; a launch's
files outside the installed libraries).

The source of a line is read only when saying it (``describe``): a launched rank sends a
:class:`Location` to the notebook, whose kernel holds the cells' source and knows their
numbers.
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import linecache
import os
import re
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Callable

_CELL_NAME = re.compile(r"In\[(\d+)\]\Z")
# Where a thread waits for its peers when its innermost Python frame is here.
_COLLECTIVES = os.sep + os.path.join("torch", "distributed") + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a thread was, as plain data that travels between processes."""

    filename: str  # the user's frame's file; the innermost frame's where no user frame was found
    lineno: int
    scope: str  # the qualified name of that frame's code ("<module>" at a cell's top level)
    user: bool  # a frame of the user's code was found
    inner: str = ""  # the innermost frame's function, when it is not the user's frame
    waiting: bool = False  # that function is torch.distributed's: waiting for the other ranks
    # The source span (line, end line, column, end column) of the instruction the user's
    # frame runs, when that frame is the innermost one: what it calls is read from there.
    call: tuple[int, int, int, int] | None = None


def cell_label(filename: str) -> str:
    """``In[5]`` (a notebook cell) -> ``cell 5``; other names as they are, without brackets."""
    found = _CELL_NAME.match(filename)
    return f"cell {found.group(1)}" if found else filename.strip("<>")


def main_thread_frame(thread_id: int) -> FrameType | None:
    """The innermost frame of thread ``thread_id`` now (None: it runs no Python code)."""
    return sys._current_frames().get(thread_id)


def locate(frame: FrameType, is_user: Callable[[str], bool]) -> Location:
    """Where the stack ending in ``frame`` is: its innermost frame of the user's code (a
    file ``is_user`` accepts), and what runs below it."""
    stack: list[FrameType] = []
    inner: FrameType | None = frame
    while inner is not None:
        stack.append(inner)
        inner = inner.f_back
    innermost = stack[0]
    user = next((f for f in stack if is_user(f.f_code.co_filename)), None)
    if user is None:  # e.g. a function of the package itself: its own file and line
        return Location(
            innermost.f_code.co_filename,
            innermost.f_lineno or 0,
            _qualname(innermost.f_code),
            user=False,
        )
    if user is innermost:
        return Location(
            user.f_code.co_filename,
            user.f_lineno or 0,
            _qualname(user.f_code),
            user=True,
            call=_call_span(user),
        )
    return Location(
        user.f_code.co_filename,
        user.f_lineno or 0,
        _qualname(user.f_code),
        user=True,
        inner=_qualname(innermost.f_code),
        waiting=_COLLECTIVES in innermost.f_code.co_filename,
    )


def describe(location: Location, place: Callable[[str, int], str] | None = None) -> str:
    """One line: ``cell 5, line 3 (in train), in all_reduce (waiting for the others)``.

    ``place`` names a file and line of the user's code (by default ``cell 5, line 3`` for a
    file named ``In[5]``, else the file's own name and line)."""
    if not location.user:
        return f"{location.filename}, line {location.lineno}, in {location.scope}"
    name = place or _cell_and_line
    line = name(location.filename, location.lineno)
    if location.scope != "<module>":
        line += f" (in {location.scope})"
    if location.inner:
        line += f", in {location.inner}"
        if location.waiting:
            line += " (waiting for the others)"
    elif location.call is not None:
        called = called_name(location.filename, location.call)
        if called:
            line += f", in {called}"
    return line


def where_line(frame: FrameType, is_user: Callable[[str], bool]) -> str:
    """``describe(locate(frame, is_user))``: for a thread of this process whose cells are
    named ``In[n]`` and held in ``linecache``."""
    return describe(locate(frame, is_user))


def outside_libraries(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not this package, not Python's own library
    nor an installed package (a notebook's cells, a script, the user's own modules)."""
    if filename.startswith("<frozen "):
        return False
    return not filename.startswith(_library_dirs())


_libraries: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
    global _libraries
    if _libraries is None:
        found = {_PACKAGE_DIR}
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            path = sysconfig.get_paths().get(key)
            if path:
                found.add(os.path.join(os.path.realpath(path), ""))
                found.add(os.path.join(path, ""))
        _libraries = tuple(sorted(found))
    return _libraries


def _cell_and_line(filename: str, lineno: int) -> str:
    return f"{cell_label(filename)}, line {lineno}"


def _qualname(code: CodeType) -> str:
    """``Class.method`` where Python says it (3.11 and later), the bare name on 3.10."""
    return getattr(code, "co_qualname", code.co_name)


def _call_span(frame: FrameType) -> tuple[int, int, int, int] | None:
    """The source span of the frame's current instruction (3.11 and later; 3.10 has none)."""
    try:
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset != frame.f_lasti:
                continue
            position = getattr(instruction, "positions", None)
            if position is None or None in (
                position.lineno,
                position.end_lineno,
                position.col_offset,
                position.end_col_offset,
            ):
                return None
            return (
                position.lineno,
                position.end_lineno,
                position.col_offset,
                position.end_col_offset,
            )
    except Exception:  # an odd instruction: say nothing rather than wrong
        return None
    return None


def called_name(filename: str, span: tuple[int, int, int, int]) -> str:
    """What the call at ``span`` of ``filename`` calls (``time.sleep``), read from the
    source; empty when that cannot be told (no source here, not a call)."""
    lineno, end_lineno, col_offset, end_col_offset = span
    try:
        lines = linecache.getlines(filename)[lineno - 1 : end_lineno]
        if not lines:
            return ""
        if len(lines) == 1:
            source = lines[0].encode()[col_offset:end_col_offset].decode()
        else:
            source = "".join(
                [
                    lines[0].encode()[col_offset:].decode(),
                    *lines[1:-1],
                    lines[-1].encode()[:end_col_offset].decode(),
                ]
            )
        call = ast.parse(source.strip(), mode="eval").body
        return ast.unparse(call.func) if isinstance(call, ast.Call) else ""
    except Exception:  # a source that changed since: say nothing rather than wrong
        return ""
