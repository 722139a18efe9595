"""A fake torch_xla for tests: see ../README.md. Public names follow torch_xla 2.9."""

from __future__ import annotations

import torch

from torch_xla import _fake, runtime

__version__ = "2.9.0+fake"
_found_libtpu = True


class _XLAC:
    """The C extension's few entry points the launcher and its users touch."""

    @staticmethod
    def _xla_runtime_is_initialized() -> bool:
        return _fake.runtime_started

    @staticmethod
    def _xla_set_default_device(device: object) -> None:
        pass


def device(index: int | None = None) -> torch.device:
    return _fake.device()


def devices() -> list[torch.device]:
    return [_fake.device() for _ in range(_fake.devices_per_process())]


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    _fake.calls["sync"] += 1


def launch(fn, args=(), start_method="spawn", debug_single_process=False):  # type: ignore[no-untyped-def]
    from torch_xla.distributed import xla_multiprocessing as xmp

    nprocs = 1 if debug_single_process else None
    xmp.spawn(fn, args=args, nprocs=nprocs, start_method=start_method)


runtime._maybe_select_default_device()
