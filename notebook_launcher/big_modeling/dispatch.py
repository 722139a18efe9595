"""``dispatch_model``, ``cpu_offload``, ``disk_offload`` and ``load_checkpoint_and_dispatch``:
a model spread over GPUs, the CPU and the disk, run as one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from notebook_launcher.big_modeling.device_map import (
    Device,
    DeviceMap,
    entry_of,
    get_balanced_memory,
    infer_auto_device_map,
    module_sizes,
    normalize_device,
    resolve_device_map,
)
from notebook_launcher.big_modeling.hooks import Block, Runner
from notebook_launcher.big_modeling.loading import (
    STATE_ATTRIBUTE,
    attach_state,
    load_checkpoint_in_model,
)
from notebook_launcher.big_modeling.offload import DiskStore, check_writable
from notebook_launcher.big_modeling.placement import (
    CPU_STORE,
    DISK,
    current,
    disk_blocks,
    exec_device,
    homes,
    install,
    main_device,
    to_meta,
)
from notebook_launcher.big_modeling.sizes import Size, Weight, model_weights
from notebook_launcher.errors import CheckpointMismatchError, DeviceMapError

RUNNER_ATTRIBUTE = "_big_model_runner"
_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def dispatch_model(
    model: torch.nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Any = None,
    offload_buffers: bool = False,
    skip_keys: Any = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> torch.nn.Module:
    """Spread ``model`` as ``device_map`` says and make it run as one.

    Blocks on a GPU (or on the CPU of a machine without one) keep their weights there.
    Blocks mapped to ``"cpu"`` on a GPU machine, or to ``"disk"``, keep their weights off
    the device and borrow them for their forward, one block ahead. The weights already
    loaded by :func:`load_checkpoint_in_model` stay where it put them; weights still in the
    model are moved (``"disk"`` ones are written into ``offload_dir``).

    accelerate's other arguments: ``offload_buffers=True`` offloads the saved buffers with
    the parameters (by default buffers stay on the device that runs their block);
    ``skip_keys`` (a name or names) are keyword arguments of a block's forward passed on
    where they are instead of moved to the block's device (a cache object, for example).
    ``preload_module_classes`` and ``force_hooks`` change nothing here: every offloaded
    block already receives all its weights before its forward starts, and a model on one
    device runs without hooks. Weights offloaded earlier are read from the checkpoint, not
    from an ``offload_index``.

    Raises:
        DeviceMapError: the map names a missing module or device, or leaves a weight out.
        OffloadFolderError: ``"disk"`` is in the map and ``offload_dir`` is missing or not writable.
        CheckpointMismatchError: a weight is still on the meta device (never loaded).
        TypeError: ``offload_index`` is given, or ``skip_keys`` is not a name or names.
    """
    if offload_index is not None:
        raise TypeError(
            "dispatch_model(offload_index=...) is not supported: weights offloaded to disk are "
            "written and read by this package in files of its own. Load them from the checkpoint "
            "instead: load_checkpoint_and_dispatch(model, checkpoint, device_map, offload_folder=...)."
        )
    skipped = _key_names(skip_keys)
    weights = model_weights(model)
    resolved = resolve_device_map(model, device_map, weights)
    main = (
        normalize_device(main_device, "main_device") if main_device is not None else _main(resolved)
    )
    placed = homes(weights, resolved, main, offload_buffers)
    state = attach_state(model)
    supplied = dict(state_dict or {})
    _check_loaded(model, weights, placed, state, supplied)
    blocks = disk_blocks(weights, resolved, placed)
    pending = {
        b: [n for n in names if state.disk is None or n not in state.disk.written]
        for b, names in blocks.items()
    }
    pending = {b: names for b, names in pending.items() if names}
    if pending:
        folder = check_writable(offload_dir, "device_map (blocks on 'disk')")
        state.disk = state.disk or DiskStore(folder)
        for block, names in pending.items():
            state.disk.plan(
                block, [(n, tuple(weights[n].tensor.shape), weights[n].tensor.dtype) for n in names]
            )
    pin = main.startswith("cuda:")
    for name, weight in weights.items():
        home = placed[name]
        tensor = current(weight)
        if tensor.device.type == "meta":
            continue
        source = supplied.get(name, tensor)
        if home == DISK:
            assert state.disk is not None
            if name not in state.disk.written:
                state.disk.write(name, source)
            to_meta(weight)
        elif home == CPU_STORE:
            if name not in state.cpu:
                kept = source.detach().to("cpu")
                state.cpu[name] = kept.pin_memory() if pin else kept
            to_meta(weight)
        elif tensor.device != torch.device(home):
            install(weight, tensor.detach().to(home))
    if state.disk is not None and pending:
        state.disk.finish_writing()
    _attach(model, weights, resolved, placed, main, state, skipped)
    setattr(model, "hf_device_map", dict(resolved))  # noqa: B010 - the attribute transformers and accelerate read
    if isinstance(device_map, DeviceMap) and device_map.budgets:
        setattr(model, "_big_model_plan", device_map)  # noqa: B010 - its budgets, for show_device_map
    return model


def _key_names(skip_keys: Any) -> frozenset[str]:
    if skip_keys is None:
        return frozenset()
    if isinstance(skip_keys, str):
        return frozenset([skip_keys])
    if isinstance(skip_keys, (list, tuple, set, frozenset)) and all(
        isinstance(k, str) for k in skip_keys
    ):
        return frozenset(skip_keys)
    raise TypeError(
        f"skip_keys={skip_keys!r} must be the name of a keyword argument, or a list of names, "
        "of the forward of the model's blocks."
    )


def _main(device_map: Mapping[str, str]) -> str:
    return main_device(device_map)


def _check_loaded(
    model: torch.nn.Module,
    weights: dict[str, Weight],
    placed: dict[str, str],
    state: Any,
    supplied: Mapping[str, torch.Tensor],
) -> None:
    written = state.disk.written if state.disk is not None else set()
    empty = [
        n
        for n, w in weights.items()
        if current(w).device.type == "meta"
        and n not in state.cpu
        and n not in written
        and n not in supplied
    ]
    if empty:
        shown = ", ".join(repr(n) for n in empty[:5]) + (
            f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        )
        raise CheckpointMismatchError(
            f"{shown} of {type(model).__name__} {'is' if len(empty) == 1 else 'are'} on the meta "
            "device (no data): load the weights first (load_checkpoint_and_dispatch, or "
            "load_checkpoint_in_model), or call model.tie_weights() if they are tied to loaded ones."
        )


def _attach(
    model: torch.nn.Module,
    weights: dict[str, Weight],
    device_map: DeviceMap,
    placed: dict[str, str],
    main: str,
    state: Any,
    skip_keys: frozenset[str] = frozenset(),
) -> None:
    previous: Runner | None = getattr(model, RUNNER_ATTRIBUTE, None)
    if previous is not None:
        previous.remove()
    devices = {exec_device(d, main) for d in device_map.values()}
    several = len(devices) > 1
    blocks: dict[str, Block] = {}
    modules = dict(model.named_modules())
    run_map: dict[str, str] = {}
    for key, device in device_map.items():
        offloaded = device == DISK or (device == "cpu" and main != "cpu")
        if offloaded and key in modules:
            # Borrowed a piece at a time: a whole offloaded stack of layers never sits in memory at once.
            run_map.update(dict.fromkeys(_offload_units(model, key), device))
        else:
            run_map[key] = device
    for key, device in run_map.items():
        host = key if key in modules else (key.rsplit(".", 1)[0] if "." in key else "")
        if host not in blocks:
            blocks[host] = Block(
                host,
                modules[host],
                torch.device(exec_device(device, main)),
                moves_inputs=several,
                skip_keys=skip_keys,
            )
    for weight in weights.values():
        for slot in weight.slots:
            entry = entry_of(slot.name, run_map)
            if entry is None:
                continue  # a non-persistent buffer left out of the map: it lives on the main device
            host = entry if entry in modules else (entry.rsplit(".", 1)[0] if "." in entry else "")
            block = blocks[host]
            home = placed[weight.name]
            if home not in (DISK, CPU_STORE) and torch.device(home) == block.device:
                continue
            if weight.name not in block.slots:
                block.borrowed.append(weight)
                block.slots[weight.name] = []
            block.slots[weight.name].append(slot)
    ordered = [blocks[h] for h in blocks]
    runner = Runner(model, ordered, state, placed, io_same_device=several)
    setattr(model, RUNNER_ATTRIBUTE, runner)


def remove_hooks(model: torch.nn.Module) -> None:
    """Take the dispatch hooks (and the prefetch thread) off ``model``."""
    runner: Runner | None = getattr(model, RUNNER_ATTRIBUTE, None)
    if runner is not None:
        runner.remove()
        delattr(model, RUNNER_ATTRIBUTE)


def _offload_units(model: torch.nn.Module, root: str = "") -> list[str]:
    """Blocks to borrow one at a time: the entries of module lists (a transformer's layers),
    and any module holding more than a quarter of the model split into its children; a
    transformers model's ``_no_split_modules`` classes are never split."""
    sizes = module_sizes(model)
    total = max(sizes.get("", 0), 1)
    keep_whole = set(getattr(model, "_no_split_modules", None) or [])

    def units(name: str, module: torch.nn.Module) -> list[str]:
        children = list(module.named_children())
        own = any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))
        container = isinstance(
            module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
        )
        if (
            not children
            or own
            or type(module).__name__ in keep_whole
            or not (container or sizes.get(name, 0) > total / 4)
        ):
            return [name]
        prefix = f"{name}." if name else ""
        return [unit for child, sub in children for unit in units(prefix + child, sub)]

    if not root:
        found = [u for n, m in model.named_children() for u in units(n, m)]
        direct = [
            n for n, t in (*model._parameters.items(), *model._buffers.items()) if t is not None
        ]
        return found + direct if found or direct else [""]
    return units(root, model.get_submodule(root))


