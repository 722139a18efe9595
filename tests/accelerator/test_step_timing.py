"""The step clock inside real ranks: the wait for DDP's all-reduce is timed with DDP's built-in
all-reduce left in place, with the user's own comm hook, and with ``loss.backward()`` called
directly."""

from __future__ import annotations

from notebook_launcher import debug_launcher


def train(own_hook: bool) -> dict:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    def mine(state, bucket):  # unannotated, as DDP wants a hook's annotations or none
        return allreduce_hook(state, bucket)

    if own_hook:  # before the first forward, as DDP requires: ours times it, not replaces it
        model.register_comm_hook(None, mine)
    for _ in range(6):
        accelerator.backward(model(torch.randn(4, 256)).sum())
        optimizer.step()
        optimizer.zero_grad()
    summary = accelerator._step_clock.summary()
    hooks = [hook.__qualname__ for hook, _ in model._comm_hooks]
    return {
        "summary": summary,
        "hooks": hooks,
        "untimed": accelerator._step_clock.collectives_unknown,
    }


def test_ddp_steps_are_timed_with_ddps_own_all_reduce():
    found = debug_launcher(train, args=(False,))
    assert found["hooks"] == [] and not found["untimed"]  # DDP's C++ all-reduce kept
    summary = found["summary"]
    assert summary["count"] == 5  # the first step's start is not known
    assert summary["collectives_s"] > 0
    assert (
        abs(
            summary["compute_s"]
            + summary["collectives_s"]
            + summary["data_s"]
            - summary["median_s"]
        )
        < summary["median_s"]
    )


def test_a_hook_of_the_users_own_is_timed_and_kept():
    found = debug_launcher(train, args=(True,))
    assert found["hooks"] == ["train.<locals>.mine"] and not found["untimed"]
    assert found["summary"]["collectives_s"] > 0
