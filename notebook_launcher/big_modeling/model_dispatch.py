"""``dispatch_model``, ``cpu_offload``, ``disk_offload`` and ``load_checkpoint_and_dispatch``:
a model spread over GPUs, the CPU and the disk, run as one. Each plans one placement
record, delivers every weight to its home, and attaches the hooks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from notebook_launcher.big_modeling.device_map import (
    Device,
    entry_of,
    get_balanced_memory,
    infer_auto_device_map,
    module_sizes,
    normalize_device,
    pieces,
)
from notebook_launcher.big_modeling.fetcher import Needs, WeightFetcher
from notebook_launcher.big_modeling.hooks import (
    Block,
    attach_hooks,
    attached,
    detach_hooks,
    guard_meta,
)
from notebook_launcher.big_modeling.inventory import current, install, model_weights
from notebook_launcher.big_modeling.loading import plan_and_load
from notebook_launcher.big_modeling.placement import (
    Home,
    Placement,
    deliver,
    plan_disk_files,
    plan_placement,
    refuse_unfilled,
)
from notebook_launcher.big_modeling.sizes import Size
from notebook_launcher.errors import DeviceMapError

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
    placement = plan_placement(
        model,
        device_map,
        main_device=main_device,
        offload_buffers=offload_buffers,
        offload_folder=offload_dir,
        adopt_folder=True,
    )
    _deliver_and_attach(model, placement, dict(state_dict or {}), skipped)
    return model


def _deliver_and_attach(
    model: torch.nn.Module,
    placement: Placement,
    supplied: Mapping[str, torch.Tensor],
    skip_keys: frozenset[str],
) -> None:
    """Weights still in the model (or in ``supplied``) to their homes, then the hooks."""
    try:
        refuse_unfilled(placement, supplied)
        plan_disk_files(placement)
        for name, weight in placement.weights.items():
            tensor = current(weight)
            if tensor.device.type != "meta" or name in supplied:
                deliver(placement, weight, supplied.get(name, tensor))
        if placement.disk is not None:
            placement.disk.finish_writing()
    except BaseException:
        if placement.disk is not None:
            placement.disk.abort()
        raise
    _attach(model, placement, skip_keys)
    # The attribute transformers and accelerate read; a DeviceMap, so that it also keeps the
    # budgets it was planned with, for show_device_map.
    model.hf_device_map = placement.device_map  # type: ignore[assignment]


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


def _host(entry: str, modules: Mapping[str, torch.nn.Module]) -> str:
    """The module whose forward an entry's weights are lent around (a tensor's owner)."""
    return entry if entry in modules else (entry.rsplit(".", 1)[0] if "." in entry else "")


def _attach(model: torch.nn.Module, placement: Placement, skip_keys: frozenset[str]) -> None:
    """Blocks from the placement: offloaded entries split by the one rule of ``pieces``; each
    block borrows the weights its slots need that live elsewhere."""
    detach_hooks(model)
    modules = dict(model.named_modules())
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    sizes = module_sizes(model, None, placement.weights)
    stored = any(w.home is Home.CPU for w in placement.where.values())
    run_map: dict[str, str] = {}
    for entry, device in placement.device_map.items():
        if placement.offloaded(device) or (stored and device == "cpu"):
            run_map.update(dict.fromkeys(pieces(model, entry, sizes, no_split), device))
        else:
            run_map[entry] = device
    blocks: dict[str, Block] = {}
    for entry, device in run_map.items():
        host = _host(entry, modules)
        if host not in blocks and (host or placement.offloaded(device) or stored):
            blocks[host] = Block(len(blocks), host, modules[host], placement.run_device(device))
    needs: dict[int, Needs] = {b.key: Needs(b.device) for b in blocks.values()}
    for name, weight in placement.weights.items():
        where = placement.where[name]
        for slot in weight.slots:
            covering = entry_of(slot.name, run_map)
            block = blocks.get(_host(covering, modules)) if covering is not None else None
            if block is None or (where.home is Home.DEVICE and where.device == block.device):
                continue  # not in the map (a non-persistent buffer), or already where it runs
            if name not in block.slots:
                block.slots[name] = []
                block.is_parameter[name] = weight.is_parameter
                need = needs[block.key]
                if where.home is Home.CPU:
                    need.cpu.append(name)
                elif where.home is Home.DISK:
                    need.disk.append(name)
                else:
                    need.elsewhere[name] = current(weight)
            block.slots[name].append(slot)
    fetcher = WeightFetcher(needs, placement.cpu, placement.disk)
    attach_hooks(model, placement.main, list(blocks.values()), fetcher, skip_keys)


def remove_hooks(model: torch.nn.Module, restore: bool = False) -> None:
    """Take the dispatch hooks off ``model``, end its prefetch thread and close its offload
    files (collecting the model does the same).

    Weights kept in CPU memory for offload go back into the model, on the CPU (as
    accelerate's ``remove_hook_from_module`` gives ``cpu_offload``'s weights back); weights
    on GPUs stay there. Weights offloaded to disk stay on the meta device (they may not fit
    in memory: that is why they went to disk), and a forward then fails naming them, unless
    ``restore=True`` reads them back into CPU memory first.
    """
    hooks = attached(model)
    if hooks is None:
        return
    weights = model_weights(model)
    fetcher = hooks.fetcher
    empty = {n: w for n, w in weights.items() if current(w).device.type == "meta"}
    for name, tensor in fetcher.cpu.items():
        if name in empty:
            install(empty.pop(name), tensor)
    if restore and fetcher.disk is not None:
        wanted = [n for n in empty if n in fetcher.disk.placed]
        for name, tensor in fetcher.disk.read(wanted).items():  # fresh memory, not a map
            install(empty.pop(name), tensor)
    detach_hooks(model)
    guard_meta(model, [slot for weight in empty.values() for slot in weight.slots])


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
    default the one the model is on), its weights copied in one block ahead of use. Inputs
    on any device are moved there, and outputs come back to the device of the inputs."""
    device = _execution_device(model, execution_device)
    placement = plan_placement(
        model,
        {"": "cpu"},
        main_device=device,
        offload_buffers=offload_buffers,
        store_everything=True,
    )
    _deliver_and_attach(model, placement, dict(state_dict or {}), frozenset())
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
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    # One file per piece, not one for the whole model: a piece comes back in one read.
    device_map = dict.fromkeys(pieces(model, "", module_sizes(model), no_split), "disk")
    placement = plan_placement(
        model,
        device_map,
        main_device=device,
        offload_buffers=offload_buffers,
        offload_folder=offload_dir,
    )
    _deliver_and_attach(model, placement, {}, frozenset())
    return model


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
    keep_in_fp32_modules: list[str] | None = None,
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
    skipped = _key_names(skip_keys)
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
    placement = plan_and_load(
        model,
        checkpoint,
        device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_buffers=offload_buffers,
        keep_in_fp32_modules=keep_in_fp32_modules,
        strict=strict,
    )
    _deliver_and_attach(model, placement, {}, skipped)
    return model
