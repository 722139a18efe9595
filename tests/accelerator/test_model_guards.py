"""prepare()'s guards for fp16 and for device maps, with real models on the CPU; the GPUs
of a device map are faked by the attribute transformers sets (``hf_device_map``)."""

from __future__ import annotations

import types

import pytest
import torch

from notebook_launcher import Accelerator, debug_launcher
from notebook_launcher.accelerator import model_guards
from notebook_launcher.errors import BigModelError, MixedPrecisionError, MixedPrecisionWarning


def test_a_trainable_fp16_parameter_is_refused_under_fp16_naming_it():
    accelerator = Accelerator(mixed_precision="fp16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model.half()  # frozen base and trainable head both in fp16, as a careless LoRA load gives
    with pytest.raises(
        MixedPrecisionError,
        match=r"^prepare\(\): the trainable parameters '1\.weight', '1\.bias' are stored in "
        r"float16 under mixed_precision='fp16'\. .*\"Attempting to unscale FP16 gradients\"",
    ):
        accelerator.prepare(model)
    model[1].float()  # frozen fp16 weights are fine: only trainable ones need fp32
    assert accelerator.prepare(model) is not None


def test_fp16_parameters_are_fine_without_fp16():
    Accelerator().prepare(torch.nn.Linear(2, 2).half())


def test_a_bf16_checkpoint_trained_in_fp16_warns_about_overflow():
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(torch_dtype=torch.bfloat16)
    with pytest.warns(
        MixedPrecisionWarning,
        match=r"^Linear's config says it was trained in "
        r"bfloat16, and this training runs in fp16: values past fp16's 65504",
    ):
        Accelerator(mixed_precision="fp16").prepare(model)


def test_a_device_map_across_gpus_is_refused_in_a_multi_rank_launch():
    model = torch.nn.Linear(2, 2)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"}
    model_guards.check_one_device(model, 1)  # one process may spread a model (inference)
    with pytest.raises(
        BigModelError,
        match=r"^prepare\(\): this model is spread over cuda:0, cuda:1 by its device map, in a "
        r"launch of 2 ranks: .*device_map=\{\"\": accelerator\.local_process_index\}",
    ):
        model_guards.check_one_device(model, 2)
    model.hf_device_map = {"": 1}
    model_guards.check_one_device(model, 2)


def spread_model() -> None:
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    model.hf_device_map = {"a": 0, "b": 1}  # what device_map="auto" leaves on a 2-GPU machine
    accelerator.prepare(model)


def test_prepare_in_a_rank_refuses_the_spread_model():
    with pytest.raises(BigModelError, match=r"spread over cuda:0, cuda:1"):
        debug_launcher(spread_model, num_processes=2)
