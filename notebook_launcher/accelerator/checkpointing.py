"""Saving and resuming a whole training state: ``save_state`` / ``load_state``, as in accelerate.

A checkpoint folder holds, under accelerate's file names: the prepared models
(``model.safetensors`` or ``pytorch_model.bin``, then ``model_1...``; an FSDP2-sharded
model as its gathered full weights in ``pytorch_model.bin``), optimizers
(``optimizer.bin``), LR schedulers (``scheduler.bin``), the fp16 ``scaler.pt``, each prepared
loader's position (``sampler.bin``: epoch and the shuffle of the current epoch), every
rank's random states (``random_states_<rank>.pkl``) and objects registered with
``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``), and gradients accumulated since the last optimizer step
(``gradients_<rank>.bin``, only when there are any). With
``ProjectConfiguration(automatic_checkpoint_naming=True)`` folders are
``<project_dir>/checkpoints/checkpoint_<n>``, the oldest removed beyond ``total_limit``.

Resuming mid-epoch: ``load_state`` puts each loader back at the start of the epoch that
was running, with that epoch's shuffle, and ``skip_first_batches(loader, n)`` skips the
batches already trained on, so the run continues exactly where it stopped, also in the
middle of a gradient accumulation cycle.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from notebook_launcher.accelerator import fsdp
from notebook_launcher.accelerator.wrappers import unwrap
from notebook_launcher.errors import CheckpointError

if TYPE_CHECKING:
    from notebook_launcher.accelerator.accelerator_state import AcceleratorState
    from notebook_launcher.accelerator.data import DataLoaderShard
    from notebook_launcher.accelerator.optimizer import AcceleratedOptimizer
    from notebook_launcher.accelerator.scheduler import AcceleratedScheduler


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs, named as in accelerate.

    project_dir: the run's folder; checkpoints go to ``<project_dir>/checkpoints`` with
        automatic naming, tracker logs to logging_dir (default: project_dir).
    automatic_checkpoint_naming: ``save_state()`` needs no folder: it writes
        ``checkpoint_<iteration>`` and counts up; ``load_state()`` takes the latest.
    total_limit: keep at most this many automatic checkpoints (the oldest go first).
    iteration: the number of the next automatic checkpoint.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


_CHECKPOINT = re.compile(r"checkpoint_(\d+)$")


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.search(p.name))]
    return sorted(found)


def _indexed(stem: str, i: int, suffix: str) -> str:
    return f"{stem}{suffix}" if i == 0 else f"{stem}_{i}{suffix}"


class Checkpointing:
    """The Accelerator's checkpoint methods (a mixin over its prepared objects)."""

    state: AcceleratorState
    project_configuration: ProjectConfiguration
    scaler: torch.amp.GradScaler | None
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[DataLoaderShard]
    _custom_objects: list[Any]
    _save_state_pre_hooks: dict[int, Callable[..., None]]
    _load_state_pre_hooks: dict[int, Callable[..., None]]

    @staticmethod
    def make_project_configuration(
        project_dir: str | os.PathLike[str] | None, config: ProjectConfiguration | None
    ) -> ProjectConfiguration:
        config = config if config is not None else ProjectConfiguration()
        if project_dir is not None:
            config.project_dir = os.fspath(project_dir)
            if config.logging_dir is None:
                config.logging_dir = config.project_dir
        return config

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save and restore these objects (anything with state_dict and load_state_dict)."""
        invalid = [
            type(o).__name__
            for o in objects
            if not (
                callable(getattr(o, "state_dict", None))
                and callable(getattr(o, "load_state_dict", None))
            )
        ]
        if invalid:
            raise CheckpointError(
                f"register_for_checkpointing got objects without state_dict() and "
                f"load_state_dict() methods ({', '.join(invalid)}); only such objects can be "
                "saved and restored."
            )
        self._custom_objects.extend(objects)

    # ---- save ----------------------------------------------------------------------
    def _automatic_folder(self) -> Path:
        config = self.project_configuration
        if config.project_dir is None:
            raise CheckpointError(
                "ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir to "
                "put checkpoints in; pass Accelerator(project_dir=...)."
            )
        return Path(config.project_dir) / "checkpoints"

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True
    ) -> str:
        """Save everything needed to resume; call it on every rank. Returns the folder."""
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            parent = self._automatic_folder()
            target = parent / f"checkpoint_{config.iteration}"
            if self.state.is_main_process:
                existing = _numbered(parent)
                if config.total_limit is not None:
                    for _, old in existing[: max(0, len(existing) + 1 - config.total_limit)]:
                        shutil.rmtree(old)
                if target.exists():
                    raise CheckpointError(
                        f"Checkpoint folder {target} exists already; set "
                        "accelerator.project_configuration.iteration to the next free number."
                    )
        elif output_dir is None:
            raise CheckpointError(
                "save_state() needs a folder: pass save_state(output_dir=...), or create the "
                "Accelerator with ProjectConfiguration(automatic_checkpoint_naming=True)."
            )
        else:
            target = Path(output_dir)
        self.state.wait_for_everyone()
        target.mkdir(parents=True, exist_ok=True)
        writer = self.state.is_main_process or (
            config.save_on_each_node and self.state.is_local_main_process
        )
        weights = self._full_weights()  # a collective under FSDP2: every rank takes part
        hooks = getattr(self, "_save_state_pre_hooks", {})
        weights = _run_save_hooks(hooks, self._models, weights, target)
        if writer:
            self._save_shared(target, weights, safe_serialization)
        rank = self.state.process_index
        torch.save(self._rank_states(), target / f"random_states_{rank}.pkl")
        gradients = self._accumulated_gradients()
        if gradients is not None:
            torch.save(gradients, target / f"gradients_{rank}.bin")
        self.state.wait_for_everyone()
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return os.fspath(target)

    def _optimizer_owner(self, optimizer: AcceleratedOptimizer) -> torch.nn.Module | None:
        """The FSDP2-sharded model whose parameters this optimizer updates, if any."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        for model in self._models:
            if fsdp.is_fully_sharded(model) and any(p is first for p in model.parameters()):
                return model
        return None

    def _full_weights(self) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each model (or its gathered full state under FSDP2) and each optimizer's state."""
        models: list[Any] = [
            fsdp.full_state_dict(m) if fsdp.is_fully_sharded(m) else unwrap(m) for m in self._models
        ]
        optimizers = []
        for optimizer in self._optimizers:
            owner = self._optimizer_owner(optimizer)
            optimizers.append(
                optimizer.state_dict()
                if owner is None
                else fsdp.full_optimizer_state_dict(owner, optimizer.optimizer)
            )
        return models, optimizers

    def _save_shared(
        self,
        target: Path,
        weights: tuple[list[Any], list[dict[str, Any]]],
        safe_serialization: bool,
    ) -> None:
        models, optimizers = weights
        use_safetensors = safe_serialization and _safetensors_available()
        for i, model in enumerate(models):
            if isinstance(model, torch.nn.Module) and use_safetensors:
                from safetensors.torch import save_model

                save_model(model, os.fspath(target / _indexed("model", i, ".safetensors")))
            else:
                state = model.state_dict() if isinstance(model, torch.nn.Module) else model
                torch.save(state, target / _indexed("pytorch_model", i, ".bin"))
        for i, state in enumerate(optimizers):
            torch.save(state, target / _indexed("optimizer", i, ".bin"))
        for i, scheduler in enumerate(self._schedulers):
            torch.save(scheduler.state_dict(), target / _indexed("scheduler", i, ".bin"))
        for i, loader in enumerate(self._dataloaders):
            torch.save(loader.state_dict(), target / _indexed("sampler", i, ".bin"))
        if self.scaler is not None:
            torch.save(self.scaler.state_dict(), target / "scaler.pt")
        for i, obj in enumerate(self._custom_objects):
            torch.save(obj.state_dict(), target / f"custom_checkpoint_{i}.pkl")

    def _accumulated_gradients(self) -> list[list[torch.Tensor | None]] | None:
        """Each model's gradients when some are held (mid-accumulation); they differ per rank."""
        # FSDP2 gradients are per-rank shards of DTensors: not kept (save where sync_gradients is True).
        grads = [
            [] if fsdp.is_fully_sharded(m) else [p.grad for p in unwrap(m).parameters()]
            for m in self._models
        ]
        if not any(g is not None for model in grads for g in model):
            return None
        return [[None if g is None else g.detach().cpu() for g in model] for model in grads]

    def _load_gradients(self, source: Path) -> None:
        path = source / f"gradients_{self.state.process_index}.bin"
        saved = torch.load(path, weights_only=True) if path.exists() else None
        for i, model in enumerate(self._models):
            if fsdp.is_fully_sharded(model):
                continue
            for j, parameter in enumerate(unwrap(model).parameters()):
                grad = saved[i][j] if saved is not None else None
                parameter.grad = (
                    None if grad is None else grad.to(parameter.device, parameter.dtype)
                )

    def _rank_states(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "step": self.step,
            "random_state": random.getstate(),
            "torch_manual_seed": torch.get_rng_state(),
        }
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            states["numpy_random_seed"] = np.random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        return states

    # ---- load ----------------------------------------------------------------------
    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> None:
        """Restore what ``save_state`` saved into the prepared objects; call it on every rank."""
        config = self.project_configuration
        if input_dir is not None:
            source = Path(input_dir).expanduser()
            if not source.is_dir():
                raise CheckpointError(
                    f"load_state({os.fspath(input_dir)!r}): no such folder; pass the folder "
                    "save_state wrote (it returns its path)."
                )
        elif config.automatic_checkpoint_naming:
            found = _numbered(self._automatic_folder())
            if not found:
                raise CheckpointError(
                    f"load_state() found no checkpoint_<n> folder in {self._automatic_folder()}; "
                    "save one with save_state() first, or pass load_state(input_dir=...)."
                )
            number, source = found[-1]
            config.iteration = number + 1
        else:
            raise CheckpointError(
                "load_state() needs a folder: pass load_state(input_dir=...), or create the "
                "Accelerator with ProjectConfiguration(automatic_checkpoint_naming=True)."
            )
        hooks = getattr(self, "_load_state_pre_hooks", {})
        self._load_shared(source, _run_load_hooks(hooks, self._models, source))
        self._load_rank_states(source)
        self._load_gradients(source)

    def _load_shared(self, source: Path, models: list[torch.nn.Module] | None = None) -> None:
        for i, model in enumerate(self._models if models is None else models):
            module = unwrap(model)
            safe = source / _indexed("model", i, ".safetensors")
            if safe.exists() and not fsdp.is_fully_sharded(model):
                from safetensors.torch import load_model

                load_model(module, os.fspath(safe), device=str(self.state.device))
                continue
            path = source / _indexed("pytorch_model", i, ".bin")
            if fsdp.is_fully_sharded(model):
                fsdp.load_full_state_dict(model, torch.load(path, map_location="cpu"))
            else:
                module.load_state_dict(torch.load(path, map_location=self.state.device))
        for i, optimizer in enumerate(self._optimizers):
            state = torch.load(
                source / _indexed("optimizer", i, ".bin"), map_location="cpu", weights_only=False
            )
            owner = self._optimizer_owner(optimizer)
            if owner is None:
                optimizer.load_state_dict(state)
            else:
                fsdp.load_full_optimizer_state_dict(owner, optimizer.optimizer, state)
        for i, scheduler in enumerate(self._schedulers):
            path = source / _indexed("scheduler", i, ".bin")
            scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        positions = _loader_states(source, len(self._dataloaders), self.state.process_index)
        for loader, position in zip(self._dataloaders, positions):
            loader.load_state_dict(position)
        if self.scaler is not None and (source / "scaler.pt").exists():
            self.scaler.load_state_dict(torch.load(source / "scaler.pt", weights_only=False))
        saved = sorted(source.glob("custom_checkpoint_*.pkl"))
        if len(saved) != len(self._custom_objects):
            raise CheckpointError(
                f"{source} holds {len(saved)} registered object(s) but "
                f"{len(self._custom_objects)} are registered now; register the same objects, "
                "in the same order, as when it was saved."
            )
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(
                torch.load(source / f"custom_checkpoint_{i}.pkl", weights_only=False)
            )

    def _load_rank_states(self, source: Path) -> None:
        path = source / f"random_states_{self.state.process_index}.pkl"
        if not path.exists():
            raise CheckpointError(
                f"{source} has no random states for rank {self.state.process_index}; it was "
                "saved by fewer ranks than run now. Resume with the same number of processes."
            )
        states = torch.load(path, weights_only=False)
        self.step = int(states.get("step", 0))
        random.setstate(states["random_state"])
        torch.set_rng_state(states["torch_manual_seed"])
        if "numpy_random_seed" in states:
            import numpy as np

            np.random.set_state(states["numpy_random_seed"])
        if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])

    # ---- resuming mid-epoch --------------------------------------------------------------
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader over the same data that leaves out the first ``num_batches`` batches of each pass.

        For resuming inside an epoch after ``load_state``: iterate it for that epoch,
        then the original loader for the next ones.
        """
        from notebook_launcher.accelerator.data import DataLoaderShard, skip_plain_loader

        if isinstance(dataloader, DataLoaderShard):
            return dataloader.skipping(num_batches)
        return skip_plain_loader(dataloader, num_batches)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before anything is written.

        ``weights`` holds each prepared model's state dict; removing an entry
        (``weights.pop()``) leaves that model out of the default saving, so the hook can
        save it its own way. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before anything is read.

        Removing a model from ``models`` (``models.pop()``) leaves it out of the default
        loading. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle


def _safetensors_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("safetensors") is not None


def _run_save_hooks(
    hooks: dict[int, Callable[..., None]],
    models: list[torch.nn.Module],
    weights: tuple[list[Any], list[dict[str, Any]]],
    output_dir: str | os.PathLike[str],
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Call the save hooks; the models whose state dicts a hook removed are not saved."""
    if not hooks:
        return weights
    to_save, optimizers = weights
    state_dicts = [m.state_dict() if isinstance(m, torch.nn.Module) else m for m in to_save]
    kept = list(state_dicts)
    for hook in list(hooks.values()):
        hook(models, kept, os.fspath(output_dir))
    remaining = [item for item, sd in zip(to_save, state_dicts) if any(sd is k for k in kept)]
    return remaining, optimizers


