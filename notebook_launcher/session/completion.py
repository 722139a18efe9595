"""Tab completion and Shift-Tab inspection of names that live on the ranks.

In a ``%%distributed`` cell, Jupyter's complete and inspect requests are answered from the
ranks' namespaces: the kernel asks every rank (``Complete`` / ``Describe``), and a name
only some ranks have says which. Nothing is written into the kernel's namespace. Names are
looked up by attribute access only: nothing on a rank is called to complete or describe it.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import re
from typing import Any, Callable

_DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*\.?\Z")
_TOKEN_BEFORE = re.compile(r"[A-Za-z_][\w.]*\Z")
DOC_LINES = 12  # of a docstring shown by Shift-Tab


# The rank's side ------------------------------------------------------------------------


def complete(namespace: dict[str, Any], token: str) -> list[tuple[str, str]]:
    """Completions of ``token`` (``mod``, ``model.lay``) as (text, type name), sorted; an
    object whose ``dir()`` fails offers nothing (a completion must never fail a rank)."""
    try:
        return _complete(namespace, token)
    except Exception:
        return []


def _complete(namespace: dict[str, Any], token: str) -> list[tuple[str, str]]:
    if not _DOTTED.match(token):
        return []
    base, _, prefix = token.rpartition(".")
    if base:
        found, value = _lookup(namespace, base)
        if not found:
            return []
        names = {name: _type_name(value, name) for name in dir(value)}
        start = base + "."
    else:
        names = {name: type(value).__name__ for name, value in namespace.items()}
        for name in dir(builtins):
            names.setdefault(name, "builtin")
        for word in keyword.kwlist:
            names.setdefault(word, "keyword")
        start = ""
    return sorted(
        (start + name, kind)
        for name, kind in names.items()
        if name.startswith(prefix) and (prefix.startswith("_") or not name.startswith("_"))
    )


def describe(namespace: dict[str, Any], name: str) -> str | None:
    """What Shift-Tab shows of ``name``: type, signature, docstring (None: not defined here)."""
    try:
        return _describe(namespace, name)
    except Exception:
        return None


def _describe(namespace: dict[str, Any], name: str) -> str | None:
    if not _DOTTED.match(name) or name.endswith("."):
        return None
    found, value = _lookup(namespace, name)
    if not found:
        return None
    kind = type(value)
    lines = [
        f"Type:      {kind.__module__}.{kind.__qualname__}"
        if kind.__module__ != "builtins"
        else f"Type:      {kind.__qualname__}"
    ]
    if callable(value):
        try:
            lines.append(f"Signature: {name}{inspect.signature(value)}")
        except (TypeError, ValueError):
            pass
    else:
        text = _short_repr(value)
        lines.append(f"Value:     {text}")
    doc = inspect.getdoc(value) if callable(value) or inspect.ismodule(value) else None
    if doc:
        shown = doc.splitlines()[:DOC_LINES]
        lines.append("Docstring: " + "\n".join(shown))
    return "\n".join(lines)


def _lookup(namespace: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    head, *rest = dotted.split(".")
    if head in namespace:
        value = namespace[head]
    elif hasattr(builtins, head):
        value = getattr(builtins, head)
    else:
        return False, None
    for part in rest:
        try:
            value = (
                inspect.getattr_static(value, part)
                if isinstance(value, type)
                else getattr(value, part)
            )
        except Exception:
            return False, None
    return True, value


def _type_name(owner: Any, name: str) -> str:
    try:
        return type(inspect.getattr_static(owner, name)).__name__
    except Exception:
        return ""


def _short_repr(value: Any, limit: int = 200) -> str:
    try:
        text = repr(value)
    except Exception as error:
        text = f"<repr failed: {error}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The kernel's side ----------------------------------------------------------------------


def rank_cell(full_text: str, auto: bool = False) -> bool:
    """Whether a cell's code runs on the ranks (so its names are the ranks')."""
    first = full_text.lstrip().split("\n", 1)[0]
    if first.startswith("%%distributed"):
        return True
    return auto and not first.startswith(("%%local", "%distributed", "%%"))


def merge(per_rank: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Every rank's completions in one list; a name only some ranks have says which."""
    where: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    for rank, found in enumerate(per_rank):
        for text, kind in found:
            where.setdefault(text, []).append(rank)
            kinds.setdefault(text, kind)
    world = len(per_rank)
    merged = []
    for text in sorted(where):
        ranks = where[text]
        kind = kinds[text]
        if len(ranks) < world:
            kind = (
                f"{kind}, rank {', '.join(map(str, ranks))} only"
                if kind
                else f"rank {', '.join(map(str, ranks))} only"
            )
        merged.append((text, kind))
    return merged


