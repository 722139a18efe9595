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


def direct_backward() -> dict:
    import torch

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(6):
        model(torch.randn(4, 256)).sum().backward()  # not through accelerator.backward
        optimizer.step()
        optimizer.zero_grad()
    return accelerator._step_clock.summary()


def test_a_backward_called_on_the_loss_directly_is_timed_too():
    summary = debug_launcher(direct_backward)
    assert summary["count"] == 5 and summary["collectives_s"] > 0


# ---- the final callbacks' order, in one process ------------------------------------------
# DDP's reducer queues its finalization (which waits for the all-reduces) as an autograd
# final callback when its last bucket is ready; a hook on a parameter stands in for it here.


def _reducer_stand_in(parameter, seconds: float) -> None:
    import time

    from torch.autograd import Variable

    def ready(grad):
        Variable._execution_engine.queue_callback(lambda: time.sleep(seconds))

    parameter.register_hook(ready)


def _clocked_models(count: int, seconds: float = 0.05):
    import torch

    from notebook_launcher.accelerator import step_timing

    clock = step_timing.StepClock(0, 2)
    models = []
    for _ in range(count):
        model = torch.nn.Linear(4, 1)
        model.register_forward_hook(step_timing._BackwardTail(clock))
        _reducer_stand_in(model.weight, seconds)
        models.append(model)
    return clock, models


def test_the_wait_is_what_the_reducer_finalization_takes_after_the_computing():
    import torch

    clock, (model,) = _clocked_models(1)
    model(torch.randn(2, 4)).sum().backward()
    assert 0.05 <= clock._collectives < 0.5


def test_one_backward_through_three_models_is_timed_once():
    import torch

    clock, models = _clocked_models(3, seconds=0.1)
    x = torch.randn(2, 4)
    sum(model(x) for model in models).sum().backward()  # three finalizations of 100 ms
    # Not from each model's computing on (measured 0.6 s when each model timed its own).
    assert 0.3 <= clock._collectives < 0.45


def test_a_backward_that_raised_leaves_the_next_one_timed():
    import pytest
    import torch

    clock, (model,) = _clocked_models(1)
    out = model(torch.randn(2, 4))

    def fail(grad):
        raise ValueError("broken gradient")

    out.register_hook(fail)
    with pytest.raises(ValueError, match="broken gradient"):
        out.sum().backward()
    assert clock._collectives == 0.0
    model(torch.randn(2, 4)).sum().backward()
    assert clock._collectives >= 0.05


class _Outputs:
    """A model whose forward returns a mapping or a tuple, as transformers models do."""

    @staticmethod
    def make(kind: str):
        import torch

        class Model(torch.nn.Linear):
            def forward(self, x):
                logits = super().forward(x)
                loss = logits.pow(2).mean()
                return {"logits": logits, "loss": loss} if kind == "mapping" else (loss, logits)

        return Model(4, 1)


def test_an_output_mapping_or_tuple_is_timed_from_whichever_tensor_the_loss_uses():
    import torch

    from notebook_launcher.accelerator import step_timing

    for kind in ("mapping", "tuple"):
        for chosen in (0, 1):
            clock = step_timing.StepClock(0, 2)
            model = _Outputs.make(kind)
            model.register_forward_hook(step_timing._BackwardTail(clock))
            _reducer_stand_in(model.weight, 0.05)
            out = model(torch.randn(2, 4))
            tensors = list(out.values()) if kind == "mapping" else list(out)
            tensors[chosen].sum().backward()
            assert 0.05 <= clock._collectives < 0.5, (kind, chosen)
