"""Ways of starting ranks, found by name: the registry the launcher reads.

A backend is an instance of :class:`~notebook_launcher.launcher.backends.base.Backend`:
its name (what users pass as ``backend=``), the devices its ranks run on, those for which
``backend="auto"`` picks it, and its own keyword arguments
(:class:`~notebook_launcher.launcher.backends.base.BackendOption`) with their checks. The
launcher, ``notebook_launcher()`` and the command line take all of that from here, so a
new backend is a module of its own and nothing else:

- the ones that come with notebook_launcher are the modules in ``BUILT_IN``, each
  defining ``BACKEND``; one absent from an installation (or whose module cannot be
  imported) makes a launch that asks for it refuse up front, saying why;
- a package adds one through the entry point group ``notebook_launcher.backends``
  (``name = "package.module:BACKEND"``), read on first use;
- code in the kernel (a notebook, a test) calls :func:`register`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import keyword
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from notebook_launcher import rules
from notebook_launcher.errors import LaunchConfigError, LaunchTypeError, LaunchUnsupportedError
from notebook_launcher.launcher import options
from notebook_launcher.launcher.backends.base import Backend, BackendOption
from notebook_launcher.launcher.plan_types import LaunchCall

__all__ = [
    "Backend",
    "BackendOption",
    "check_options",
    "check_supports",
    "lookup",
    "names",
    "register",
    "registered",
    "resolve",
    "unregister",
]

BUILT_IN = (
    ("local", "notebook_launcher.launcher.backends.local"),
    ("xla", "notebook_launcher.launcher.backends.xla"),
    ("ray", "notebook_launcher.launcher.backends.ray"),
)
ENTRY_POINT_GROUP = "notebook_launcher.backends"
_FALLBACK = "local"  # what backend="auto" picks where no backend claims the device
_AUTO_NOTE = " ('auto' picks by the hardware)"

_backends: dict[str, Backend] = {}
_unavailable: dict[str, str] = {}  # name -> why a launch that asks for it is refused
_loaded = False
# Held while the registry loads or changes. Reentrant: a backend's module, imported while
# loading, may itself register() (it then sees the registry as loaded so far).
_lock = threading.RLock()
_loading_thread: int | None = None  # the thread that is loading, while it does


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Make ``backend`` known by its name (``backend=backend.name``); returns it.

    LaunchConfigError where the name is taken (unless ``replace``), or where the name or
    an option name could never be passed to ``notebook_launcher()``.
    """
    with _lock:
        _load()
        _add(backend, replace=replace)
    return backend


def unregister(name: str) -> None:
    """Forget the backend called ``name`` (a no-op where none is)."""
    with _lock:
        _load()
        _backends.pop(name, None)
        _unavailable.pop(name, None)


def registered() -> Mapping[str, Backend]:
    """Every backend that can be asked for, by name, in the order they were registered."""
    _load()
    return MappingProxyType(_backends)


def names() -> tuple[str, ...]:
    """What ``backend=`` accepts: "auto", then every backend's name, installed or not."""
    _load()
    return ("auto", *_backends, *(n for n in _unavailable if n not in _backends))


def lookup(name: str) -> Backend:
    """The backend called ``name``; LaunchUnsupportedError where this installation lacks it."""
    _load()
    if name in _backends:
        return _backends[name]
    if name in _unavailable:
        raise LaunchUnsupportedError(_unavailable[name])
    raise LaunchUnsupportedError(_unknown(name))


def resolve(backend: Any, accelerator: str) -> str:
    """The name of the backend that starts the ranks: the user's choice, else (``"auto"``)
    the first one that claims the device."""
    name = options.check_choice("backend", backend, names(), _AUTO_NOTE)
    if name == "auto":
        for candidate in registered().values():
            if accelerator in candidate.chosen_by_auto_for:
                return candidate.name
        return _FALLBACK
    return name


def check_options(backend: str, given: Mapping[str, Any]) -> Mapping[str, Any]:
    """Every option of ``backend``, checked by it (None where not given).

    A keyword that is another backend's option is refused unless it is None, naming the
    backend it belongs to; one that is nobody's is refused as Python refuses an unknown
    keyword argument (LaunchTypeError is a TypeError), with the nearest known name.
    """
    owners = _option_owners()
    mine = {option.name: option for option in _options_of(backend)}
    checked: dict[str, Any] = dict.fromkeys(mine)
    for key, value in given.items():
        if key in mine:
            if value is not None:
                checked[key] = mine[key].check(value)
        elif key in owners:
            if value is not None:
                raise LaunchConfigError(_foreign_option(key, value, owners[key]))
        else:
            raise LaunchTypeError(_unexpected_keyword(key, owners))
    return MappingProxyType(checked)


