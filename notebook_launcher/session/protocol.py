"""The typed messages between the kernel and the ranks of a session.

Commands travel kernel -> rank on each rank's command pipe; replies travel back on the
rank's structured channel (the launcher's, beside Result / Failure / Progress / Metrics),
so a session reuses the launcher's output and message plumbing unchanged. Every command
carries a sequence number; a reply answers exactly one command, so a late reply of an
interrupted command is never mistaken for the answer to the next one.
"""

from __future__ import annotations

import dataclasses
from typing import Union

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


Command = Union[Execute, Call, Push, Pull, Regroup, Shutdown, Interrupt, Debug, Complete, Describe]


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


class RemoteRepr:
    """Stands in for a value that could not be pickled back: shows the rank's repr of it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text
