"""One forward stopped (KeyboardInterrupt) or failing (ValueError) inside block K of a model
offloaded to CPU memory or to disk, in a process of its own so that its memory and its
descriptors are its own. Prints one JSON object with what the test checks.

    python stop_and_fail.py {cpu,disk} {KeyboardInterrupt,ValueError} FOLDER
"""

from __future__ import annotations

import gc
import json
import sys
from typing import ClassVar

import torch

from notebook_launcher import big_modeling as bm

WIDTH, LAYERS, K = 512, 8, 3


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.fail: BaseException | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if recording:
            seen.append(in_flight(model))
        hidden = hidden + self.down(torch.tanh(self.up(hidden)))
        if self.fail is not None:
            raise self.fail
        return hidden


class Stack(torch.nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def in_flight(model: torch.nn.Module) -> tuple[int, int]:
    """(blocks whose weights are lent now, blocks fetched ahead and not yet lent)."""
    from notebook_launcher.big_modeling.hooks import attached

    hooks = attached(model)
    assert hooks is not None
    return hooks.blocks_in_flight()


seen: list[tuple[int, int]] = []
recording = False
kind, error, folder = sys.argv[1:4]
torch.manual_seed(0)
model = Stack().eval()
x = torch.randn(2, WIDTH)
with torch.no_grad():
    expected = model(x)
if kind == "cpu":
    bm.cpu_offload(model, execution_device="cpu")
else:
    bm.disk_offload(model, folder)
recording = True
homes = {name: param for name, param in model.named_parameters(remove_duplicate=False)}
with torch.no_grad():
    for _ in range(3):
        assert torch.equal(model(x), expected)
    gc.collect()
    steady = rss()
    between = in_flight(model)
    seen.clear()
    raised = KeyboardInterrupt() if error == "KeyboardInterrupt" else ValueError("block K")
    model.blocks[K].fail = raised
    caught = None
    try:
        model(x)
    except BaseException as e:
        caught = type(e).__name__
    model.blocks[K].fail = None
    after_error = in_flight(model)
    slots_home = {
        name: param is homes[name] for name, param in model.named_parameters(remove_duplicate=False)
    }
    during_failed = list(seen)
    seen.clear()
    outputs_right = [bool(torch.equal(model(x), expected)) for _ in range(3)]
    during_next = list(seen)
    gc.collect()
    settled = rss()
print(
    json.dumps(
        {
            "caught": caught,
            "between_forwards": between,
            "after_error": after_error,
            "slots_not_home": [n for n, ok in slots_home.items() if not ok],
            "during_failed": during_failed,
            "during_next": during_next,
            "outputs_right": outputs_right,
            "after_next": in_flight(model),
            "grown": settled - steady,
            "block_bytes": sum(p.numel() * 4 for p in model.blocks[0].parameters())
            or 8 * WIDTH**2 + 12 * WIDTH,
        }
    )
)
