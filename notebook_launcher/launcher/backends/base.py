"""The small interface every way of starting ranks implements.

A backend turns a plan and one set of pipes per rank into running ranks, and gives the
kernel a :class:`RankControl` per rank to watch and stop it. Everything else (reading
output, messages, deadlines, stop requests, teardown, reporting) is the rank group's,
the same for every backend. The pipes are made by the rank group; the backend only
hands their rank-side ends (:class:`RankEnds`) to whatever runs the rank:

- local processes (fork / forkserver / spawn): one multiprocessing process per rank;
- TPU through torch_xla: one supervisor process forks every rank itself, so a rank has
  no process of its own in the kernel, its pid is known once it reports it
  (:meth:`RankControl.pid_reported`) and its end is learned by :meth:`RankControl.poll`
  (``sentinel`` None);
- several machines: local ranks whose global rank is ``plan.global_rank(local_rank)``;
- Ray actors: the rank runs elsewhere; a thread of the backend feeds what it writes into
  the ends it was given (duplicated, since the group closes its copies after ``start``);
- persistent sessions: :attr:`RankEnds.commands` carries commands to a long-lived rank.

A backend is shared by every launch that names it; what one launch started (a supervisor
process, actors, a cluster) belongs to the :class:`Started` handle its :meth:`Backend.start`
returns, which the rank group closes when the ranks ended. Two launches on one backend, one
beside the other, never touch each other's state.

A backend also owns its keyword arguments (:class:`BackendOption`, such as Ray's
``ray_address``): ``notebook_launcher()`` and the command line accept them, and the plan
carries their checked values in ``plan.backend_options``, without the core naming any.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, ClassVar

# The rank-side types live with the code that runs in the rank; backends name them from here.
from notebook_launcher.launcher.rank import RankEnds, RankSpec

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan_types import LaunchPlan

__all__ = [
    "Backend",
    "BackendOption",
    "Ended",
    "RankControl",
    "RankEnds",
    "RankSpec",
    "RankTarget",
    "Started",
    "start_ranks",
]


def _as_given(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class BackendOption:
    """A keyword argument of ``notebook_launcher()`` that one backend reads.

    ``check`` gets the value as given (a string where it came from the command line),
    never None (None leaves the option unset), and returns the value the backend reads
    from ``plan.backend_options[name]``; it raises LaunchTypeError or LaunchConfigError
    saying what to pass instead.
    """

    name: str  # a Python identifier: the keyword, and ``--name-with-dashes`` on the command line
    help: str  # what it is, for ``--help`` and messages: "the Ray cluster to run on (...)"
    check: Callable[[Any], Any] = _as_given
    metavar: str = "VALUE"  # how the command line's --help names its value


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a rank's process ended."""

    exitcode: int | None  # negative: killed by that signal; None: the backend cannot know
    # The rank went with what ran it, which the launcher did not end (a Ray node that left
    # its cluster): how, in words that follow "was lost: ".
    lost: str | None = None


# What runs inside each rank: run_rank for a launch, a command loop for a session. It must
# be importable by reference (a module-level function) for the spawn and forkserver starts.
RankTarget = Callable[["RankSpec", Any, RankEnds], None]


