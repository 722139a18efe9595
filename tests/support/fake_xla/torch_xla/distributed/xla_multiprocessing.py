"""torch_xla.distributed.xla_multiprocessing, faked."""

from __future__ import annotations

from typing import Any, Callable

from torch_xla._internal import pjrt


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> None:
    return pjrt.spawn(fn, nprocs, start_method, args)
