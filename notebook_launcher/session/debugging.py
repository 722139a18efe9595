"""Post-mortem debugging of a rank: pdb runs in the rank, its input and output go through the kernel.

The rank keeps the traceback of the last command that failed on it (until the next cell
runs). ``Debug`` opens pdb there. Each time pdb wants a line, the rank sends what pdb wrote
and its prompt (``DebugPrompt``) and waits for the line (``DebugInput``) on its command
pipe; the kernel asks the notebook for it (Jupyter's stdin channel: the cell's input box).
The other ranks are not involved.
"""

from __future__ import annotations

import dataclasses
import pdb
import sys
from types import TracebackType
from typing import Any, Callable

from notebook_launcher.session.protocol import DebugInput, DebugPrompt, Interrupt


@dataclasses.dataclass(frozen=True)
class LastFailure:
    """What the rank keeps of the last command that failed on it."""

    what: str  # "cell 5"
    frames: TracebackType | None  # from the user's code down


# The rank's side ------------------------------------------------------------------------


class _RemoteConsole:
    """pdb's stdin and stdout: output is gathered, and each line read is asked of the kernel."""

    def __init__(
        self,
        seq: int,
        receive: Callable[[], Any],
        send: Callable[[Any], None],
        keep: Callable[[Any], None],
    ) -> None:
        self._seq = seq
        self._receive = receive  # the kernel's next message, read whole
        self._send = send
        self._keep = keep  # anything else the kernel sent meanwhile: run after the debugger
        self._written: list[str] = []

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        head, newline, prompt = self.taken().rpartition("\n")
        self._send(DebugPrompt(self._seq, head + newline, prompt))
        while True:
            try:
                message = self._receive()
            except (EOFError, OSError):
                return ""  # the kernel is gone: pdb reads end of input and quits
            if isinstance(message, DebugInput) and message.seq == self._seq:
                return message.line + "\n"
            if not isinstance(message, Interrupt):  # of a command that has ended
                self._keep(message)

    def taken(self) -> str:
        text = "".join(self._written)
        self._written.clear()
        return text


def _plain_pdb() -> type[pdb.Pdb]:
    """The standard library's pdb: a rank forked from a kernel inherits IPython's in its place
    (coloured, another prompt), while ranks started otherwise have the plain one."""
    return next(
        (c for c in pdb.Pdb.__mro__ if c.__module__ == "pdb" and c.__name__ == "Pdb"), pdb.Pdb
    )


class _CellPdb(_plain_pdb()):  # type: ignore[misc]
    """pdb that names a cell ``In[5]`` as tracebacks do, not as a file in the working directory."""

    def __init__(self, cell_files: set[str], **options: Any) -> None:
        super().__init__(**options)
        self._cell_files = cell_files

    def canonic(self, filename: str) -> str:
        return filename if filename in self._cell_files else super().canonic(filename)


def post_mortem(
    failure: LastFailure,
    rank: int,
    seq: int,
    receive: Callable[[], Any],
    send: Callable[[Any], None],
    keep: Callable[[Any], None],
    cell_files: set[str],
) -> str:
    """Run pdb at the frame that raised, until the user quits; what pdb wrote last."""
    console = _RemoteConsole(seq, receive, send, keep)
    console.write(
        f"pdb in rank {rank}, at the error of {failure.what} (q quits; the other ranks wait).\n"
    )
    debugger = _CellPdb(cell_files, stdin=console, stdout=console, nosigint=True, readrc=False)
    debugger.reset()
    try:
        debugger.interaction(None, failure.frames)
    finally:
        sys.settrace(None)  # quitting pdb may leave its trace function behind
    return console.taken()


# The kernel's side ----------------------------------------------------------------------


def converse(
    prompts: dict[tuple[int, int], list[DebugPrompt]],
    rank: int,
    seq: int,
    answer: Callable[[int, DebugInput], None],
    read: Callable[[str], str],
    write: Callable[[str], None],
) -> None:
    """Answer each waiting prompt of command ``seq`` on ``rank``: show pdb's output, read a line."""
    for prompt in prompts.pop((rank, seq), []):
        write(prompt.output)
        try:
            line = read(prompt.prompt)
        except (EOFError, KeyboardInterrupt):
            write(f"{prompt.prompt}q\n")
            line = "q"  # the input box was closed or the stop button pressed: leave pdb
        except BaseException:
            answer(rank, DebugInput(seq, "q"))  # no way to ask (a frontend without input)
            raise
        answer(rank, DebugInput(seq, line))