class RankControl(abc.ABC):
    """How the kernel watches and stops one rank, whatever runs it."""

    pid: int | None = None  # None until known (ranks forked by a supervisor report theirs)

    @property
    def sentinel(self) -> int | None:
        """A descriptor that becomes readable when the rank ended; None: the group polls."""
        return None

    @abc.abstractmethod
    def poll(self) -> Ended | None:
        """How the rank ended, or None while it runs; never blocks."""

    @abc.abstractmethod
    def signal(self, signum: int) -> None:
        """Send ``signum`` to the rank and to what it started; a no-op once it is gone."""

    def signal_rank(self, signum: int) -> None:
        """Send ``signum`` to the rank's own process alone, never to what it started (a
        session interrupts the command a rank runs, not its data loader workers); a no-op
        once it is gone or before its pid is known.

        This default signals the pid, which is right where the rank is a process of this
        machine; a backend whose ranks run elsewhere does what it can there, and says it
        cannot carry sessions (:attr:`Backend.supports_sessions`) where it can do nothing.
        """
        if self.pid is None or self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signum)

    @abc.abstractmethod
    def wait(self, timeout: float) -> Ended | None:
        """Wait at most ``timeout`` seconds for the rank's end."""

    def pid_reported(self, pid: int) -> None:
        """The rank told its pid (the first message every rank sends)."""
        if self.pid is None:
            self.pid = pid

    def release(self) -> None:
        """Free what watching the rank needed, once it ended (or was given up on)."""
        return None


class Started:
    """What one start of ranks holds: a control per rank, in rank order, and whatever
    else the start made for them (a supervisor process, actors, a cluster), which
    :meth:`close` frees once the ranks ended. A backend's start returns its own subclass
    where it holds more than the ranks."""

    def __init__(self, controls: Sequence[RankControl]) -> None:
        self.controls: list[RankControl] = list(controls)

    def close(self) -> None:
        """Free what the start holds beyond its ranks; called once, after they ended."""
        return None


class _StartedBefore(Started):
    """A backend written before :class:`Started` returned its controls as a list and kept
    the launch's state itself: its ``close()`` frees it."""

    def __init__(self, controls: Sequence[RankControl], backend: Backend) -> None:
        super().__init__(controls)
        self._backend = backend

    def close(self) -> None:
        self._backend.close()


def start_ranks(
    backend: Backend,
    plan: LaunchPlan,
    specs: Sequence[RankSpec],
    ends: Sequence[RankEnds],
    payload: Any,
    target: RankTarget,
) -> Started:
    """``backend.start(...)``, as a :class:`Started` whatever the backend returned."""
    started = backend.start(plan, specs, ends, payload, target)
    if isinstance(started, Started):
        return started
    return _StartedBefore(started, backend)


class Backend(abc.ABC):
    """One way of starting ranks, known to the launcher once registered
    (:func:`notebook_launcher.launcher.backends.register`).

    One instance serves every launch: it holds its settings, never a launch's state
    (that is the :class:`Started` its :meth:`start` returns).
    """

    name: ClassVar[str]  # what users pass as backend=
    accelerators: ClassVar[tuple[str, ...]]  # the devices its ranks can run on
    # Where the ranks run, in words that follow "run the ranks on": "a Ray cluster".
    description: ClassVar[str] = ""
    # The devices for which backend="auto" picks this backend.
    chosen_by_auto_for: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[BackendOption, ...]] = ()
    # Whether a Session can run on it: its ranks take commands through
    # RankEnds.commands and its controls signal one rank alone (RankControl.signal_rank).
    supports_sessions: ClassVar[bool] = False

    def check(self, plan: LaunchPlan) -> None:
        """Refuse (LaunchUnsupportedError) a plan this backend cannot carry out."""
        return None

    def prepare_payload(self, plan: LaunchPlan, payload: tuple[Any, ...]) -> Any:
        """The payload as it travels to the ranks (by value where a fresh interpreter starts)."""
        return payload

    @abc.abstractmethod
    def start(
        self,
        plan: LaunchPlan,
        specs: Sequence[RankSpec],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> Started | list[RankControl]:
        """Start one rank per spec, running ``target(spec, payload, ends)``.

        Returns the launch's handle: their controls in the same order, and what else this
        start holds, freed by its ``close()``. (A plain list of controls is taken too, from
        backends written before the handle: their :meth:`close` is then called instead.)
        If it raises, it must first stop what it started; the rank group closes its own
        copies of ``ends`` after this returns.
        """

    def close(self) -> None:
        """Only for backends whose :meth:`start` returns a list: free what the launch held."""
        return None
