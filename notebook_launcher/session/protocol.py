"""Every message between the kernel and the ranks of a session, and the shape of each reply.

``ToRank`` messages travel kernel -> rank on each rank's command pipe; ``FromRank`` ones
travel back on the rank's structured channel (the launcher's, beside Result / Failure /
Progress / Metrics), so a session reuses the launcher's output and message plumbing
unchanged. Every command carries a sequence number; a reply answers exactly one command,
so a late reply of an interrupted command is never mistaken for the answer to the next one.
A reply's value is bytes whose shape depends on its command: each command's shape is
written once here, by the pair of functions that make and read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import cloudpickle

from notebook_launcher.launcher.channel import Failure


@dataclasses.dataclass(frozen=True)
class Join:
    """The first command: the session's secret, which every store key and value carries.

    It travels on the rank's private command pipe only (never argv or the environment),
    so no other process can take part in the session's rendezvous.
    """

    secret: bytes


@dataclasses.dataclass(frozen=True)
class Execute:
    """Run a cell's code in the rank's namespace; ``names`` (cloudpickled dict) go in first."""

    seq: int
    code: str
    filename: str  # what tracebacks show; registered in linecache so they show the lines
    names: bytes  # cloudpickled {name: value} from the notebook
    returns: tuple[str, ...] = ()  # names to send back after the code ran


@dataclasses.dataclass(frozen=True)
class Call:
    """Run ``function(*args, **kwargs)`` (cloudpickled together) on the rank."""

    seq: int
    payload: bytes


@dataclasses.dataclass(frozen=True)
class Push:
    seq: int
    names: bytes  # cloudpickled {name: value}


@dataclasses.dataclass(frozen=True)
class Pull:
    seq: int
    name: str


@dataclasses.dataclass(frozen=True)
class Regroup:
    """Replace a process group that an interrupted collective left broken."""

    seq: int
    generation: int


@dataclasses.dataclass(frozen=True)
class Shutdown:
    seq: int


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """Command ``seq`` is interrupted. Sent just before the SIGINT: a rank that had not
    started the command when the signal came finds it queued as it starts, and does not
    run the command (where it would wait in a collective for a peer that never comes)."""

    seq: int


@dataclasses.dataclass(frozen=True)
class Debug:
    """Open pdb at the rank's last failure; it talks through DebugPrompt / DebugInput."""

    seq: int


@dataclasses.dataclass(frozen=True)
class Complete:
    """Completions of ``token`` in the rank's namespace (Tab in a rank cell)."""

    seq: int
    token: str


@dataclasses.dataclass(frozen=True)
class Describe:
    """Type, signature and docstring of ``name`` in the rank's namespace (Shift-Tab)."""

    seq: int
    name: str


@dataclasses.dataclass(frozen=True)
class DebugInput:
    """The line the user typed at pdb's prompt (see DebugPrompt)."""

    seq: int
    line: str


# What the rank's command loop runs; each but Interrupt is answered by one Reply.
Command = Union[Execute, Call, Push, Pull, Regroup, Shutdown, Interrupt, Debug, Complete, Describe]
# Everything the kernel sends a rank: Join first, DebugInput only while pdb runs there.
ToRank = Union[Join, Command, DebugInput]


@dataclasses.dataclass(frozen=True)
class Ready:
    """Sent once, when the rank's process group is up and it waits for commands."""

    pid: int
    device: str


@dataclasses.dataclass(frozen=True)
class Reply:
    """The answer to command ``seq``: a value, or how it failed."""

    seq: int
    # cloudpickled; for Execute: (last value, {returned name: value}), each part pickled
    # on its own, so one that cannot travel comes back as a RemoteRepr and not the rest
    value: bytes | None = None
    failure: Failure | None = None
    interrupted: bool = False  # the failure is the KeyboardInterrupt the kernel sent
    group_broken: bool = False  # a collective was cut short: the process group needs a Regroup
    owned: tuple[
        str, ...
    ] = ()  # names the rank's own code bound (never overwritten by notebook values)


@dataclasses.dataclass(frozen=True)
class DebugPrompt:
    """What pdb wrote since the last line, and the prompt it asks with."""

    seq: int
    output: str
    prompt: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One rank's answer to "what are you doing?"."""

    pid: int
    running: str | None  # what it runs ("cell 5", "a function"); None: idle, waiting for the kernel
    running_s: float | None  # for how long
    where: str  # "cell 5, line 3, in time.sleep"; empty when idle
    rss_bytes: int
    cpu_percent: float  # of one core, since the rank was last asked (or since it started)
    cuda_allocated_bytes: int | None = None  # None: no CUDA on this rank
    cuda_reserved_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class RichOutput:
    """One object a rank displayed (HTML, a figure, ...), as IPython's display data."""

    data: dict[str, Any]
    metadata: dict[str, Any]


# Everything a rank sends the kernel on its structured channel.
FromRank = Union[Ready, Reply, Snapshot, DebugPrompt, RichOutput]


# Each reply's value, made on the rank and read in the kernel. Values are cloudpickled on
# their own, so one that cannot travel comes back as a RemoteRepr and not the rest.


def execute_value(last: bytes, returned: dict[str, bytes]) -> bytes:
    """Execute: the pickled value of the cell's last expression, and of each ``returns`` name."""
    return cloudpickle.dumps((last, returned))


def read_execute(reply: Reply, with_returned: bool) -> tuple[Any, dict[str, Any]]:
    """Execute: (last value, {returned name: value}); the names only ``with_returned``."""
    if not reply.value:
        return None, {}
    last, returned = cloudpickle.loads(reply.value)
    names = (
        {key: cloudpickle.loads(part) for key, part in returned.items()} if with_returned else {}
    )
    return cloudpickle.loads(last), names


def read_value(reply: Reply) -> Any:
    """Call and Pull: the value, pickled on the rank on its own (None when there is none)."""
    return None if reply.value is None else cloudpickle.loads(reply.value)


def completions_value(found: list[tuple[str, str]]) -> bytes:
    return cloudpickle.dumps(found)


def read_completions(reply: Reply) -> list[tuple[str, str]]:
    """Complete: (text, type) for each completion."""
    return [] if reply.value is None else list(cloudpickle.loads(reply.value))


def description_value(text: str | None) -> bytes:
    return cloudpickle.dumps(text)


def read_description(reply: Reply) -> str | None:
    """Describe: the name's type, signature and docstring (None: the rank has no such name)."""
    return None if reply.value is None else cloudpickle.loads(reply.value)


def debug_value(kind: str, text: str) -> bytes:
    return cloudpickle.dumps((kind, text))


def read_debug(reply: Reply) -> tuple[str, str]:
    """Debug: ("done", pdb's last output), or ("nothing", why there is nothing to debug)."""
    if reply.value is None:
        return "done", ""
    kind, text = cloudpickle.loads(reply.value)
    return kind, text


class RemoteRepr:
    """Stands in for a value that could not be pickled back: shows the rank's repr of it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text
