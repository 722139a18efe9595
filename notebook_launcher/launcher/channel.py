"""Structured messages a rank sends to the launching kernel.

Output travels separately, through the rank's stdout and stderr pipes, so that what
C/C++ code writes is caught too. This channel carries what has structure: the result,
a failure, and the live kinds a dashboard reads (progress, metrics). A new kind is a new
dataclass here plus its handling in the rank group (or a handler passed to it, as
sessions do); kinds nobody handles are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import cloudpickle


@dataclasses.dataclass(frozen=True)
class Hello:
    """The first message of every rank: its pid, which some backends learn only so."""

    pid: int


@dataclasses.dataclass(frozen=True)
class Result:
    payload: bytes  # the return value, cloudpickled
    exit_code: int | str | None = None  # set when the function ended with sys.exit(0 / None)

    def value(self) -> Any:
        return cloudpickle.loads(self.payload)


@dataclasses.dataclass(frozen=True)
class Failure:
    exception_type: str  # qualified name, for the message
    message: str
    traceback: str
    time: float
    exception: bytes | None  # the exception itself, cloudpickled, when that worked


@dataclasses.dataclass(frozen=True)
class Progress:
    n: int
    total: int | None
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Metric:
    values: dict[str, float]
    step: int | None = None


RankMessage = Union[Hello, Result, Failure, Progress, Metric]
