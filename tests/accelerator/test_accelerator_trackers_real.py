"""The W&B and MLflow trackers with the real packages, on 2 CPU ranks, read back from what they wrote.

W&B runs offline (WANDB_MODE=offline: no network); MLflow keeps its runs in a local folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import notebook_launcher
from tests.support.accelerator import plain_process, read_wandb_offline  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def train_and_log(folder: str) -> int:
    import torch

    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator(log_with=["wandb", "mlflow"], project_dir=Path(folder) / "mlruns")
    acc.init_trackers(
        "tiny",
        config={"lr": 0.5, "batch_size": 4},
        init_kwargs={"wandb": {"dir": str(Path(folder) / "wandb-runs")}},
    )
    for step in range(3):
        loss = acc.reduce(torch.tensor(float(acc.process_index + step)), "mean")
        acc.log({"loss": loss.item(), "rank_seen": acc.process_index}, step=step)
    acc.end_training()
    return len(acc.trackers)


@pytest.mark.slow(reason="wandb starts a service process of its own, and mlflow writes its store")
def test_wandb_offline_and_mlflow_record_the_main_process_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.chdir(tmp_path)
    notebook_launcher(
        train_and_log, args=(str(tmp_path),), num_processes=2, hardware="cpu", output="none"
    )

    # W&B: one offline run (the main process's), its history and config.
    run_files = list((tmp_path / "wandb-runs").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for record in read_wandb_offline(run_files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    logged = [(h["_step"], h["loss"], h["rank_seen"]) for h in history if "loss" in h]
    assert logged == [(0, 0.5, 0), (1, 1.5, 0), (2, 2.5, 0)]
    assert (config["lr"], config["batch_size"]) == (0.5, 4)

    # MLflow: the experiment "tiny" in the project's folder, params and the metric history.
    client = mlflow.tracking.MlflowClient(str(tmp_path / "mlruns"))
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    assert runs[0].data.params == {"lr": "0.5", "batch_size": "4"}
    losses = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in losses] == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert runs[0].info.status == "FINISHED"


def mlflow_in_a_folder(folder: str) -> None:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator(log_with="mlflow", project_dir=folder)
    acc.init_trackers("tiny")


def test_mlflow_refusing_a_folder_store_says_how_to_allow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        mlflow.tracking._tracking_service.utils._get_store(str(tmp_path / "probe"))
    except mlflow.exceptions.MlflowException:
        pass
    else:
        pytest.skip(f"MLflow {mlflow.__version__} still takes a folder as its store")
    with pytest.raises(
        ValueError,
        match=r"refused the folder .* as its store: .* Set MLFLOW_ALLOW_FILE_STORE=true to keep "
        r"runs in that folder, or set MLFLOW_TRACKING_URI",
    ):
        notebook_launcher(
            mlflow_in_a_folder,
            args=(str(tmp_path / "runs"),),
            num_processes=2,
            hardware="cpu",
            output="none",
        )