def _execution_device(model: torch.nn.Module, execution_device: Device | None) -> str:
    if execution_device is not None:
        return normalize_device(execution_device, "execution_device")
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda":
        return normalize_device(first.device)
    return "cpu"


def cpu_offload(
    model: torch.nn.Module,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> torch.nn.Module:
    """Keep every weight in CPU memory and run each block on ``execution_device`` (a GPU, by
    default the one the model is on), its weights copied in one block ahead of use."""
    device = _execution_device(model, execution_device)
    device_map = dict.fromkeys(_offload_units(model), "cpu")
    weights = model_weights(model)
    resolved = resolve_device_map(model, device_map, weights)
    placed = {
        n: CPU_STORE if w.is_parameter or (offload_buffers and w.persistent) else device
        for n, w in weights.items()
    }
    state = attach_state(model)
    for name, weight in weights.items():
        tensor = current(weight)
        if placed[name] == CPU_STORE:
            if tensor.device.type != "meta":
                source = (state_dict or {}).get(name, tensor).detach().to("cpu")
                state.cpu[name] = source.pin_memory() if device != "cpu" else source
                to_meta(weight)
        elif tensor.device != torch.device(device):
            install(weight, tensor.to(device))
    _check_loaded(model, weights, placed, state, {})
    _attach(model, weights, resolved, placed, device, state)
    setattr(model, "hf_device_map", dict(resolved))  # noqa: B010
    return model


def disk_offload(
    model: torch.nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> torch.nn.Module:
    """Write every weight into ``offload_dir`` (one file per block) and run each block on
    ``execution_device``, its weights read one block ahead of use."""
    device = _execution_device(model, execution_device)
    device_map = dict.fromkeys(_offload_units(model), "disk")
    return dispatch_model(
        model,
        device_map,
        main_device=device if device != "cpu" else None,
        offload_dir=offload_dir,
        offload_buffers=offload_buffers,
    )


def load_checkpoint_and_dispatch(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, Device] | None = None,
    max_memory: Mapping[Device, Size] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: Any = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = True,
) -> torch.nn.Module:
    """Load ``checkpoint`` into ``model`` (usually built with :func:`init_empty_weights`) and
    dispatch it: the usual way to run a model bigger than one device.

    ``device_map`` is a dict, or ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` /
    ``"sequential"`` to plan one from ``max_memory`` (bytes, or strings such as ``"40MB"``
    and ``"2GiB"``; by default what the devices have free). Without
    ``no_split_module_classes``, a transformers model's own ``_no_split_modules`` are kept
    whole. Each weight goes straight from the checkpoint to its place; the plan is
    ``model.hf_device_map`` (draw it with :func:`show_device_map`).
    """
    if no_split_module_classes is None:
        no_split_module_classes = list(getattr(model, "_no_split_modules", None) or [])
    if hasattr(model, "tie_weights") and callable(model.tie_weights):
        # transformers ties lm_head to the embeddings here; under init_empty_weights an untied
        # copy would stay on the meta device.
        model.tie_weights()
    if isinstance(device_map, str):
        if device_map not in _STRATEGIES:
            raise DeviceMapError(
                f"device_map={device_map!r} is not a strategy; pass one of {', '.join(map(repr, _STRATEGIES))} "
                "or a dict of module name -> device."
            )
        budgets: Mapping[Any, Any] | None = max_memory
        if device_map != "sequential":
            budgets = dict(
                get_balanced_memory(
                    model,
                    max_memory,
                    no_split_module_classes,
                    dtype,
                    low_zero=device_map == "balanced_low_0",
                )
            )
        device_map = infer_auto_device_map(model, budgets, no_split_module_classes, dtype)
    elif device_map is None:
        device_map = {"": "cpu"}
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_buffers=offload_buffers,
        strict=strict,
    )
    return dispatch_model(
        model,
        device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
    )


def offload_state(model: torch.nn.Module) -> Any:
    return getattr(model, STATE_ATTRIBUTE, None)
