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

A backend also owns its keyword arguments (:class:`BackendOption`, such as Ray's
``ray_address``): ``notebook_launcher()`` and the command line accept them, and the plan
carries their checked values in ``plan.backend_options``, without the core naming any.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, ClassVar

# The rank-side types live with the code that runs in the rank; backends name them from here.
from notebook_launcher.launcher.rank import RankEnds, RankSpec

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan_types import LaunchPlan


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


class Backend(abc.ABC):
    """One way of starting ranks, known to the launcher once registered
    (:func:`notebook_launcher.launcher.backends.register`)."""

    name: ClassVar[str]  # what users pass as backend=
    accelerators: ClassVar[tuple[str, ...]]  # the devices its ranks can run on
    # Where the ranks run, in words that follow "run the ranks on": "a Ray cluster".
    description: ClassVar[str] = ""
    # The devices for which backend="auto" picks this backend.
    chosen_by_auto_for: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[BackendOption, ...]] = ()

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
    ) -> list[RankControl]:
        """Start one rank per spec, running ``target(spec, payload, ends)``.

        Returns their controls in the same order. If it raises, it must first stop what it
        started; the rank group closes its own copies of ``ends`` after this returns.
        """

    def close(self) -> None:
        """Free what the backend holds beyond its ranks (a supervisor process, actors)."""
        return None
