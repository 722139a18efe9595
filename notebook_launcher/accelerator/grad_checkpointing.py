"""Gradient checkpointing's known pitfalls under DDP and FSDP2, caught and explained.

torch's reentrant checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
or a transformers model's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"use_reentrant": True})``) runs each checkpointed block's backward as a separate
backward pass. Three things go wrong in a distributed run, each with an error from DDP's
reducer that names neither the cause nor the fix, or with no error at all:

- with ``find_unused_parameters=True``, DDP marks the block's parameters unused at the end
  of the forward, then ready again in the recomputation: "Expected to mark a variable
  ready only once";
- a block checkpointed twice in one step (shared weights) marks its parameters ready twice:
  the same error;
- a block whose inputs do not require grad (a frozen embedding in front of it, as with
  LoRA) gets no gradient at all: the next step fails with "Expected to have finished
  reduction in the prior iteration", or, with ``static_graph=True``, nothing fails and
  the block silently never trains.

The first step is checked: the loss's graph shows whether reentrant checkpointing is in
use (its ``CheckpointFunctionBackward`` nodes); the first case is refused before the
backward, the third right after it (a block cut off from the graph leaves its parameters
without a gradient), and the second's reducer error is rewritten. A block cut off under
``static_graph=True`` gets zeros from DDP, which cannot be told from a block that learned
nothing: that case is not caught.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from notebook_launcher.errors import AcceleratorError

_REENTRANT_NODE = "CheckpointFunctionBackward"
_MARKED_TWICE = "Expected to mark a variable ready only once"
_NODES_VISITED = 200_000  # a bound on the one-time walk of the first loss's graph
_FIX = (
    "use non-reentrant checkpointing: model.gradient_checkpointing_enable("
    'gradient_checkpointing_kwargs={"use_reentrant": False}) for a transformers model, or '
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) in your own forward"
)
_NAMES_SHOWN = 5


def uses_reentrant_checkpointing(loss: torch.Tensor) -> bool:
    """True when ``loss`` was computed through a block checkpointed with use_reentrant=True."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return False
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _NODES_VISITED:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == _REENTRANT_NODE:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False


class CheckpointingGuard:
    """Checks the first backward of an Accelerator's prepared models (see the module's text)."""

    def __init__(self) -> None:
        self.reentrant = False
        self._looked_at_graph = False
        self._checked_gradients = False

    def before_backward(self, loss: torch.Tensor, models: Iterable[torch.nn.Module]) -> None:
        if self._looked_at_graph or not torch.is_tensor(loss):
            return
        self._looked_at_graph = True
        self.reentrant = uses_reentrant_checkpointing(loss)
        if not self.reentrant:
            return
        for model in models:
            if isinstance(model, DistributedDataParallel) and _finds_unused(model):
                raise AcceleratorError(
                    "This model uses reentrant gradient checkpointing (use_reentrant=True) under "
                    "DDP with find_unused_parameters=True: DDP would mark the checkpointed "
                    "blocks' parameters as unused after the forward and then see their gradients "
                    "arrive in the recomputation, and fail with 'Expected to mark a variable ready "
                    f"only once'. {_sentence(_FIX)}; or drop find_unused_parameters=True from "
                    "DistributedDataParallelKwargs."
                )

    def after_backward(self, models: Iterable[torch.nn.Module]) -> None:
        """After the first backward that synchronised: every trainable parameter has a gradient.

        Checked where a missing one is a mistake: under DDP without unused-parameter
        detection (its next step would fail with a reducer error naming indices), and in
        any model using reentrant checkpointing.
        """
        if self._checked_gradients:
            return
        models = list(models)
        if any(
            isinstance(m, DistributedDataParallel) and not m.require_backward_grad_sync
            for m in models
        ):
            return  # inside no_sync: DDP checks nothing before the synchronising step
        missing: list[str] = []
        for model in models:
            if not (
                self.reentrant or (isinstance(model, DistributedDataParallel) and _strict(model))
            ):
                continue
            without, reached = _without_gradient(model)
            if reached:  # a backward through this model (not through another one alone)
                self._checked_gradients = True
                missing.extend(without)
        if not missing:
            return
        shown = ", ".join(missing[:_NAMES_SHOWN])
        more = f" and {len(missing) - _NAMES_SHOWN} more" if len(missing) > _NAMES_SHOWN else ""
        raise AcceleratorError(
            f"{len(missing)} trainable parameter{'s' if len(missing) != 1 else ''} got no gradient "
            f"in the first backward ({shown}{more}); DDP would fail at the next step with "
            "'Expected to have finished reduction in the prior iteration'. When they are in a "
            "block under reentrant gradient checkpointing (use_reentrant=True) whose inputs do not "
            "require grad (a frozen embedding in front of it, as with LoRA), the block is not "
            f"trained at all: {_FIX}, or call model.enable_input_require_grads() on a "
            "transformers model. When they are unused on purpose, freeze them "
            "(requires_grad_(False)) or pass DistributedDataParallelKwargs(find_unused_parameters=True)."
        )

    def explain(self, error: RuntimeError) -> AcceleratorError | None:
        """Our message for DDP's reducer error about checkpointed blocks; None for others."""
        if _MARKED_TWICE not in str(error):
            return None
        cause = (
            "This model uses reentrant gradient checkpointing (use_reentrant=True)"
            if self.reentrant
            else "A parameter's gradient arrived twice in one backward"
        )
        return AcceleratorError(
            f"{cause}, and DDP saw the same parameter's gradient arrive twice in one backward "
            "(a block checkpointed more than once per step, or shared weights; DDP said: "
            f"{_first_line(error)}). {_sentence(_FIX)}; or, when every step uses the same parameters, pass "
            "DistributedDataParallelKwargs(static_graph=True)."
        )


def _strict(model: DistributedDataParallel) -> bool:
    """DDP that expects a gradient for every trainable parameter at every step."""
    return not getattr(model, "find_unused_parameters", False) and not getattr(
        model, "static_graph", False
    )


def _finds_unused(model: DistributedDataParallel) -> bool:
    return bool(getattr(model, "find_unused_parameters", False)) and not bool(
        getattr(model, "static_graph", False)
    )


def _without_gradient(model: torch.nn.Module) -> tuple[list[str], bool]:
    """The trainable parameters without a gradient, and whether any has one."""
    without: list[str] = []
    reached = False
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.grad is None:
            without.append(name)
        else:
            reached = True
    return without, reached


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _first_line(error: BaseException) -> str:
    text: Any = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
