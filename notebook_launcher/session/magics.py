"""``%distributed`` and ``%%distributed``: a session driven from notebook cells.

Loaded by ``%load_ext notebook_launcher``; IPython is imported only then.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.session.capture import notebook_values
from notebook_launcher.session.session import Session
from notebook_launcher.session.worker import BASE_NAMES


class DistributedUsageError(LaunchConfigError, UsageError):
    """A ``%distributed`` line that cannot be understood (IPython shows it without a traceback)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel's process
        raise DistributedUsageError(f"{self.prog}: {message}. Usage: {self.format_usage().strip()}")


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
    for name in ("status", "restart", "stop"):
        commands.add_parser(name, add_help=False)
    cell = _Parser(prog="%%distributed", add_help=False, allow_abbrev=False)
    cell.add_argument("--ranks", type=int, nargs="+", default=None)
    cell.add_argument("--return", dest="returns", nargs="+", default=[])
    cell.add_argument("--show", dest="show", nargs="+", default=[])
    return line, cell


def parse_line(line: str) -> argparse.Namespace:
    parsed = _parsers()[0].parse_args(shlex.split(line))
    if parsed.command is None:
        raise DistributedUsageError(
            "%distributed needs a command: start, push, pull, show, status, restart or stop "
            "(e.g. %distributed start -n 2); %%distributed runs a cell on the ranks."
        )
    return parsed


def parse_cell_line(line: str) -> argparse.Namespace:
    return _parsers()[1].parse_args(shlex.split(line))


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
    session: Session | None = None

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
            self.session = Session(args.num_processes, args.precision, args.start_method, args.hardware)
            print(
                f"notebook_launcher: session started: {self.session.describe()}."
                + (" The previous session was stopped." if replaced else "")
            )
            return None
        if args.command == "status":
            print(f"notebook_launcher: {self.session.describe()}" if self.session else
                  "notebook_launcher: no session; %distributed start -n 2 starts one.")
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
            _display(session.show(*args.names, ranks=args.ranks))
        elif args.command == "pull":
            self._shell.user_ns[args.name] = session.pull(args.name, rank=args.rank)
        return None

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

    def _cell(self, args: argparse.Namespace, cell: str) -> Any:
        if self.session is None:
            self.session = Session()
            print(
                f"notebook_launcher: started a session with the default settings ({self.session.describe()}); "
                "%distributed start -n N [--precision P] chooses others.",
                file=sys.stderr,
            )
        session = self.session
        names = notebook_values(
            cell, self._shell.user_ns, skip=session.owned_names | set(BASE_NAMES),
            hidden=self._shell.user_ns_hidden,
        )
        ranks = args.ranks if args.ranks is not None else list(range(session.plan.num_processes))
        shown = _ShownAround(session, args.show) if args.show else None
        # The leading newline keeps line numbers in tracebacks equal to the cell's own,
        # whose first line is the %%distributed line.
        try:
            values = session.execute(
                "\n" + cell, ranks, names=names, returns=args.returns,
                filename=f"In[{self._shell.execution_count}]",
            )
        except Exception:
            if shown is not None:
                # What the failed cell left on the ranks is worth seeing too; the cell's own
                # error is what the cell raises, whatever happens to the drawing.
                with contextlib.suppress(Exception):
                    shown.after()
            raise
        self._shell.user_ns.update(session.returned)
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

    def __init__(self, session: Session, names: list[str]) -> None:
        from notebook_launcher.session.inspect import check_names

        self.session = session
        self.names = check_names(names)
        self.before = session.show(*self.names).stages[0][1]
        self.handle = _display(self._inspection(None))

    def _inspection(self, after: Any) -> Any:
        from notebook_launcher.widgets.inspector import Inspection

        stages = [("before the cell", self.before)]
        if after is not None:
            stages.append(("after the cell", after))
        return Inspection(stages)

    def after(self) -> None:
        if not self.session.alive:
            return  # a dead rank: the cell's error says why, and there is nothing to show
        self.handle.update(self._inspection(self.session.show(*self.names).stages[0][1]))


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(DistributedMagics)
