"""The package's exceptions: what a launch raises in the notebook, and what the
training core raises inside a rank.

Bad input raises :class:`LaunchConfigError` (or one of its kinds: :class:`LaunchTypeError`,
:class:`LaunchUnsupportedError`, :class:`DefaultsError`) before any process starts. A launch that
ran raises :class:`RankFailedError` (carrying each rank's failure as data),
:class:`LaunchTimeoutError` or :class:`LaunchStoppedError`. The training core's errors
derive from :class:`AcceleratorError` and also from the builtin a caller would catch
without knowing this package (``ValueError`` for a bad setting, ``ImportError`` for a
missing optional package).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import ClassVar, cast

from notebook_launcher.shown_text import cut


class LaunchError(RuntimeError):
    """Base of every error the launcher raises."""


class LaunchConfigError(LaunchError, ValueError):
    """An argument or the kernel's state rules the launch out; nothing was started."""


class LaunchTypeError(LaunchConfigError, TypeError):
    """An argument has the wrong type; nothing was started."""


class LaunchUnsupportedError(LaunchConfigError):
    """An option this installation cannot carry out (a backend or a kind of launch); nothing was started."""


class DefaultsError(LaunchConfigError):
    """A launch default that is unknown, malformed, or impossible on this machine."""


class RankInputError(LaunchError, EOFError):
    """Raised inside a rank by ``input()``: ranks have no terminal or notebook to read from."""


class MixedPrecisionWarning(UserWarning):
    """A precision that runs, but may overflow (a bf16 model trained in fp16)."""


class LaunchCleanupWarning(UserWarning):
    """A rank (or something it started) could not be ended when the launch closed."""


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why one rank ended badly, as reported by the rank or seen by the launcher."""

    rank: int
    pid: int | None
    exitcode: int | None  # negative: killed by that signal
    exception_type: str | None = None  # "ValueError", "mymodule.MyError"
    message: str = ""
    traceback: str = ""  # the rank's own formatted traceback
    output_tail: str = ""  # last lines the rank wrote to stderr (for crashes without a traceback)
    time: float = 0.0  # when it failed (seconds since the epoch); orders the root cause first
    lost: str = (
        ""  # the rank went with what ran it (a Ray node that left its cluster): how, in words
    )
    # Killed by the kernel's OOM killer: "out of memory: ..." with the limit it hit and its
    # last resident memory; empty where the machine did not say so.
    out_of_memory: str = ""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def summary(self) -> str:
        who = f"Rank {self.rank}" + (f" (pid {self.pid})" if self.pid else "")
        if self.lost:
            return f"{who} was lost: {self.lost}"
        if self.exception_type:
            text = (
                f"{self.exception_type}: {cut(self.message)}"
                if self.message
                else self.exception_type
            )
            return f"{who} raised {text}"
        if self.out_of_memory:
            return f"{who} was killed by {self.signal_name or 'the kernel'}: {self.out_of_memory}"
        if self.signal_name:
            description = _SIGNAL_DESCRIPTIONS.get(self.signal_name, "")
            return f"{who} was killed by {self.signal_name}{description}"
        return f"{who} exited with code {self.exitcode} without raising an exception"


_SIGNAL_DESCRIPTIONS = {
    "SIGSEGV": " (segmentation fault)",
    "SIGKILL": " (killed: out of memory, or stopped from outside)",
    "SIGABRT": " (aborted)",
    "SIGBUS": " (bus error)",
    "SIGFPE": " (arithmetic error)",
}


class RankFailedError(LaunchError):
    """One or more ranks failed; the others were stopped.

    ``failures`` lists every failed rank, the root cause (earliest) first. When the
    rank raised an exception whose type can be rebuilt here, the error raised in the
    notebook is also an instance of that type, so ``except ValueError`` still works.
    """

    remote_type: ClassVar[type[BaseException] | None] = None

    def __init__(self, message: str, failures: list[RankFailure]) -> None:
        # Not super(): where the rank's own type also derives from LaunchError, the next
        # class in the order is torch's ChildFailedError, whose __init__ takes other arguments.
        Exception.__init__(self, message)
        self.message = message
        self.failures = failures

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_rank_failed_error, (self.remote_type, self.message, self.failures))


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``; every rank was stopped."""


class RendezvousError(LaunchError):
    """The machines of a multi-node launch could not meet, or disagree on the launch."""


class RendezvousTimeoutError(RendezvousError, LaunchTimeoutError):
    """The machines of a multi-node launch did not all meet in time."""


class LaunchStoppedError(LaunchError):
    """The launch was stopped from outside the cell (the JupyterLab sidebar)."""


class SessionError(LaunchError):
    """A session cannot run this: it was closed, or its ranks are gone (restart it)."""


