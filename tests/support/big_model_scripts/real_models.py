"""GPT-2, Llama and BERT from tiny configs (no download), each saved with save_pretrained in
shards, loaded across "cpu" and "disk", and compared with the model in one piece; then the
memory estimate against autograd's own count, and the estimate-memory command. Prints one
JSON object (run in a subprocess: importing transformers once costs seconds)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile

import torch
import transformers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from notebook_launcher import big_modeling as bm
from notebook_launcher import cli

transformers.logging.set_verbosity_error()
CASES = {
    "gpt2": (
        GPT2Config(
            n_embd=32,
            n_layer=3,
            n_head=2,
            vocab_size=99,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
        ),
        GPT2LMHeadModel,
    ),
    "llama": (
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=99,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        LlamaForCausalLM,
    ),
    "bert": (
        BertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            vocab_size=99,
            max_position_embeddings=64,
        ),
        BertForMaskedLM,
    ),
}


def one_model(name: str, root: str) -> dict[str, object]:
    config, cls = CASES[name]
    torch.manual_seed(0)
    whole = cls(config).eval()
    folder = os.path.join(root, name)
    whole.save_pretrained(folder, max_shard_size="20KB")
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = whole(ids).logits
    with bm.init_empty_weights():
        model = cls(config).eval()
    bm.load_checkpoint_and_dispatch(
        model,
        folder,
        device_map="auto",
        max_memory={"cpu": "60KB"},
        offload_folder=os.path.join(root, name + "-offload"),
    )
    with torch.no_grad():
        got = model(ids).logits
    result: dict[str, object] = {
        "shards": len([f for f in os.listdir(folder) if f.endswith(".safetensors")]),
        "devices": sorted(set(model.hf_device_map.values())),
        "logits_equal": bool(torch.equal(got, expected)),
        "meta_left": [
            n
            for n, p in model.named_parameters()
            if p.device.type == "meta" and model.hf_device_map.get(n.split(".")[0]) == "cpu"
        ],
    }
    if hasattr(model, "lm_head"):
        result["tied"] = model.lm_head.weight is model.get_input_embeddings().weight
        kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        result["generate_equal"] = bool(
            torch.equal(whole.generate(ids, **kwargs), model.generate(ids, **kwargs))
        )
    return result


def estimate_against_autograd() -> dict[str, object]:
    config, cls = CASES["gpt2"]
    model = cls(config)
    estimate = bm.estimate_memory(model, batch_size=4, sequence_length=16)
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(3, 99, (4, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(ids, labels=ids)
    measured = (
        sum(storages.values())
        + output.logits.untyped_storage().nbytes()
        + output.loss.untyped_storage().nbytes()
    )
    return {
        "estimated": estimate.activations,
        "measured": measured,
        "method": estimate.activations_method,
        "parameters": estimate.parameters,
        "expected_parameters": 4 * sum(p.numel() for p in model.parameters()),
    }


def inference_estimate(root: str) -> dict[str, object]:
    """The KV cache estimate against the cache a grouped-query Llama really keeps (8 query
    heads, 2 of keys and values), and the same figures from the command line."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=99,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 99, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        output = model(ids, use_cache=True)
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = output.past_key_values
    measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    estimate = bm.estimate_memory(config, batch_size=3, sequence_length=11, training=False)
    half = bm.estimate_memory(
        config, dtype="bfloat16", batch_size=3, sequence_length=11, training=False
    )
    path = os.path.join(root, "gqa.json")
    config.to_json_file(path)
    runs = {}
    for form in ("json", "text"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(
                ["estimate-memory", path, "--inference", "--batch-size", "3"]
                + ["--sequence-length", "11"]
                + (["--json"] if form == "json" else [])
            )
        runs[form] = {"code": code, "out": out.getvalue()}
    return {
        "measured_kv": measured,
        "estimate": estimate.to_dict(),
        "estimate_text": str(estimate),
        "half_kv": half.kv_cache_bytes,
        "logits_bytes": int(output.logits.nbytes),
        "command_json": json.loads(runs["json"]["out"]),
        "command_text": runs["text"]["out"],
        "command_codes": [runs["json"]["code"], runs["text"]["code"]],
    }


def command(root: str) -> dict[str, object]:
    path = os.path.join(root, "config.json")
    CASES["llama"][0].to_json_file(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            [
                "estimate-memory",
                path,
                "--dtype",
                "bf16",
                "--batch-size",
                "2",
                "--sequence-length",
                "32",
                "--lora-rank",
                "4",
                "--lora-target-modules",
                "q_proj",
                "v_proj",
                "--world-size",
                "2",
                "--sharding",
                "fsdp",
                "--json",
            ]
        )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        bad = cli.main(["estimate-memory", os.path.join(root, "missing.json")])
    return {
        "code": code,
        "json": json.loads(out.getvalue()),
        "bad_code": bad,
        "bad_err": err.getvalue(),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = {name: one_model(name, root) for name in CASES}
        results["estimate"] = estimate_against_autograd()
        results["command"] = command(root)
        results["inference"] = inference_estimate(root)
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