def check_supports(backend: Backend, accelerator: str) -> None:
    if accelerator not in backend.accelerators:
        raise LaunchUnsupportedError(
            f"the {backend.name!r} backend cannot run ranks on {accelerator.upper()} (it runs "
            f"them on {', '.join(a.upper() for a in backend.accelerators)}). Pass hardware='cpu' "
            "to run CPU ranks on this machine."
        )


# loading -----------------------------------------------------------------------------


def _load() -> None:
    """Read the built-in backends and the installed packages' entry points, once.

    A thread that asks while another loads waits for it, and then sees every backend; the
    registry counts as loaded only once it is. A load that was interrupted (an interrupt
    while importing) is started over by the next call.
    """
    global _loaded, _loading_thread
    if _loaded:
        return
    with _lock:
        if _loaded or _loading_thread == threading.get_ident():
            return  # loaded meanwhile, or this thread's own load reached here again
        _loading_thread = threading.get_ident()
        try:
            _load_all()
            _loaded = True
        finally:
            _loading_thread = None


def _load_all() -> None:
    for name, module_name in BUILT_IN:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            _unavailable[name] = _missing(name, module_name, error)
            continue
        _add(module.BACKEND, replace=False)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            _add(loaded() if isinstance(loaded, type) else loaded, replace=False)
        except Exception as error:
            _unavailable.setdefault(
                entry.name,
                (
                    f"the backend {entry.name!r} that the package {_distribution(entry)} adds "
                    f"(entry point {entry.value!r}) could not be loaded: {type(error).__name__}: "
                    f"{error}. Reinstall that package, or pass another backend."
                ),
            )


def _add(backend: Backend, *, replace: bool) -> None:
    if not isinstance(backend, Backend):
        raise LaunchTypeError(
            f"a backend must be an instance of a subclass of notebook_launcher.launcher.backends."
            f"Backend; got {type(backend).__name__} {backend!r}."
        )
    name = backend.name
    if not isinstance(name, str) or not name or name != rules.canonical(name) or name == "auto":
        raise LaunchConfigError(
            f"a backend's name must be a lowercase word other than 'auto' (users pass it as "
            f"backend=); {type(backend).__name__} is named {name!r}."
        )
    taken = _backends.get(name)
    if taken is not None and taken is not backend and not replace:
        raise LaunchConfigError(
            f"a backend named {name!r} is registered already ({type(taken).__name__}); choose "
            "another name, or pass replace=True to put this one in its place."
        )
    for option in backend.options:
        if not option.name.isidentifier() or keyword.iskeyword(option.name):
            raise LaunchConfigError(
                f"the {name!r} backend's option {option.name!r} is not a Python identifier, so "
                "it could not be passed as a keyword argument; name it like ray_address."
            )
    _backends[name] = backend
    _unavailable.pop(name, None)


def _missing(name: str, module_name: str, error: ModuleNotFoundError) -> str:
    if error.name == module_name:
        return (
            f"the {name!r} backend is not available in this installation of notebook_launcher "
            f"(its module {module_name} is absent). Pass backend='auto' to run the ranks on "
            "this machine."
        )
    return (
        f"the {name!r} backend needs the package {error.name!r}, which is not installed: "
        f"pip install {error.name}."
    )


def _distribution(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return repr(dist.name) if dist is not None else "that declares it"


# options -----------------------------------------------------------------------------


def _options_of(name: str) -> tuple[BackendOption, ...]:
    backend = _backends.get(name)
    return backend.options if backend is not None else ()


def _option_owners() -> dict[str, list[Backend]]:
    owners: dict[str, list[Backend]] = {}
    for backend in registered().values():
        for option in backend.options:
            owners.setdefault(option.name, []).append(backend)
    return owners


def _foreign_option(key: str, value: Any, owners: list[Backend]) -> str:
    first = owners[0]
    where = first.description or f"the {first.name!r} backend's ranks"
    names = " or ".join(f"backend={b.name!r}" for b in owners)
    return (
        f"{key}={value!r} is only used with {names}; pass backend={first.name!r} to run the "
        f"ranks on {where}, or leave {key} unset."
    )


def _unexpected_keyword(key: str, owners: Mapping[str, list[Backend]]) -> str:
    # The launcher's own arguments are the call's fields: what a misspelt keyword most
    # likely meant.
    own = [field for field in LaunchCall.__dataclass_fields__ if field != "backend_options"]
    near = difflib.get_close_matches(key, [*own, *owners], n=1)
    hint = f" Did you mean {near[0]}?" if near else ""
    theirs = "; ".join(
        f"{option} (backend={', '.join(repr(b.name) for b in backends)})"
        for option, backends in owners.items()
    )
    known = f" The backends' own options are: {theirs}." if theirs else ""
    return (
        f"notebook_launcher() got an unexpected keyword argument {key!r}: it is neither one of "
        f"its arguments nor an option of a backend.{hint}{known}"
    )


def _unknown(backend: Any) -> str:
    return options.unknown_choice("backend", backend, names(), _AUTO_NOTE)
