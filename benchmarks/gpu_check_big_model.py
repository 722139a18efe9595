"""Check big-model inference on a CUDA machine: offload to a GPU, and a map over several GPUs.

    PYTHONPATH=. python benchmarks/gpu_check_big_model.py [--layers 24] [--width 1024]

A stack of residual blocks with tied embeddings (plain torch; about 400 MB with the
defaults) is saved as sharded safetensors, then:

1. ``cpu_offload(model, execution_device="cuda:0")``: the weights wait in pinned CPU memory
   and are copied to the GPU one block ahead, on a side CUDA stream, without blocking; the
   outputs equal the model in one piece on the GPU;
2. the same with ``disk_offload`` (read into pinned buffers, then copied);
3. ``load_checkpoint_and_dispatch`` with budgets that spread the blocks over every GPU,
   the CPU and the disk (with one GPU: the GPU, the CPU and the disk); outputs equal, and
   each GPU holds blocks;
4. forward time with CPU offload to the GPU, beside accelerate's ``cpu_offload`` when it
   is installed (medians of interleaved rounds);
5. a KeyboardInterrupt raised inside a block during a forward on the GPU: every weight is
   back home, no block lent or fetched ahead, GPU memory back to its steady state, and the
   next forward right;
6. ``cpu_offload(model, "cuda:0")`` called with an input on the CPU: the output comes back
   on the CPU, and is read at once (no synchronize) over 20 calls, equal each time.

``--cpu`` runs checks 5 and 6 with the CPU as the execution device: their logic, on a
machine without a GPU.

Prints one PASS/FAIL/SKIP line per check; exits 1 if any failed. Without a GPU every
check is skipped (exit 0), so the script also runs on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from notebook_launcher import big_modeling as bm  # noqa: E402
from notebook_launcher.accelerator.model_files import write_model  # noqa: E402
from notebook_launcher.big_modeling.hooks import attached  # noqa: E402

RESULTS: list[str] = []


def report(status: str, name: str, detail: str) -> None:
    RESULTS.append(status)
    print(f"{status} {name}: {detail}", flush=True)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.nn.functional.gelu(self.up(self.norm(hidden))))


class Stack(torch.nn.Module):
    def __init__(self, layers: int, width: int, vocab: int = 4096) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def check(name: str, body: Callable[[], str]) -> None:
    try:
        report("PASS", name, body())
    except Exception as error:  # a check that fails reports and the next one runs
        traceback.print_exc()
        report("FAIL", name, f"{type(error).__name__}: {error}")


def interrupt_inside_a_block(reference: Stack, ids: torch.Tensor, device: str) -> str:
    """A KeyboardInterrupt (the stop button) inside block 3, its weights lent."""
    model = Stack(len(reference.blocks), reference.embed.embedding_dim).eval()
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected = model.to(device)(ids.to(device)).float().cpu()
    model.to("cpu")
    bm.cpu_offload(model, execution_device=device)
    homes = dict(model.named_parameters(remove_duplicate=False))
    hooks = attached(model)
    assert hooks is not None

    def allocated() -> int:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated(device)
        return 0

    def stop(module: torch.nn.Module, args: Any) -> None:
        raise KeyboardInterrupt

    with torch.no_grad():
        for _ in range(2):
            model(ids.to(device))
        steady = allocated()
        handle = model.blocks[3].down.register_forward_pre_hook(stop)
        try:
            model(ids.to(device))
            raise AssertionError("the forward was not interrupted")
        except KeyboardInterrupt:
            pass
        handle.remove()
        after = allocated()
        not_home = [
            n for n, p in model.named_parameters(remove_duplicate=False) if p is not homes[n]
        ]
        in_flight = hooks.blocks_in_flight()
        right = torch.allclose(model(ids.to(device)).float().cpu(), expected, atol=1e-4, rtol=1e-4)
    bm.remove_hooks(model)
    assert not not_home and in_flight == (0, 0) and right, (not_home, in_flight, right)
    assert after <= steady, f"{after - steady} bytes more on {device} than before the stop"
    return f"weights home, nothing in flight, {device} memory {after} <= steady {steady}, next forward right"


def cpu_input_read_at_once(reference: Stack, ids: torch.Tensor, device: str) -> str:
    """accelerate's single-device behaviour: any input device, outputs back where it was."""
    model = Stack(len(reference.blocks), reference.embed.embedding_dim).eval()
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected = model(ids).float()
    bm.cpu_offload(model, execution_device=device)
    sums = []
    with torch.no_grad():
        for _ in range(20):
            out = model(ids)  # on the CPU
            assert out.device.type == "cpu", out.device
            sums.append(bool(torch.allclose(out.float(), expected, atol=1e-4, rtol=1e-4)))
    bm.remove_hooks(model)
    assert all(sums), sums
    return "20 calls with a CPU input: outputs on the CPU, equal when read at once"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="checks 5 and 6 on the CPU")
    arguments = parser.parse_args()
    if arguments.cpu:
        torch.manual_seed(0)
        small = Stack(6, 64).eval()
        ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
        check("interrupt inside a block (cpu)", lambda: interrupt_inside_a_block(small, ids, "cpu"))
        check(
            "input on the CPU, read at once (cpu)",
            lambda: cpu_input_read_at_once(small, ids, "cpu"),
        )
        return 1 if "FAIL" in RESULTS else 0
    if not torch.cuda.is_available():
        report("SKIP", "all", "no CUDA device on this machine")
        return 0
    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s): {[torch.cuda.get_device_name(i) for i in range(gpus)]}")
    torch.manual_seed(0)
    reference = Stack(arguments.layers, arguments.width).eval()
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.to("cuda:0")(ids.to("cuda:0")).float().cpu()
    reference.to("cpu")
    scratch = Path(tempfile.mkdtemp())
    write_model(
        reference.state_dict(), scratch / "ckpt", max_shard_size="100MB", safe_serialization=True
    )
    size = sum(p.numel() * 4 for p in reference.parameters())
    block = sum(p.numel() * 4 for p in reference.blocks[0].parameters())

    def close(got: torch.Tensor) -> bool:
        return torch.allclose(got.float().cpu(), expected, atol=1e-4, rtol=1e-4)

    def cpu_offload_to_gpu() -> str:
        torch.manual_seed(0)
        model = Stack(arguments.layers, arguments.width).eval()
        model.load_state_dict(reference.state_dict())
        bm.cpu_offload(model, execution_device="cuda:0")
        fetcher = attached(model).fetcher
        pinned = all(t.is_pinned() for t in fetcher.cpu.values())
        with torch.no_grad():
            outs = [model(ids.to("cuda:0")) for _ in range(3)]
        side = bool(fetcher._streams)
        assert pinned and side and all(close(o) for o in outs), (pinned, side)
        return f"outputs equal; {len(fetcher.cpu)} pinned CPU tensors; copies on a side stream"

    def disk_offload_to_gpu() -> str:
        model = Stack(arguments.layers, arguments.width).eval()
        model.load_state_dict(reference.state_dict())
        bm.disk_offload(model, scratch / "disk", execution_device="cuda:0")
        with torch.no_grad():
            outs = [model(ids.to("cuda:0")) for _ in range(3)]
        assert all(close(o) for o in outs)
        return "outputs equal over 3 forwards (pinned read buffers, non-blocking copies)"

    def spread_over_gpus() -> str:
        with bm.init_empty_weights():
            model = Stack(arguments.layers, arguments.width).eval()
        share = size // (2 * gpus) + block
        budgets: dict[Any, Any] = {i: share for i in range(gpus)}
        budgets["cpu"] = size // 4
        plan = bm.infer_auto_device_map(
            model, max_memory=budgets, no_split_module_classes=["Block"]
        )
        bm.load_checkpoint_and_dispatch(
            model, scratch / "ckpt", device_map=plan, offload_folder=scratch / "spread"
        )
        used = sorted(set(model.hf_device_map.values()))
        print(plan.describe())
        with torch.no_grad():
            out = model(ids.to("cuda:0"))
        expected_devices = {f"cuda:{i}" for i in range(gpus)} | {"cpu", "disk"}
        assert close(out) and set(used) == expected_devices, used
        return f"outputs equal across {used}"

    def offload_speed() -> str:
        try:
            import accelerate
        except ImportError:
            return "accelerate not installed: ours only"
        models = {}
        for name, lib in (("ours", bm), ("accelerate", accelerate)):
            model = Stack(arguments.layers, arguments.width).eval()
            model.load_state_dict(reference.state_dict())
            lib.cpu_offload(model, execution_device=torch.device("cuda:0"))
            models[name] = model
        times: dict[str, list[float]] = {k: [] for k in models}
        x = ids.to("cuda:0")
        with torch.no_grad():
            for m in models.values():
                m(x)
            for round_ in range(arguments.rounds):
                for name in list(models) if round_ % 2 == 0 else list(models)[::-1]:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    models[name](x)
                    torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - start)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["accelerate"])
        return f"ours {ours * 1000:.1f} ms, accelerate {theirs * 1000:.1f} ms, ratio {ours / theirs:.2f}x"

    check("cpu_offload to cuda:0", cpu_offload_to_gpu)
    check("disk_offload to cuda:0", disk_offload_to_gpu)
    check(f"map over {gpus} GPU(s), cpu and disk", spread_over_gpus)
    check("CPU-offloaded forward beside accelerate", offload_speed)
    check(
        "KeyboardInterrupt inside a block on cuda:0",
        lambda: interrupt_inside_a_block(reference, ids, "cuda:0"),
    )
    check(
        "cpu_offload to cuda:0 with a CPU input, read at once",
        lambda: cpu_input_read_at_once(reference, ids, "cuda:0"),
    )
    return 1 if "FAIL" in RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
