"""The process groups a launch's function destroys stay referenced until its rank exits.

A DDP model keeps its process group in its C++ reducer. Once the function has destroyed the
group (accelerate's ``end_training()`` does), the reducer may hold the group's last reference,
and freeing the model then frees a gloo group while holding the GIL. Its destructor waits for
the group's worker threads, and a worker still releasing the last gradient all-reduce needs
the GIL to drop the Python state that the backward pass left with that collective: the rank
hangs for good, inside torch. Kept here, a group the function destroyed is never freed by a
reducer: a launch's rank ends with ``os._exit``, which frees nothing. The rank's own release
of the group, once the function has returned, is not kept: it closes the group's connections,
so that a peer still waiting in a collective fails at once. (Sessions, whose ranks live across
cells, rebuild their groups themselves and keep nothing.)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable

_kept: list[Any] = []  # every group the function destroyed, until the process exits
_torch_destroy: Callable[..., None] | None = None  # torch's own, while it is replaced


def keep_destroyed_groups() -> None:
    """Until :func:`stop_keeping_destroyed_groups`, ``torch.distributed.destroy_process_group``
    keeps a reference to each group it destroys; a no-op where torch.distributed is not loaded."""
    global _torch_destroy
    dist: Any = sys.modules.get("torch.distributed")
    if _torch_destroy is not None or dist is None or not dist.is_available():
        return
    c10d = dist.distributed_c10d
    destroy = _torch_destroy = c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        with contextlib.suppress(Exception):  # keeping is a precaution; destroying is the call
            _kept.extend(_groups_destroyed_by(c10d, group))
        destroy(group)

    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def stop_keeping_destroyed_groups() -> None:
    """torch's own ``destroy_process_group`` again (the groups kept so far stay kept)."""
    global _torch_destroy
    if _torch_destroy is None:
        return
    dist: Any = sys.modules["torch.distributed"]
    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = _torch_destroy
    _torch_destroy = None


def _groups_destroyed_by(c10d: Any, group: Any) -> list[Any]:
    """What ``destroy_process_group(group)`` destroys: every group for None (or WORLD)."""
    world = c10d._world
    if group is None or group is c10d.GroupMember.WORLD:
        return list(world.pg_map)
    return [group] if group in world.pg_map else []
