"""``%distributed`` and ``%%distributed``: a session driven from notebook cells.

Loaded by ``%load_ext notebook_launcher``; IPython is imported only then.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import re
import shlex
import sys
import traceback
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class

from notebook_launcher.errors import LaunchConfigError, SessionError, SessionTimeoutError
from notebook_launcher.session.capture import notebook_values
from notebook_launcher.session.session import Session, current_session, set_magics_session
from notebook_launcher.session.snapshot import status_line
from notebook_launcher.session.worker import BASE_NAMES


class DistributedUsageError(LaunchConfigError, UsageError):
    """A ``%distributed`` line that cannot be understood (IPython shows it without a traceback)."""

    def _render_traceback_(self) -> list[str]:
        # IPython drops the traceback of UsageError itself only, not of its subclasses.
        return f"{type(self).__name__}: {self}".splitlines()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel's process
        raise DistributedUsageError(f"{self.prog}: {message}. Usage: {_usage(self)}")


def _usage(parser: argparse.ArgumentParser) -> str:
    return parser.format_usage().strip().removeprefix("usage: ")


@functools.cache  # building them costs about a millisecond a cell
def _parsers() -> tuple[_Parser, _Parser]:
    line = _Parser(prog="%distributed", add_help=False, allow_abbrev=False)
    commands = line.add_subparsers(dest="command", parser_class=_Parser)
    start = commands.add_parser("start", add_help=False, allow_abbrev=False)
    start.add_argument("-n", "--num-processes", type=int, default=None)
    start.add_argument("--precision", default=None)
    start.add_argument("--start-method", default=None)
    start.add_argument("--hardware", default="auto")
    push = commands.add_parser("push", add_help=False)
    push.add_argument("names", nargs="+")
    pull = commands.add_parser("pull", add_help=False)
    pull.add_argument("name")
    pull.add_argument("--rank", type=int, default=0)
    show = commands.add_parser("show", add_help=False)
    show.add_argument("names", nargs="+")
    show.add_argument("--ranks", type=int, nargs="+", default=None)
    show.add_argument("--per-rank", dest="per_rank", action="store_true")
    auto = commands.add_parser("auto", add_help=False)
    auto.add_argument("switch", choices=["on", "off"])
    debug = commands.add_parser("debug", add_help=False)
    debug.add_argument("--rank", type=int, default=None)
    for name in ("status", "where", "restart", "stop"):
        commands.add_parser(name, add_help=False)
    cell = _Parser(prog="%%distributed", add_help=False, allow_abbrev=False)
    cell.add_argument("--ranks", type=int, nargs="+", default=None)
    cell.add_argument("--return", dest="returns", nargs="+", default=[])
    cell.add_argument("--show", dest="show", nargs="+", default=[])
    cell.add_argument("--per-rank", dest="per_rank", action="store_true")
    cell.add_argument("--timeout", type=float, default=None)
    cell.add_argument(
        "--auto", action="store_true", help=argparse.SUPPRESS
    )  # put there by auto mode
    return line, cell


def _words(prog: str, line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as error:  # "No closing quotation", "No escaped character"
        raise DistributedUsageError(
            f"{prog} {line.strip()}: {error}; the line is split like a shell command line, so "
            f"close the quote or escape it. Usage: {_usage(_parsers()[0 if prog == '%distributed' else 1])}"
        ) from None


def parse_line(line: str) -> argparse.Namespace:
    parsed = _parsers()[0].parse_args(_words("%distributed", line))
    if parsed.command is None:
        raise DistributedUsageError(
            "%distributed needs a command: start, push, pull, show, status, where, debug, auto, restart "
            "or stop "
            "(e.g. %distributed start -n 2); %%distributed runs a cell on the ranks."
        )
    return parsed


def parse_cell_line(line: str) -> argparse.Namespace:
    return _parsers()[1].parse_args(_words("%%distributed", line))


# Where none of these occur, IPython's input transformations leave a cell as it is (they
# act on magics, !cmd, help?, /,; escapes, a first line's indentation and pasted prompts),
# and a cell skips them: they cost about as much as the rest of the kernel's part of a cell.
_MAYBE_IPYTHON_SYNTAX = re.compile(
    r"[%!?]|^[ \t]*[/,;]|\A\s*(>>>|In \[|\.\.\.|[ \t])", re.MULTILINE
)


def transform_cell(shell: Any, cell: str) -> str:
    """The cell after IPython's input transformations (skipped where they change nothing)."""
    if _MAYBE_IPYTHON_SYNTAX.search(cell) is None:
        return cell
    return str(shell.transform_cell(cell))