def _run_load_hooks(
    hooks: dict[int, Callable[..., None]],
    models: list[torch.nn.Module],
    input_dir: str | os.PathLike[str],
) -> list[torch.nn.Module]:
    """Call the load hooks on a copy of the model list; returns the models left to load."""
    remaining = list(models)
    for hook in list(hooks.values()):
        hook(remaining, os.fspath(input_dir))
    return remaining


def _loader_states(source: Path, count: int, rank: int) -> list[dict[str, Any]]:
    """The saved positions of ``count`` prepared loaders (``sampler.bin``, ``sampler_1.bin``, ...).

    The main process writes them; every rank gets rank 0's copy, so ranks whose folders
    are not shared (each its own temporary folder) resume at the same position as well.
    """
    from notebook_launcher.accelerator import operations

    def read() -> list[dict[str, Any]]:
        names = ["sampler.bin"] + [f"sampler_{i}.bin" for i in range(1, count)]
        return [
            torch.load(source / n, map_location="cpu", weights_only=False) for n in names[:count]
        ]

    if count == 0:
        return []
    if not operations.is_distributed():
        return read()
    shared: list[Any] = [None]
    if rank == 0:
        try:
            shared[0] = read()
        except FileNotFoundError as e:
            shared[0] = e
    operations.broadcast_object_list(shared, from_process=0)
    if isinstance(shared[0], BaseException):
        raise CheckpointError(
            f"load_state({os.fspath(source)!r}): rank 0 found no saved loader position there "
            f"({shared[0]}); pass the folder save_state wrote."
        ) from shared[0]
    return list(shared[0])
