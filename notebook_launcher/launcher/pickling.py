"""Sending the function and its arguments to ranks by value, with errors that name the culprit."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import cloudpickle

from notebook_launcher.errors import LaunchConfigError


def dump_payload(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bytes:
    """Cloudpickle ``(function, args, kwargs)``, or say which object cannot travel and why."""
    try:
        return cloudpickle.dumps((function, args, kwargs))
    except Exception as error:
        raise LaunchConfigError(_describe_unpicklable(function, args, kwargs, error)) from error


def _describe_unpicklable(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception
) -> str:
    advice = (
        "Ranks started with this start method receive everything by value. Create such "
        "objects inside the function instead, or use start_method='fork'."
    )
    for index, value in enumerate(args):
        problem = _pickle_problem(value)
        if problem:
            return (
                f"args[{index}] ({_kind(value)}) cannot be sent to the ranks: {problem}. {advice}"
            )
    for name, value in kwargs.items():
        problem = _pickle_problem(value)
        if problem:
            return f"kwargs[{name!r}] ({_kind(value)}) cannot be sent to the ranks: {problem}. {advice}"
    name = getattr(function, "__qualname__", repr(function))
    for scope, names in _referenced_names(function):
        for variable, value in names.items():
            problem = _pickle_problem(value)
            if problem:
                return (
                    f"function {name!r} uses the {scope} {variable!r} ({_kind(value)}), which "
                    f"cannot be sent to the ranks: {problem}. {advice}"
                )
    return (
        f"function {name!r} cannot be sent to the ranks: {type(error).__name__}: {error}. {advice}"
    )


def _referenced_names(function: Callable[..., Any]) -> list[tuple[str, dict[str, Any]]]:
    target = inspect.unwrap(function)
    if not inspect.isfunction(target):
        return []
    try:
        closure = inspect.getclosurevars(target)
    except (TypeError, ValueError):
        return []
    return [("closure variable", dict(closure.nonlocals)), ("global", dict(closure.globals))]


def _pickle_problem(value: Any) -> str | None:
    try:
        cloudpickle.dumps(value)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _kind(value: Any) -> str:
    kind = type(value)
    return (
        f"a {kind.__module__}.{kind.__qualname__}"
        if kind.__module__ != "builtins"
        else f"a {kind.__qualname__}"
    )
