"""Model, data and reference loops shared by the rank scripts and the tests that check them.

The reference loops are plain PyTorch in one process, with no Accelerator, so parity
tests compare the core against what a user would write without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 6
SAMPLES = 48
EPOCHS = 2
LR = 0.1
MAX_NORM = 0.5


def set_all_seeds(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def make_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return optimizer, scheduler


def probe() -> torch.Tensor:
    return torch.linspace(-2, 2, 5 * FEATURES).reshape(5, FEATURES)


def train_reference(batch_size: int, seed: int = 0, scheduler_steps: int = 1) -> dict[str, Any]:
    """One process, raw PyTorch: the result N ranks with batch_size/N each must reach.

    scheduler_steps: LR scheduler steps per optimizer step. A prepared scheduler on N
    ranks advances N times per step (accelerate's convention: the schedule is written for
    one process reading the per-rank batch), so the N-rank reference passes N.
    """
    set_all_seeds(seed)
    model = make_model()
    optimizer, scheduler = make_optimizer(model)
    loader = DataLoader(make_dataset(), batch_size=batch_size, shuffle=True)
    norms = []
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            for _ in range(scheduler_steps):
                scheduler.step()
            optimizer.zero_grad()
    return {"state_dict": model.state_dict(), "norms": norms, "lr": scheduler.get_last_lr()}


def train_with_accelerator(accelerator: Any, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """The same loop with the few Accelerator lines added; batch_size is per rank."""
    set_all_seeds(seed)
    model = make_model()
    optimizer, scheduler = make_optimizer(model)
    loader = DataLoader(make_dataset(), batch_size=batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    norms = []
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return {
        "state_dict": {k: v.detach().cpu() for k, v in accelerator.get_state_dict(model).items()},
        "norms": norms,
        "lr": scheduler.get_last_lr(),
        "model": model,
    }
