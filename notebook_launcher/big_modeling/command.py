"""``notebook-launcher estimate-memory CONFIG.json [--inference]``: the per-rank memory
estimate of training (or running) a model on the command line, from a local config
(nothing is downloaded)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "estimate-memory",
        help="memory to train (or run) a model from its config.json, per rank (nothing is downloaded)",
        description="Build the model of CONFIG (a transformers config.json) on the meta device "
        "and print what one rank needs to train it with AdamW: parameters, gradients, "
        "optimizer state, and the activations of one forward, traced. With --inference: "
        "what running it takes: the weights, the KV cache, and one forward's activations. "
        "Exits 2 on bad input.",
    )
    parser.add_argument("config", metavar="CONFIG.json", help="a transformers config file")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default: the config's)")
    parser.add_argument(
        "--batch-size", type=int, default=1, metavar="N", help="sequences per rank (default: 1)"
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=512,
        metavar="N",
        help="tokens per sequence (default: 512)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="train LoRA adapters of rank R only",
    )
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="modules LoRA adapts (default: every linear layer but the head)",
    )
    parser.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (default: 1)")
    parser.add_argument(
        "--sharding",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="how ranks split the model (default: ddp)",
    )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="the memory to run the model (weights, KV cache for --batch-size sequences of "
        "--sequence-length tokens, activations), not to train it",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")


def run(arguments: argparse.Namespace) -> int:
    from notebook_launcher.big_modeling.estimate import estimate_memory
    from notebook_launcher.errors import BigModelError

    try:
        estimate = estimate_memory(
            arguments.config,
            dtype=arguments.dtype,
            batch_size=arguments.batch_size,
            sequence_length=arguments.sequence_length,
            lora_rank=arguments.lora_rank,
            lora_target_modules=arguments.lora_target_modules,
            world_size=arguments.world_size,
            sharding=arguments.sharding,
            training=not arguments.inference,
        )
    except BigModelError as error:
        print(f"notebook-launcher: error: {error}", file=sys.stderr)
        return 2
    if arguments.json:
        print(json.dumps(estimate.to_dict(), indent=2, sort_keys=True))
    else:
        print(estimate)
    return 0