def install(shell: Any, session_of: Callable[[], Any], auto_of: Callable[[], bool]) -> None:
    """Answer completion and inspection in rank cells from the ranks (IPython's matcher API for
    Tab; the kernel's inspect handler for Shift-Tab, which is not given the cell otherwise)."""
    try:  # IPython 8.6 and later: a matcher is given the whole cell and can silence the others
        from IPython.core.completer import SimpleCompletion, context_matcher
    except ImportError:
        _install_plain_matcher(shell, session_of, auto_of)
    else:

        @context_matcher()  # type: ignore[untyped-decorator, unused-ignore]
        def rank_names(context: Any) -> dict[str, Any]:
            session = session_of()
            if session is None or not session.alive or not rank_cell(context.full_text, auto_of()):
                return {"completions": [], "suppress": False}
            found = _TOKEN_BEFORE.search(context.text_until_cursor)
            token = found.group(0) if found else ""
            try:
                found_on_ranks = session.complete(token)
            except Exception:  # the ranks went away meanwhile: the kernel's own completions
                return {"completions": [], "suppress": False}
            completions = [SimpleCompletion(text, type=kind) for text, kind in found_on_ranks]
            return {"completions": completions, "suppress": True, "matched_fragment": token}

        shell.Completer.custom_matchers.append(rank_names)
    _install_inspection(shell, session_of, auto_of)


def _install_plain_matcher(
    shell: Any, session_of: Callable[[], Any], auto_of: Callable[[], bool]
) -> None:
    """Tab in rank cells where IPython has only its older matcher API (IPython 7 to 8.5).

    A matcher there is given the token alone, not the cell, and cannot silence the other
    completers: the cell is remembered from the kernel's complete request, and in a rank cell
    that one request runs without jedi (whose names are the kernel's). Completions show no
    types there: a plain matcher returns text only.
    """
    completer = shell.Completer
    cell = {"text": ""}

    def rank_names(text: str) -> list[str]:
        session = session_of()
        if session is None or not session.alive or not rank_cell(cell["text"], auto_of()):
            return []
        found = _TOKEN_BEFORE.search(text)
        try:
            return [name for name, _ in session.complete(found.group(0) if found else "")]
        except Exception:  # the ranks went away meanwhile: the kernel's own completions
            return []

    completer.custom_matchers.append(rank_names)
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel.do_complete, "_from_ranks", False):
        return
    kernel_complete = kernel.do_complete

    def do_complete(code: str, cursor_pos: int | None) -> Any:
        cell["text"] = code
        session = session_of()
        on_ranks = session is not None and session.alive and rank_cell(code, auto_of())
        jedi = getattr(completer, "use_jedi", False)
        if on_ranks and jedi:
            completer.use_jedi = False
        try:
            return kernel_complete(code, cursor_pos)
        finally:
            cell["text"] = ""
            if on_ranks and jedi:
                completer.use_jedi = True

    do_complete._from_ranks = True  # type: ignore[attr-defined]
    kernel.do_complete = do_complete


def _install_inspection(
    shell: Any, session_of: Callable[[], Any], auto_of: Callable[[], bool]
) -> None:
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel.do_inspect, "_from_ranks", False):
        return
    kernel_inspect = kernel.do_inspect

    def do_inspect(
        code: str, cursor_pos: int, detail_level: int = 0, omit_sections: Any = ()
    ) -> dict[str, Any]:
        session = session_of()
        if session is None or not session.alive or not rank_cell(code, auto_of()):
            return kernel_inspect(code, cursor_pos, detail_level, omit_sections)
        from IPython.utils.tokenutil import token_at_cursor

        try:
            text = session.describe_name(token_at_cursor(code, cursor_pos))
        except Exception:  # the ranks went away meanwhile: the kernel's own answer
            return kernel_inspect(code, cursor_pos, detail_level, omit_sections)
        if text is None:
            return {"status": "ok", "found": False, "data": {}, "metadata": {}}
        return {"status": "ok", "found": True, "data": {"text/plain": text}, "metadata": {}}

    do_inspect._from_ranks = True  # type: ignore[attr-defined]
    kernel.do_inspect = do_inspect
