"""Real models that transformers builds from tiny configs, loaded across "cpu" and "disk":
logits and greedy generate() tokens equal those of the model in one piece. One subprocess
runs them all (importing transformers costs seconds); each test checks one fact of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["gpt2", "llama", "bert"]
pytestmark = pytest.mark.slow(
    reason="one process builds GPT-2, Llama and BERT from configs, saves, loads and generates: 0.5 to 1.5 min"
)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "big_model_scripts" / "real_models.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", MODELS)
def test_sharded_save_pretrained_checkpoint_loads_across_cpu_and_disk_with_equal_logits(
    results, name
):
    result = results[name]
    assert result["shards"] > 3 and result["devices"] == ["cpu", "disk"]
    assert result["logits_equal"] is True and result["meta_left"] == []


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generate_gives_the_tokens_of_the_whole_model_and_ties_hold(results, name):
    assert results[name]["generate_equal"] is True
    assert results[name]["tied"] is True


def test_traced_activations_equal_what_autograd_keeps(results):
    estimate = results["estimate"]
    assert estimate["method"] == "traced"
    assert estimate["estimated"] == estimate["measured"]
    assert estimate["parameters"] == estimate["expected_parameters"]


def test_estimate_memory_command_reads_a_local_config(results):
    command = results["command"]
    figures = command["json"]
    assert command["code"] == 0 and figures["model"] == "LlamaForCausalLM"
    assert (
        figures["sharding"] == "fsdp" and figures["world_size"] == 2 and figures["lora_rank"] == 4
    )
    assert (
        figures["lora_target_modules"] == ["q_proj", "v_proj"]
        and figures["activations_method"] == "traced"
    )
    assert figures["total"] == sum(
        figures[k]
        for k in ("parameters", "gradients", "optimizer_state", "activations", "communication")
    )
    assert command["bad_code"] == 2
    assert (
        "cannot read a JSON config there" in command["bad_err"]
        and "missing.json" in command["bad_err"]
    )


def test_kv_cache_estimate_equals_the_cache_a_grouped_query_llama_keeps(results):
    inference = results["inference"]
    estimate = inference["estimate"]
    # 2 x 3 layers x batch 3 x 11 tokens x 2 kv heads x head_dim 8 x 4 bytes
    assert inference["measured_kv"] == 2 * 3 * 3 * 11 * 2 * 8 * 4
    assert estimate["kv_cache_bytes"] == inference["measured_kv"]
    assert inference["half_kv"] == inference["measured_kv"] // 2
    assert estimate["training"] is False
    assert estimate["gradients"] == 0 and estimate["optimizer_state"] == 0
    assert estimate["communication"] == 0
    assert estimate["activations_method"] == "traced"
    assert estimate["activations"] >= inference["logits_bytes"]  # the logits are held at the end
    assert estimate["total"] == (
        estimate["parameters"] + estimate["kv_cache_bytes"] + estimate["activations"]
    )


def test_estimate_memory_inference_command_prints_the_same_figures(results):
    inference = results["inference"]
    assert inference["command_codes"] == [0, 0]
    assert inference["command_json"] == inference["estimate"]
    assert inference["command_text"].strip() == inference["estimate_text"]
    assert "KV cache" in inference["command_text"] and "gradients" not in inference["command_text"]
