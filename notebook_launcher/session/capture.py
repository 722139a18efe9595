"""Which of the notebook's names a cell reads, and their values to send to the ranks."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

import cloudpickle

from notebook_launcher.errors import LaunchConfigError

# IPython's own names in the user namespace: never sent.
_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})


def used_names(code: str | ast.Module) -> set[str]:
    """The names the code may read before it binds them itself, at any depth.

    A name the cell assigns before reading (``gen = 5`` then ``gen``) is the cell's own, so
    the notebook's value of it need not travel (nor be picklable). Reads inside functions,
    lambdas and classes count where they are defined. Where a branch may or may not bind a
    name, a later read still counts: the notebook's value is sent when in doubt.
    """
    tree = ast.parse(code) if isinstance(code, str) else code
    reads: set[str] = set()
    _block(tree.body, set(), reads)
    return reads


def _block(body: list[ast.stmt], bound: set[str], reads: set[str]) -> None:
    for statement in body:
        _statement(statement, bound, reads)


def _branch(body: list[ast.stmt], bound: set[str], reads: set[str]) -> set[str]:
    inner = set(bound)
    _block(body, inner, reads)
    return inner


def _statement(node: ast.stmt, bound: set[str], reads: set[str]) -> None:
    if isinstance(node, ast.Assign):
        _expr(node.value, bound, reads)
        for target in node.targets:
            _bind(target, bound, reads)
    elif isinstance(node, ast.AnnAssign):
        _expr(node.annotation, bound, reads)
        if node.value is not None:
            _expr(node.value, bound, reads)
            _bind(node.target, bound, reads)
    elif isinstance(node, ast.AugAssign):
        _expr(node.value, bound, reads)
        _expr(_as_load(node.target), bound, reads)
        _bind(node.target, bound, reads)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            if alias.name != "*":
                bound.add(alias.asname or alias.name.split(".")[0])
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        for expression in _header(node):
            _expr(expression, bound, reads)
        if not isinstance(node, ast.ClassDef):
            bound.add(node.name)  # a function that calls itself reads its own new name
        reads.update(_free_reads(node, bound))
        bound.add(node.name)
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        _expr(node.iter, bound, reads)
        inner = set(bound)
        _bind(node.target, inner, reads)
        _block(node.body, inner, reads)
        _branch(node.orelse, bound, reads)
    elif isinstance(node, (ast.While, ast.If)):
        _expr(node.test, bound, reads)
        both = _branch(node.body, bound, reads) & _branch(node.orelse, bound, reads)
        if isinstance(node, ast.If):
            bound |= both
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:
            _expr(item.context_expr, bound, reads)
            if item.optional_vars is not None:
                _bind(item.optional_vars, bound, reads)
        _block(node.body, bound, reads)
    elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
        _branch(node.body + node.orelse, bound, reads)  # type: ignore[attr-defined]
        for handler in node.handlers:  # type: ignore[attr-defined]
            inner = set(bound)
            if handler.type is not None:
                _expr(handler.type, bound, reads)
            if handler.name:
                inner.add(handler.name)
            _block(handler.body, inner, reads)
        _block(node.finalbody, bound, reads)  # type: ignore[attr-defined]
    elif isinstance(node, ast.Delete):
        for target in node.targets:
            _expr(_as_load(target), bound, reads)
            if isinstance(target, ast.Name):
                bound.discard(target.id)
    else:  # expressions, return, raise, assert, match, global, ...: everything read, nothing bound
        reads.update(_free_reads(node, bound))


def _header(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[ast.expr]:
    """What a def or class statement evaluates when it runs (not its body)."""
    found: list[ast.expr] = list(node.decorator_list)
    if isinstance(node, ast.ClassDef):
        return found + list(node.bases) + [k.value for k in node.keywords]
    arguments = node.args
    found += [d for d in arguments.defaults + arguments.kw_defaults if d is not None]
    return found


def _bind(target: ast.expr, bound: set[str], reads: set[str]) -> None:
    if isinstance(target, ast.Name):
        bound.add(target.id)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            _bind(element, bound, reads)
    elif isinstance(target, ast.Starred):
        _bind(target.value, bound, reads)
    else:  # obj.attr = ..., obj[key] = ...: reads obj (and key)
        _expr(_as_load(target), bound, reads)


def _as_load(target: ast.expr) -> ast.expr:
    if isinstance(target, ast.Name):
        return ast.Name(target.id, ast.Load())
    return target


def _expr(node: ast.expr, bound: set[str], reads: set[str]) -> None:
    reads.update(_free_reads(node, bound))
    for walrus in ast.walk(node):
        if isinstance(walrus, ast.NamedExpr) and isinstance(walrus.target, ast.Name):
            bound.add(walrus.target.id)


def _free_reads(node: ast.AST, bound: set[str]) -> set[str]:
    """Names read in ``node`` that are neither bound yet nor local to a function, lambda or
    comprehension inside it."""
    local: set[str] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = inner.args
            every = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            local.update(a.arg for a in every)
        elif isinstance(inner, ast.comprehension):
            local.update(n.id for n in ast.walk(inner.target) if isinstance(n, ast.Name))
        elif (
            isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store) and _inside_scope(node)
        ):
            local.add(inner.id)
    declared_global = {n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names}
    local -= declared_global
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name)
        and isinstance(n.ctx, ast.Load)
        and n.id not in bound
        and n.id not in local
    }


def _inside_scope(node: ast.AST) -> bool:
    """Stores within a def or class body are its locals, not the cell's."""
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))


def _loaded_and_bound(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Every name read anywhere, and every name bound anywhere, in one pass."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded, bound


def notebook_values(
    code: str | ast.Module,
    user_ns: Mapping[str, Any],
    skip: set[str] | frozenset[str] = frozenset(),
    hidden: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The notebook's values of the names ``code`` reads before binding them, minus ``skip``
    (names the ranks own).

    Raises LaunchConfigError naming the variable when a value cannot travel by value.
    """
    hidden = hidden or {}
    tree = ast.parse(code) if isinstance(code, str) else code
    loaded, bound = _loaded_and_bound(tree)
    wanted = {
        name
        for name in loaded
        if name in user_ns
        and name not in skip
        and name not in _IPYTHON_NAMES
        and not name.startswith("_")
    }
    if wanted & bound:  # the order of reads and writes decides; in most cells nothing is both
        wanted &= used_names(tree)
    chosen: dict[str, Any] = {}
    for name in sorted(wanted):
        value = user_ns[name]
        if name in hidden and hidden[name] is value:
            continue  # put there by IPython or an extension, not by the user
        chosen[name] = value
    check_picklable(chosen, "the cell uses")
    return chosen


def check_picklable(values: dict[str, Any], what: str) -> bytes:
    """``values`` cloudpickled; LaunchConfigError naming the first that cannot travel.

    ``what`` starts the message: "the cell uses", "push() was given".
    """
    try:
        return cloudpickle.dumps(values)
    except Exception:
        for name, value in values.items():
            try:
                cloudpickle.dumps(value)
            except Exception as error:
                kind = type(value)
                raise LaunchConfigError(
                    f"{what} the notebook's {name!r} (a {kind.__module__}.{kind.__qualname__}), "
                    f"which cannot be sent to the ranks: {type(error).__name__}: {error}. Create it "
                    "on the ranks instead, in a %%distributed cell."
                ) from error
        raise
