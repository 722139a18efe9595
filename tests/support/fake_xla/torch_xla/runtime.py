"""torch_xla.runtime, faked: the replica numbers of this thread."""

from __future__ import annotations

import os

from torch_xla import _fake


def _maybe_select_default_device() -> None:
    # As the real one: an unset PJRT_DEVICE becomes TPU when chips are there, else CPU.
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if "FAKE_TPU_CHIPS" in os.environ else "CPU"


def device_type() -> str | None:
    return _fake.device_type()


def world_size() -> int:
    return _fake.world_size()


def global_ordinal() -> int:
    return _fake.ordinal()


def local_ordinal() -> int:
    return _fake.ordinal()


def process_index() -> int:
    return int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))


def process_count() -> int:
    return int(os.environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))


def local_process_count() -> int:
    return process_count()


def addressable_device_count() -> int:
    return _fake.devices_per_process()


def global_runtime_device_count() -> int:
    return _fake.world_size()


def is_spmd() -> bool:
    return False
