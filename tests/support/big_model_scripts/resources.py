"""What a dispatched model owns, counted in a process of its own: the descriptors open into
the offload folder, the prefetch thread, and the files a load leaves. Prints one JSON object.

    python resources.py {remove_hooks,collected,failed_load} CHECKPOINT FOLDER [BAD_CHECKPOINT]
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import threading

import torch

from notebook_launcher import big_modeling as bm
from notebook_launcher.errors import CheckpointMismatchError
from tests.support.big_models import TinyLM

DEVICE_MAP = {"embed": "cpu", "blocks": "disk", "head": "disk"}


def descriptors_into(folder: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.realpath(folder)):
            found.append(target)
    return found


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("big-model-prefetch")]


case, checkpoint, folder = sys.argv[1:4]
ids = torch.tensor([[1, 5, 7, 2, 9]])
result: dict[str, object] = {}
with bm.init_empty_weights():
    model = TinyLM().eval()
if case == "failed_load":
    try:
        bm.load_checkpoint_and_dispatch(
            model, sys.argv[4], device_map=DEVICE_MAP, offload_folder=folder
        )
    except CheckpointMismatchError as e:
        result["error"] = str(e)
    result["descriptors"] = descriptors_into(folder)
    result["left_in_folder"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
    result["threads"] = prefetch_threads()
else:
    bm.load_checkpoint_and_dispatch(model, checkpoint, device_map=DEVICE_MAP, offload_folder=folder)
    with torch.no_grad():
        model(ids)
        model(ids)
    result["while_used"] = {
        "descriptors": len(descriptors_into(folder)),
        "threads": len(prefetch_threads()),
    }
    if case == "remove_hooks":
        bm.remove_hooks(model)
    else:
        del model
        gc.collect()
    result["descriptors"] = descriptors_into(folder)
    for thread in threading.enumerate():  # the prefetch thread is told to end; wait for it
        if thread.name.startswith("big-model-prefetch"):
            thread.join(timeout=60)
    result["threads"] = prefetch_threads()
    shutil.rmtree(folder)
    result["deleted_still_open"] = descriptors_into(folder)
print(json.dumps(result))
