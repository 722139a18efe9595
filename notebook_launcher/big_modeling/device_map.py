"""Where each block of a model goes: ``infer_auto_device_map``, ``get_balanced_memory``, and
the checks that a device map names the model's modules and devices that exist."""

from __future__ import annotations

import difflib
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Union

import torch

from notebook_launcher.big_modeling.inventory import Weight, model_weights, owns
from notebook_launcher.big_modeling.sizes import Size, format_bytes, parse_budget, resolve_dtype
from notebook_launcher.errors import DeviceMapError

Device = Union[int, str, torch.device]


class DeviceMap(OrderedDict[str, str]):
    """A device map (module name -> device) that remembers the sizes and budgets it was made
    from, so that it draws itself in a notebook (``_repr_html_``) and prints as a plan."""

    sizes: dict[str, int]
    budgets: dict[str, int]

    def __init__(
        self,
        *args: Any,
        sizes: Mapping[str, int] | None = None,
        budgets: Mapping[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.sizes = dict(sizes or {})
        self.budgets = dict(budgets or {})

    def _repr_html_(self) -> str:
        from notebook_launcher.big_modeling.picture import plan_html

        return plan_html(self)

    def describe(self) -> str:
        """The plan as text: one line per device, then its blocks."""
        from notebook_launcher.big_modeling.picture import plan_text

        return plan_text(self)

    def __reduce__(self) -> Any:  # a plain dict travels; the sizes are only for drawing
        return (DeviceMap, (list(self.items()),), {"sizes": self.sizes, "budgets": self.budgets})


def cuda_device_count() -> int:
    """GPUs this process may use (a function of its own so that tests can fake a machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def normalize_device(device: Device, what: str = "device_map") -> str:
    """ "cpu", "disk", or "cuda:N" for a device this machine has; anything else is an error."""
    if isinstance(device, torch.device):
        device = str(device) if device.index is not None or device.type != "cuda" else "cuda:0"
    if isinstance(device, bool):
        raise DeviceMapError(
            f"{what} names device {device!r}; use 'cpu', 'disk', a GPU index or 'cuda:N'."
        )
    count = cuda_device_count()
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        index = int(device)
        name = f"cuda:{index}"
    elif device in ("cpu", "disk"):
        return str(device)
    elif isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        index = (
            0
            if device == "cuda"
            else int(device.split(":", 1)[1])
            if device.split(":", 1)[1].isdigit()
            else -1
        )
        name = f"cuda:{index}"
    else:
        raise DeviceMapError(
            f"{what} names device {device!r}, which this loader does not place weights on; "
            "use 'cpu', 'disk', a GPU index (0, 1, ...) or 'cuda:N'."
        )
    if not 0 <= index < count:
        have = (
            f"{count} GPU{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})"
            if count
            else "no GPU"
        )
        raise DeviceMapError(
            f"{what} names device {name!r}, but this machine has {have}; "
            "use a device it has, 'cpu' or 'disk'."
        )
    return name


def _device_order(device: str) -> tuple[int, int]:
    if device.startswith("cuda:"):
        return (0, int(device[5:]))
    return (1, 0) if device == "cpu" else (2, 0)


def available_memory() -> dict[str, int]:
    """Free memory per device (90% of each GPU's free memory, the RAM the system calls available)."""
    budgets: dict[str, int] = {}
    for index in range(cuda_device_count()):
        free, _total = torch.cuda.mem_get_info(index)
        budgets[f"cuda:{index}"] = int(free * 0.9)
    budgets["cpu"] = _available_ram()
    return budgets


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # pragma: no cover


def parse_max_memory(max_memory: Mapping[Device, Size] | None) -> dict[str, int]:
    """Budgets by normalized device, GPUs first, then "cpu", then "disk"."""
    if max_memory is None:
        budgets = available_memory()
    else:
        if not isinstance(max_memory, Mapping):
            raise DeviceMapError(
                f"max_memory={max_memory!r} is not a mapping; pass a dict such as "
                "{0: '10GiB', 'cpu': '30GiB'}."
            )
        budgets = {
            normalize_device(device, "max_memory"): parse_budget(size, f"max_memory[{device!r}]")
            for device, size in max_memory.items()
        }
    return dict(sorted(budgets.items(), key=lambda item: _device_order(item[0])))


def module_sizes(
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    weights: dict[str, Weight] | None = None,
) -> dict[str, int]:
    """Bytes under every module and tensor name ("" is the whole model); tied weights counted
    once, under their first name."""
    weights = model_weights(model) if weights is None else weights
    sizes: dict[str, int] = {}
    for weight in weights.values():
        size = weight.size(dtype)
        parts = weight.name.split(".")
        for cut in range(len(parts) + 1):
            prefix = ".".join(parts[:cut])
            sizes[prefix] = sizes.get(prefix, 0) + size
    for name, _module in model.named_modules():
        sizes.setdefault(name, 0)
    return sizes


def _unsplittable(module: torch.nn.Module, no_split: set[str]) -> bool:
    return type(module).__name__ in no_split or not any(True for _ in module.children())


def _units(
    model: torch.nn.Module, name: str, module: torch.nn.Module
) -> list[tuple[str, torch.nn.Module | None]]:
    """What a module splits into: its children, then its own tensors (as leaves)."""
    prefix = f"{name}." if name else ""
    units: list[tuple[str, torch.nn.Module | None]] = [
        (prefix + n, m) for n, m in module.named_children()
    ]
    units += [(prefix + n, None) for n, t in module._parameters.items() if t is not None]
    # Non-persistent buffers are in no checkpoint and never offloaded: they need no entry.
    units += [
        (prefix + n, None)
        for n, t in module._buffers.items()
        if t is not None and n not in module._non_persistent_buffers_set
    ]
    return units


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def pieces(
    model: torch.nn.Module, entry: str, sizes: Mapping[str, int], no_split: set[str]
) -> list[str]:
    """The one rule for splitting a module, shared by the planner and the runtime: a module
    is split into its children and own tensors while it weighs more than the model's largest
    piece that cannot be split (a ``no_split`` class, or a module without children). So an
    offloaded entry is lent one piece at a time, and no piece weighs more than the room the
    planner keeps on the first GPU for running offloaded blocks. Containers (ModuleList,
    ModuleDict, Sequential) are always split: models iterate them rather than call them,
    so their own forward may never run to lend their weights."""
    limit = largest_unsplittable(model, sizes, no_split)[1]
    modules = dict(model.named_modules())
    if entry not in modules:
        return [entry]  # a tensor named in the map
    found: list[str] = []
    stack: list[tuple[str, torch.nn.Module | None]] = [(entry, modules[entry])]
    while stack:
        name, module = stack.pop(0)
        container = isinstance(module, _CONTAINERS)
        if (
            module is None
            or _unsplittable(module, no_split)
            or (sizes.get(name, 0) <= limit and not container)
        ):
            found.append(name)
        else:
            stack[:0] = _units(model, name, module)
    return found


def largest_unsplittable(
    model: torch.nn.Module, sizes: Mapping[str, int], no_split: set[str]
) -> tuple[str, int]:
    best = ("", 0)
    stack = _units(model, "", model)
    while stack:
        name, module = stack.pop()
        if module is not None and not _unsplittable(module, no_split):
            stack += _units(model, name, module)
        elif sizes.get(name, 0) > best[1]:
            best = (name, sizes.get(name, 0))
    return best


def infer_auto_device_map(
    model: torch.nn.Module,
    max_memory: Mapping[Device, Size] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
) -> DeviceMap:
    """A device map that fills the GPUs in order, then the CPU, then the disk, block by block.

    A module whose class is in ``no_split_module_classes`` (a transformer layer with its
    residual connection) stays whole on one device; others are split into their children
    when they do not fit. When blocks are offloaded, the first GPU keeps room to run the
    largest of them. Works on a model built with :func:`init_empty_weights`.

    Raises:
        DeviceMapError: a budget or device is malformed or absent from this machine, or the
            largest block that cannot be split fits on no device that can run it.
    """
    dtype_ = resolve_dtype(dtype)
    weights = model_weights(model)
    sizes = module_sizes(model, dtype_, weights)
    for name, special in (special_dtypes or {}).items():
        if name in weights:
            resolved = resolve_dtype(special)
            delta = weights[name].size(resolved) - weights[name].size(dtype_)
            parts = name.split(".")
            for cut in range(len(parts) + 1):
                sizes[".".join(parts[:cut])] = sizes.get(".".join(parts[:cut]), 0) + delta
    budgets = parse_max_memory(max_memory)
    budgets.setdefault("disk", 1 << 62)
    no_split = set(no_split_module_classes or [])
    devices = list(budgets)
    compute = [d for d in devices if d != "disk"]
    biggest_name, biggest = largest_unsplittable(model, sizes, no_split)
    if compute and biggest > max(budgets[d] for d in compute):
        listed = ", ".join(f"{d}: {format_bytes(budgets[d])}" for d in compute)
        owner = (
            _module(model, biggest_name) if biggest_name in dict(model.named_modules()) else None
        )
        why = (
            f"or take {type(owner).__name__} out of no_split_module_classes"
            if owner is not None and type(owner).__name__ in no_split
            else "since a single layer or weight is never split"
        )
        raise DeviceMapError(
            f"No device has room for the largest block that cannot be split, {biggest_name!r} "
            f"({format_bytes(biggest)}): the budgets are {listed}. Raise a budget above "
            f"{format_bytes(biggest)}, {why}."
        )
    gpu_total = sum(budgets[d] for d in compute if d.startswith("cuda:"))
    if devices[0].startswith("cuda:") and sizes[""] > gpu_total:
        # Blocks will be offloaded: the first GPU must keep room to run the largest one.
        budgets[devices[0]] = max(0, budgets[devices[0]] - biggest)

    placed: DeviceMap = DeviceMap()
    used = dict.fromkeys(devices, 0)
    queue = _units(model, "", model)
    index = 0
    while queue:
        name, module = queue.pop(0)
        size = sizes.get(name, 0)
        while True:
            device = devices[index]
            if used[device] + size <= budgets[device] or device == "disk":
                placed[name] = device
                used[device] += size
                break
            if module is not None and not _unsplittable(module, no_split):
                queue[:0] = _units(model, name, module)
                break
            index += 1
        if verbose and name in placed:
            print(f"{name or 'the model'} ({format_bytes(size)}) -> {placed[name]}")
    result = _collapse(model, placed) if clean_result else placed
    return DeviceMap(
        result, sizes=sizes, budgets={d: b for d, b in parse_max_memory(max_memory).items()}
    )


def _collapse(model: torch.nn.Module, placed: Mapping[str, str]) -> DeviceMap:
    """Entries under one parent that all went to one device become one entry for the parent."""
    result: dict[str, str] = dict(placed)
    changed = True
    while changed:
        changed = False
        parents: dict[str, set[str]] = {}
        for name, device in result.items():
            if name:
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                parents.setdefault(parent, set()).add(device)
        for parent, devices in parents.items():
            if len(devices) != 1 or parent in result:
                continue
            expected = {n for n, _ in _units(model, parent, _module(model, parent))}
            children = {
                n for n in result if n and (n.rsplit(".", 1)[0] if "." in n else "") == parent
            }
            if children == expected and expected:
                device = devices.pop()
                ordered: dict[str, str] = {}
                for name, value in result.items():
                    if name in children:
                        ordered.setdefault(parent, device)
                    else:
                        ordered[name] = value
                result = ordered
                changed = True
                break
    return DeviceMap(result)


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name) if name else model


def get_balanced_memory(
    model: torch.nn.Module,
    max_memory: Mapping[Device, Size] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[str, int]:
    """Budgets that spread the model evenly over the GPUs (instead of filling the first ones),
    each with room for its largest block; with ``low_zero`` the first GPU keeps little
    (for ``generate()``'s own tensors). With fewer than two GPUs, the budgets as given."""
    budgets = parse_max_memory(max_memory)
    gpus = [d for d in budgets if d.startswith("cuda:")]
    if len(gpus) < 2:
        return budgets
    sizes = module_sizes(model, resolve_dtype(dtype))
    _name, biggest = largest_unsplittable(model, sizes, set(no_split_module_classes or []))
    sharing = len(gpus) - (1 if low_zero else 0)
    per_gpu = sizes[""] // sharing + biggest
    balanced = dict(budgets)
    for position, gpu in enumerate(gpus):
        share = biggest if low_zero and position == 0 else per_gpu
        balanced[gpu] = min(budgets[gpu], share)
    return balanced


def resolve_device_map(
    model: torch.nn.Module, device_map: Mapping[str, Device], weights: dict[str, Weight]
) -> DeviceMap:
    """The map checked against the model: every key a module or tensor of it, every tensor
    covered, every device one this machine has. Returned with normalized devices."""
    if not isinstance(device_map, Mapping):
        raise DeviceMapError(
            f"device_map={device_map!r} is neither a dict nor one of 'auto', 'balanced', "
            "'balanced_low_0', 'sequential'."
        )
    modules = dict(model.named_modules())
    tensor_names = {slot.name for w in weights.values() for slot in w.slots}
    known = set(modules) | tensor_names
    resolved = DeviceMap(
        sizes=getattr(device_map, "sizes", None), budgets=getattr(device_map, "budgets", None)
    )
    for key, device in device_map.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise DeviceMapError(
                f"device_map names {key!r}, which is neither a module nor a weight of "
                f"{type(model).__name__}.{hint} Keys are names from model.named_modules()."
            )
        resolved[key] = normalize_device(device, f"device_map[{key!r}]")
    # Non-persistent buffers (no checkpoint holds them) may be left out: they go with the
    # device that runs the model's first blocks.
    uncovered = [
        w.name
        for w in weights.values()
        if w.persistent and not any(owns(key, slot.name) for key in resolved for slot in w.slots)
    ]
    if uncovered:
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise DeviceMapError(
            f"device_map leaves out {', '.join(repr(n) for n in uncovered[:5])}{more}: every "
            "weight needs a device. Add the module holding it (or '' for the whole model)."
        )
    if not resolved.sizes:
        resolved.sizes = module_sizes(model, None, weights)
    return resolved


def home_of(name: str, device_map: Mapping[str, str]) -> str | None:
    """The device of the most specific entry covering ``name`` (None: no entry does)."""
    key = entry_of(name, device_map)
    return None if key is None else device_map[key]


def entry_of(name: str, device_map: Mapping[str, str]) -> str | None:
    best: str | None = None
    for key in device_map:
        if owns(key, name) and (best is None or len(key) > len(best)):
            best = key
    return best
