"""Experiment trackers: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``end_training``.

Named and shaped as in accelerate: a tracker is a :class:`GeneralTracker` (``name``,
``requires_logging_directory``, ``store_init_configuration``, ``log``, ``finish``); the
built-in ones are TensorBoard (through ``torch.utils.tensorboard``), Weights & Biases and
MLflow, each usable when its package is installed; ``log_with="all"`` takes every
installed one. Trackers write from the main process only. They come in addition to the
launch's own observers (the live plot), which ``Accelerator.log`` always feeds.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from notebook_launcher.errors import MissingDependencyError, TrackerError


class GeneralTracker:
    """Base of experiment trackers; subclass it to log somewhere else."""

    name: ClassVar[str] = ""
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (``init_trackers(config=...)``)."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close."""

    @property
    def tracker(self) -> Any:
        """The underlying object (a SummaryWriter, a wandb run, ...)."""
        return None


class TensorBoardTracker(GeneralTracker):
    """Event files under ``<logging_dir>/<run_name>``, read by TensorBoard."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        hparams = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()
        }
        self.writer.add_hparams(hparams, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) or _is_scalar_tensor(value):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, dict(value), global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    name = "wandb"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        import wandb

        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(dict(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    name = "mlflow"

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        import mlflow

        folder = None
        if logging_dir is not None and not os.environ.get("MLFLOW_TRACKING_URI"):
            folder = os.fspath(logging_dir)
            mlflow.set_tracking_uri(folder)
        try:
            mlflow.set_experiment(run_name)
        except mlflow.exceptions.MlflowException as e:
            if folder is None or os.environ.get("MLFLOW_ALLOW_FILE_STORE"):
                raise
            raise TrackerError(
                f"MLflow {mlflow.__version__} refused the folder {folder!r} (the logging "
                f"directory) as its store: {e.message.splitlines()[0]} Set "
                "MLFLOW_ALLOW_FILE_STORE=true to keep runs in that folder, or set "
                "MLFLOW_TRACKING_URI (e.g. sqlite:///mlflow.db, which needs the full mlflow "
                "package) to store them elsewhere."
            ) from e
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        import mlflow

        mlflow.log_params(dict(values))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        mlflow.log_metrics(numbers, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


# name -> (class, the package it needs)
BUILT_IN: dict[str, tuple[type[GeneralTracker], str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "wandb": (WandBTracker, "wandb"),
    "mlflow": (MLflowTracker, "mlflow"),
}


def _is_scalar_tensor(value: Any) -> bool:
    return hasattr(value, "numel") and value.numel() == 1


def installed(name: str) -> bool:
    return importlib.util.find_spec(BUILT_IN[name][1]) is not None


def resolve_log_with(log_with: Any) -> list[str | GeneralTracker]:
    """The trackers ``log_with`` names: a name, "all", a GeneralTracker, or a list of them."""
    if log_with is None:
        return []
    items: Iterable[Any] = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[str | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            chosen.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()  # accepts enum-like values too
        if name == "all":
            chosen.extend(n for n in BUILT_IN if installed(n) and n not in chosen)
            continue
        if name not in BUILT_IN:
            raise TrackerError(
                f"log_with={item!r} is not a tracker this core knows; choose from "
                f"{', '.join(repr(n) for n in BUILT_IN)}, 'all' (every installed one), or pass "
                "a GeneralTracker instance."
            )
        if not installed(name):
            raise MissingDependencyError(
                f"log_with={name!r} needs the {BUILT_IN[name][1]} package, which is not "
                f"installed; pip install {BUILT_IN[name][1]}, or leave {name!r} out of log_with."
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def start_trackers(
    chosen: list[str | GeneralTracker],
    project_name: str,
    logging_dir: str | os.PathLike[str] | None,
    init_kwargs: Mapping[str, Mapping[str, Any]],
) -> list[GeneralTracker]:
    started: list[GeneralTracker] = []
    for item in chosen:
        if isinstance(item, GeneralTracker):
            started.append(item)
            continue
        cls = BUILT_IN[item][0]
        kwargs = dict(init_kwargs.get(item, {}))
        if cls.requires_logging_directory:
            if logging_dir is None:
                raise TrackerError(
                    f"The {item} tracker writes files and no logging directory is set; pass "
                    "Accelerator(project_dir=...) or "
                    "Accelerator(project_config=ProjectConfiguration(logging_dir=...))."
                )
            kwargs["logging_dir"] = logging_dir
        elif item == "mlflow" and logging_dir is not None:
            kwargs.setdefault("logging_dir", logging_dir)
        started.append(cls(project_name, **kwargs))  # type: ignore[call-arg]
    return started
