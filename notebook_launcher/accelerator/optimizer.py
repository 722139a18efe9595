"""The prepared optimizer: steps only on synchronising steps and through the GradScaler."""

from __future__ import annotations

from typing import Any, Callable

import torch

from notebook_launcher.accelerator.gradient_state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; ``step``/``zero_grad`` do nothing while gradients accumulate.

    It subclasses ``Optimizer`` so that ``isinstance`` checks (LR schedulers, user code)
    keep working, but owns no state: everything is the wrapped optimizer's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        gradient_state: GradientState,
        scaler: torch.amp.GradScaler | None = None,
        device_kind: str = "cpu",
        on_step: Callable[[], None] | None = None,
    ) -> None:
        # Optimizer.__init__ is deliberately not called: the wrapped one owns the groups.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.device_kind = device_kind
        self.gradients_unscaled = False
        self._scale_before_step: torch.Tensor | None = None
        self._on_step = on_step  # the step clock: a step that applied gradients ends here

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            if self.device_kind == "tpu":
                from notebook_launcher.accelerator import xla

                xla.gradients_cleared(self.optimizer)  # clipped but not stepped: reduce anew

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        try:
            return self._step(closure)
        finally:
            if self._on_step is not None:
                self._on_step()

    def _step(self, closure: Callable[[], float] | None) -> Any:
        self.gradients_unscaled = False
        if self.scaler is not None:
            scale = getattr(self.scaler, "_scale", None)
            # Kept as a tensor: reading it now would wait for the GPU every step.
            self._scale_before_step = scale.clone() if isinstance(scale, torch.Tensor) else None
            result = (
                self.scaler.step(self.optimizer, closure)
                if closure
                else self.scaler.step(self.optimizer)
            )
            self.scaler.update()
            return result
        if self.device_kind == "tpu":
            from notebook_launcher.accelerator import xla

            # XLA ranks are not wrapped in DDP: this all-reduces the gradients, then steps.
            return xla.optimizer_step(self.optimizer, closure)
        return self.optimizer.step(closure) if closure else self.optimizer.step()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped because fp16 gradients overflowed."""
        if self.scaler is None or self._scale_before_step is None:
            return False
        # GradScaler lowers the scale exactly when it skipped the step for inf/nan gradients.
        return bool(self.scaler._scale < self._scale_before_step)  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
