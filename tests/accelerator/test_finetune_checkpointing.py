"""Gradient checkpointing's pitfalls under DDP end in an error that says the fix.

Each case ran before into DDP's reducer: a RuntimeError naming parameter indices and
``_set_static_graph()`` (a private method), raised at the next step for the third.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from notebook_launcher import Accelerator, notebook_launcher
from notebook_launcher.accelerator.grad_checkpointing import uses_reentrant_checkpointing
from notebook_launcher.accelerator.kwargs import DistributedDataParallelKwargs
from notebook_launcher.errors import AcceleratorError


class Net(torch.nn.Module):
    def __init__(self, frozen_embedding: bool, block_twice: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.embed.weight.requires_grad_(not frozen_embedding)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.block_twice = block_twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.embed(x), use_reentrant=True)
        if self.block_twice:
            h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h).mean()


def train(case: str) -> int:
    torch.manual_seed(0)
    handlers = (
        [DistributedDataParallelKwargs(find_unused_parameters=True)] if case == "unused" else []
    )
    accelerator = Accelerator(kwargs_handlers=handlers)
    model = Net(frozen_embedding=case == "frozen", block_twice=case == "twice")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps = 0
    for _ in range(3):
        accelerator.backward(model(torch.arange(4)))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps


def each_case() -> dict[str, BaseException | int]:
    """Every case in one launch (each raises on both ranks alike, before any collective differs)."""
    found: dict[str, BaseException | int] = {}
    for case in ("unused", "twice", "frozen", "fine"):
        try:
            found[case] = train(case)
        except AcceleratorError as error:
            error.__cause__ = error.__context__ = None  # DDP's own error: not needed to tell
            found[case] = error
    return found


@pytest.fixture(scope="module")
def outcomes() -> dict[str, BaseException | int]:
    return notebook_launcher(each_case, num_processes=2, hardware="cpu", output="none", timeout=300)


def _raise(outcome: BaseException | int) -> None:
    if isinstance(outcome, BaseException):
        raise outcome


def test_reentrant_checkpointing_with_find_unused_parameters_is_refused_before_the_backward(
    outcomes,
):
    with pytest.raises(
        AcceleratorError,
        match=r"reentrant gradient checkpointing \(use_reentrant=True\) under DDP with find_unused_parameters=True.*use_reentrant\": False",
    ):
        _raise(outcomes["unused"])


def test_a_block_checkpointed_twice_names_the_fix_instead_of_the_reducer_error(outcomes):
    with pytest.raises(
        AcceleratorError,
        match=r"gradient arrive twice in one backward.*use_reentrant=False.*static_graph=True",
    ):
        _raise(outcomes["twice"])


def test_a_block_cut_off_by_a_frozen_input_is_named_after_the_first_backward(outcomes):
    with pytest.raises(
        AcceleratorError,
        match=r"2 trainable parameters got no gradient in the first backward \(module.block.weight, module.block.bias\).*enable_input_require_grads",
    ):
        _raise(outcomes["frozen"])


def test_reentrant_checkpointing_where_every_block_gets_its_gradient_trains(outcomes):
    assert outcomes["fine"] == 3


def test_the_loss_graph_tells_reentrant_checkpointing_apart():
    assert uses_reentrant_checkpointing(
        Net(frozen_embedding=False, block_twice=False)(torch.arange(4))
    )
    # A block whose inputs need no gradient is cut off from the graph altogether.
    assert not uses_reentrant_checkpointing(
        Net(frozen_embedding=True, block_twice=False)(torch.arange(4))
    )
    assert not uses_reentrant_checkpointing(torch.nn.Linear(2, 1)(torch.ones(2)).sum())