class SessionTimeoutError(SessionError, TimeoutError):
    """A session cell ran past its ``timeout`` and was interrupted; the session goes on."""


_typed_classes: dict[
    tuple[type[BaseException] | None, type[Exception] | None], type[RankFailedError]
] = {}


def rank_failed_error_class(remote_type: type[BaseException] | None) -> type[RankFailedError]:
    """RankFailedError, made a subclass of the rank's exception type where Python allows it.

    Where torch is loaded it is also a subclass of torch elastic's ``ChildFailedError``,
    which accelerate's launcher (through torch elastic) raises, so code written for that
    launcher keeps catching rank failures. This module itself never imports torch.
    """
    if remote_type is not None and (
        not issubclass(remote_type, Exception) or issubclass(remote_type, RankFailedError)
    ):
        remote_type = None
    torch_view = _child_failed_view()
    key = (remote_type, torch_view)
    cls = _typed_classes.get(key)
    if cls is not None:
        return cls
    bases: tuple[type, ...] = (RankFailedError,)
    if torch_view is not None:
        bases += (torch_view,)
    if remote_type is not None:
        bases += (remote_type,)
    if len(bases) == 1:
        return RankFailedError
    name = f"RankFailedError[{remote_type.__qualname__}]" if remote_type else "RankFailedError"
    try:
        cls = type(name, bases, {"remote_type": remote_type, "__module__": __name__})
    except TypeError:  # e.g. OSError: its instance layout cannot be combined
        if remote_type is None:
            return RankFailedError
        return rank_failed_error_class(None)
    _typed_classes[key] = cls
    return cls


_child_failed_views: list[type[Exception]] = []


def _child_failed_view() -> type[Exception] | None:
    """torch elastic's ``ChildFailedError``, adapted to read a RankFailedError's failures.

    Built on first use once the kernel has loaded torch (a launch always has).
    """
    if _child_failed_views:
        return _child_failed_views[0]
    if "torch" not in sys.modules:
        return None
    try:
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError,
            ProcessFailure,
        )
    except Exception:  # a torch build without torch.distributed
        return None

    class ChildFailedView(ChildFailedError):
        # ChildFailedError keeps failures as {rank: ProcessFailure}; ours are a list of
        # RankFailure, so its two readers are answered from ours.
        name = "notebook_launcher"

        def get_first_failure(self) -> tuple[int, ProcessFailure]:
            ours = cast("list[RankFailure]", self.failures)
            first = min(ours, key=lambda f: f.time)
            failure = ProcessFailure(first.rank, first.pid or 0, first.exitcode or 1, "")
            failure.message = first.summary()
            failure.timestamp = int(first.time)
            return first.rank, failure

        def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
            return str(self)

    ChildFailedView.__module__ = __name__
    _child_failed_views.append(ChildFailedView)
    return ChildFailedView


def _rebuild_rank_failed_error(
    remote_type: type[BaseException] | None, message: str, failures: list[RankFailure]
) -> RankFailedError:
    return rank_failed_error_class(remote_type)(message, failures)


# The training core (Accelerator) ---------------------------------------------------


class AcceleratorError(Exception):
    """Base of every error the training core raises about its use."""


class MixedPrecisionError(AcceleratorError, ValueError):
    """The precision asked for is unknown or cannot run on this device."""


class RankEnvironmentError(AcceleratorError, ValueError):
    """The rank variables (RANK, WORLD_SIZE, ...) are missing, malformed or inconsistent."""


class ShardingError(AcceleratorError, ValueError):
    """A data loader cannot be split across the ranks as configured."""


class MissingDependencyError(AcceleratorError, ImportError):
    """An optional package a chosen feature needs is not installed."""


class CollectiveError(AcceleratorError, ValueError):
    """A collective (gather, reduce) got what it cannot combine, e.g. shapes differing across ranks."""


class CollectiveTypeError(CollectiveError, TypeError):
    """A collective got a value it cannot combine across ranks (a Python number, a string)."""


class DistributedOperationException(CollectiveError):
    """Ranks passed tensors a collective cannot combine (accelerate's name; its debug mode)."""


class CheckpointError(AcceleratorError, ValueError):
    """A training state cannot be saved or loaded as asked."""


class TrackerError(AcceleratorError, ValueError):
    """An experiment tracker named in ``log_with`` is unknown or cannot be used."""


class BigModelError(AcceleratorError, ValueError):
    """Base of the errors of big-model loading: a device map, budget or checkpoint that cannot work."""


class DeviceMapError(BigModelError):
    """A device map (or the budgets it was made from) names what does not exist or cannot hold the model."""


class CheckpointMismatchError(BigModelError):
    """A checkpoint and the model disagree: a weight missing, an unexpected key, another shape."""


class OffloadFolderError(BigModelError, OSError):
    """Weights must go to disk, and the offload folder is missing or cannot be written."""