def rank_code(
    cell: str, transformed: str, filename: str, first_line: int = 2
) -> tuple[str, ast.Module]:
    """The cell as the ranks run it, checked in the kernel first; and its syntax tree.

    ``transformed`` is the cell after IPython's input transformations: plain Python passes
    unchanged (prompts and common indentation removed), while IPython syntax (magics,
    ``!cmd``, ``x?``) becomes calls to ``get_ipython()``, which ranks do not have: such a
    line is refused by name. A leading newline keeps line numbers equal to the cell's own,
    whose first line is the %%distributed line.
    """
    original, changed = cell.splitlines(), transformed.splitlines()
    if len(original) == len(changed):
        for number, (before, after) in enumerate(zip(original, changed), start=2):
            if "get_ipython()" in after and "get_ipython()" not in before:
                raise DistributedUsageError(
                    f"%%distributed: line {number} ({before.strip()}) is IPython syntax (a magic, "
                    "a shell command or help), which the ranks cannot run: they are plain Python "
                    "processes without IPython. Write it in Python on the ranks (time.perf_counter() "
                    "for %time, subprocess.run(...) for !cmd), or run it in a cell of its own."
                )
    elif "get_ipython()" in transformed and "get_ipython()" not in cell:
        raise DistributedUsageError(
            "%%distributed: the cell uses IPython syntax (a cell magic such as %%time), which the "
            "ranks cannot run: they are plain Python processes without IPython. Write it in Python "
            "on the ranks, or run it in a cell of its own."
        )
    code = "\n" * (first_line - 1) + transformed
    try:
        tree = ast.parse(code, filename, "exec")  # a SyntaxError names the cell's own line
    except SyntaxError as error:
        shown = "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
        raise DistributedUsageError(
            f"%%distributed: the cell has a syntax error, so it was not sent to the ranks:\n{shown}"
        ) from None
    return code, tree


class RankValues(list):
    """Each rank's value of a cell's last expression, shown one line per rank."""

    def __init__(self, ranks: list[int], values: list[Any]) -> None:
        super().__init__(values)
        self.ranks = ranks

    def __repr__(self) -> str:
        return "\n".join(f"[rank{rank}]: {value!r}" for rank, value in zip(self.ranks, self))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@magics_class
class DistributedMagics(Magics):
    @property
    def session(self) -> Session | None:
        """The session the cells run on; also ``Session.current()`` for code."""
        return current_session()

    @session.setter
    def session(self, session: Session | None) -> None:
        set_magics_session(session)

    auto = False  # every cell runs on the ranks (%distributed auto on)
    _transforming_body = False  # a cell's body goes through IPython's transformations again

    @cell_magic
    def local(self, line: str, cell: str) -> Any:
        """``%%local``: the cell runs in the kernel (what auto mode leaves to the kernel)."""
        result = self._shell.run_cell(cell, store_history=False)
        return None if result.error_in_exec is None else result.raise_error()

    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        if cell is None:
            return self._command(parse_line(line))
        return self._cell(parse_cell_line(line), cell)

    def _command(self, args: argparse.Namespace) -> Any:
        if args.command == "start":
            replaced = self.session is not None
            if self.session is not None:
                self.session.close()
                self.session = None
            self.session = self._hold_presses(
                Session(args.num_processes, args.precision, args.start_method, args.hardware)
            )
            print(
                f"notebook_launcher: session started: {self.session.describe()}."
                + (" The previous session was stopped." if replaced else "")
            )
            return None
        if args.command == "auto":
            self._set_auto(args.switch == "on")
            return None
        if args.command == "status":
            if self.session is None:
                print("notebook_launcher: no session; %distributed start -n 2 starts one.")
                return None
            print(f"notebook_launcher: {self.session.describe()}")
            if self.session.alive:
                print("\n".join(status_line(row) for row in self.session.status()))
            return None
        if args.command == "stop":
            if self.session is not None:
                self.session.close()
                self.session = None
                print("notebook_launcher: session stopped; its ranks are gone.")
            return None
        session = self._running()
        if args.command == "restart":
            session.restart()
        elif args.command == "push":
            missing = [n for n in args.names if n not in self._shell.user_ns]
            if missing:
                raise DistributedUsageError(
                    f"%distributed push: {', '.join(missing)} not defined in the notebook; define "
                    "it in a cell first."
                )
            session.push({n: self._shell.user_ns[n] for n in args.names})
        elif args.command == "show":
            shown = session.show(*args.names, ranks=args.ranks)
            if args.per_rank:  # the values differ by design: said in neutral words
                shown = type(shown)(shown.stages, per_rank=args.names)
            _display(shown)
        elif args.command == "debug":
            try:
                session.debug(args.rank)
            except SessionError as error:
                text = f"{type(error).__name__}: {error}"  # the message is the whole story
                setattr(error, "_render_traceback_", lambda: [text])  # noqa: B010
                raise
        elif args.command == "where":
            print("\n".join(session.where()))
        elif args.command == "pull":
            self._shell.user_ns[args.name] = session.pull(args.name, rank=args.rank)
        return None

    def _set_auto(self, on: bool) -> None:
        transforms = self._shell.input_transformers_cleanup
        if on and self._to_ranks not in transforms:
            transforms.append(self._to_ranks)  # only while on: a cell pays nothing otherwise
        elif not on and self._to_ranks in transforms:
            transforms.remove(self._to_ranks)
        self.auto = on
        print(
            "notebook_launcher: every cell now runs on the ranks; a cell that starts with %%local "
            "runs in the kernel, and %distributed auto off ends this."
            if on
            else "notebook_launcher: cells run in the kernel again; %%distributed runs one on the ranks."
        )

    def _to_ranks(self, lines: list[str]) -> list[str]:
        """IPython input transformation while auto mode is on: a cell becomes a rank cell."""
        if self._transforming_body or not lines:
            return lines
        first = lines[0].lstrip()
        if first.startswith("%%local"):
            return lines[1:]
        if (
            first.startswith(("%distributed", "%%", "%load_ext", "%reload_ext"))
            or not "".join(lines).strip()
        ):
            return lines
        return ["%%distributed --auto\n", *lines]

    @property
    def _shell(self) -> Any:
        shell = self.shell
        assert shell is not None  # magics are registered with a shell
        return shell

    def _running(self) -> Session:
        if self.session is None:
            raise DistributedUsageError(
                "no session is running; %distributed start -n 2 starts one (a %%distributed cell "
                "also starts one with the default settings)."
            )
        return self.session

    def _hold_presses(self, session: Session) -> Session:
        session.hold_interrupts = self._release_after_cell
        return session

    def _release_after_cell(self, release: Callable[[], None]) -> None:
        """Stop presses after the first are ignored until IPython has shown the cell's
        error: a press that lands while it formats the message would replace it."""
        events = self._shell.events

        def once(*_: Any) -> None:
            with contextlib.suppress(ValueError):
                events.unregister("post_run_cell", once)
            with contextlib.suppress(ValueError):  # not the main thread
                release()

        events.register("post_run_cell", once)

    def _cell(self, args: argparse.Namespace, cell: str) -> Any:
        filename = f"In[{_cell_number(self._shell)}]"
        self._transforming_body = True
        try:
            transformed = transform_cell(self._shell, cell)
        finally:
            self._transforming_body = False
        # An auto-mode cell's first line is the user's own: no %%distributed line above it.
        code, tree = rank_code(cell, transformed, filename, first_line=1 if args.auto else 2)
        if args.auto:
            print(
                "notebook_launcher: [on the ranks] (auto mode; %%local runs a cell here)",
                file=sys.stderr,
            )
        if self.session is None:
            self.session = self._hold_presses(Session())
            print(
                f"notebook_launcher: started a session with the default settings ({self.session.describe()}); "
                "%distributed start -n N [--precision P] chooses others.",
                file=sys.stderr,
            )
        session = self.session
        names = notebook_values(
            tree,
            self._shell.user_ns,
            skip=session.owned_names | set(BASE_NAMES),
            hidden=self._shell.user_ns_hidden,
        )
        ranks = args.ranks if args.ranks is not None else list(range(session.plan.num_processes))
        shown = _ShownAround(session, args.show, args.per_rank) if args.show else None
        try:
            values = session.execute(
                code,
                ranks,
                names=names,
                returns=args.returns,
                filename=filename,
                timeout=args.timeout,
            )
        except (KeyboardInterrupt, SessionTimeoutError) as error:
            # The message is the whole story; IPython would add a traceback through this package.
            text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            setattr(error, "_render_traceback_", lambda: [text])  # noqa: B010 (any exception type)
            raise
        except Exception:
            if shown is not None:
                # What the failed cell left on the ranks is worth seeing too; the cell's own
                # error is what the cell raises, whatever happens to the drawing.
                with contextlib.suppress(Exception):
                    shown.after()
            raise
        if session.returned:
            self._shell.user_ns.update(session.returned)
            print(
                f"notebook_launcher: {', '.join(session.returned)} set in the notebook from rank "
                f"{session.returned_rank}.",
                file=sys.stderr,
            )
        if shown is not None:
            shown.after()
        if all(value is None for value in values):
            return None
        return RankValues(ranks, values)


def _display(inspection: Any) -> Any:
    from IPython.display import display

    return display(inspection, display_id=True)


class _ShownAround:
    """``%%distributed --show NAME``: NAME on every rank before the cell, then before and after."""

    def __init__(self, session: Session, names: list[str], per_rank: bool = False) -> None:
        from notebook_launcher.value_summaries import check_names

        self.session = session
        self.names = check_names(names)
        self.per_rank = self.names if per_rank else ()
        self.before = session.show(*self.names).stages[0][1]
        self.handle = _display(self._inspection(None))

    def _inspection(self, after: Any) -> Any:
        from notebook_launcher.widgets.inspector import Inspection

        stages = [("before the cell", self.before)]
        if after is not None:
            stages.append(("after the cell", after))
        return Inspection(stages, per_rank=self.per_rank)

    def after(self) -> None:
        if not self.session.alive:
            return  # a dead rank: the cell's error says why, and there is nothing to show
        self.handle.update(self._inspection(self.session.show(*self.names).stages[0][1]))


def load_ipython_extension(ipython: Any) -> None:
    from notebook_launcher.session.completion import install

    magics = DistributedMagics(ipython)
    ipython.register_magics(magics)
    install(ipython, lambda: magics.session, lambda: magics.auto)


def _cell_number(shell: Any) -> int:
    """The number the notebook shows on the running cell (``In [n]``). IPython 9 counts the
    next cell from the start of this one, earlier versions from its end; the result it fills
    for this cell holds the cell's own either way."""
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count
