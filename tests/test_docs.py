"""The documentation's Python examples run, and print what the pages say they print.

Every ```python block of README.md and docs/*.md runs as a script of its own (a fresh
interpreter, its functions in ``__main__`` as in a notebook), in an empty folder with
Jupyter's config, data and runtime folders of its own, so that no example reads or writes
the user's saved defaults, and with GPUs hidden, so that it runs on CPU ranks everywhere.

A block followed directly by a ```text title="Output" block must print that text to stdout,
where ``...`` stands for any text (a pid, a port, a path), within a line or across lines.

A block that cannot run on a CPU-only machine carries a marker on the line right before
its fence, which says why::

    <!-- docs-test: skip (needs a CUDA GPU) -->

Such blocks are reported as skipped with that reason, one test each, so none goes unseen.
A block that runs a scenario of processes of its own for more than about 5 s on a quiet
2-core machine is left to ``make test`` (the quick tier leaves ``slow`` tests out)::

    <!-- docs-test: slow (launches ranks that run past the launch's timeout) -->
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
SLOW_MARKER = re.compile(r"^<!--\s*docs-test:\s*slow\s*\((?P<reason>[^)]+)\)\s*-->$")
# Only the markers above are understood; a misspelt one must fail, not silently run or skip.
ANY_MARKER = re.compile(r"^<!--\s*docs-test")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>```+)(?P<info>.*)$")
# A safety net against a block that never ends; each example normally takes seconds.
BLOCK_TIMEOUT_S = 600


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    info: str
    code: str
    marker: str | None  # the line before the fence, when it is a docs-test comment
    output: str | None = None  # the ```text title="Output" block right after, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.marker is None:
            return None
        match = SKIP_MARKER.match(self.marker)
        return match.group("reason").strip() if match else None

    @property
    def slow_reason(self) -> str | None:
        match = SLOW_MARKER.match(self.marker) if self.marker is not None else None
        return match.group("reason").strip() if match else None


def extract_blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with the marker line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        info = opening["info"].strip()
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(ticks) and lines[end].strip().strip("`") == ""
        ):
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end])
            end += 1
        previous = lines[index - 1].strip() if index > 0 else ""
        marker = previous if ANY_MARKER.match(previous) else None
        language = info.split()[0].lower() if info else ""
        blocks.append(
            Block(page, index + 1, language, info, textwrap.dedent("\n".join(body)) + "\n", marker)
        )
        index = end + 1
    # Pair each python block with the output block that directly follows it.
    for first, second in zip(blocks, blocks[1:]):
        if first.language == "python" and _is_output(second) and _adjacent(page, first, second):
            first.output = second.code
    return blocks


def _is_output(block: Block) -> bool:
    return block.language == "text" and 'title="Output"' in block.info


def _adjacent(page: Path, first: Block, second: Block) -> bool:
    """Only blank lines lie between the end of `first` and the fence of `second`."""
    lines = page.read_text(encoding="utf-8").splitlines()
    closing = first.line + first.code.count("\n")  # 0-based index of first's closing fence
    return all(not line.strip() for line in lines[closing + 1 : second.line - 1])


ALL_BLOCKS = [block for page in PAGES for block in extract_blocks(page)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]


def _block_param(block: Block) -> object:
    reason = block.slow_reason
    if reason is None:
        return block
    return pytest.param(block, marks=pytest.mark.slow(reason=reason), id=block.name)


def output_pattern(expected: str) -> re.Pattern[str]:
    """The expected output as a pattern: ``...`` stands for any text, even several lines."""
    parts = [re.escape(part) for part in expected.strip().split("...")]
    return re.compile(r"[\s\S]*?".join(parts))


def run_block(block: Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    env = dict(os.environ)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        folder = tmp_path / name.lower()
        folder.mkdir()
        env[name] = str(folder)
    env.pop("JUPYTER_PATH", None)
    # The pages show what a machine without a GPU prints (2 CPU ranks); hiding the GPUs of
    # a GPU machine keeps that true there (the hardware report honours this variable).
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "block", [_block_param(b) for b in PYTHON_BLOCKS], ids=[b.name for b in PYTHON_BLOCKS]
)
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"not run here: {block.skip_reason}")
    result = run_block(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.name} exited with {result.returncode}\n--- code\n{block.code}"
        f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    )
    if block.output is not None:
        pattern = output_pattern(block.output)
        assert pattern.fullmatch(result.stdout.strip()), (
            f"{block.name} printed something else than the page shows\n--- page\n"
            f"{block.output}--- printed\n{result.stdout}"
        )


def test_every_marker_is_understood() -> None:
    bad = [
        f"{b.name}: {b.marker}"
        for b in ALL_BLOCKS
        if b.marker and not (SKIP_MARKER.match(b.marker) or SLOW_MARKER.match(b.marker))
    ]
    assert not bad, (
        "docs-test markers that are not `<!-- docs-test: skip (reason) -->` or "
        "`<!-- docs-test: slow (reason) -->`:\n" + "\n".join(bad)
    )


def test_markers_sit_on_python_blocks_only() -> None:
    misplaced = [
        b.name for b in ALL_BLOCKS if (b.skip_reason or b.slow_reason) and b.language != "python"
    ]
    assert not misplaced, f"markers before blocks that are never run: {misplaced}"


def test_every_output_block_follows_a_python_block() -> None:
    orphans = [
        b.name
        for b in ALL_BLOCKS
        if _is_output(b) and not any(p.output is b.code for p in PYTHON_BLOCKS)
    ]
    assert not orphans, f"Output blocks with no python block right before them: {orphans}"


def test_most_examples_run_here() -> None:
    """Skipping is for hardware this machine lacks, not a way out of a failing example."""
    skipped = [b for b in PYTHON_BLOCKS if b.skip_reason]
    print(
        f"{len(PYTHON_BLOCKS)} python blocks: {len(PYTHON_BLOCKS) - len(skipped)} run, "
        f"{len(skipped)} marked as not runnable here"
    )
    assert PYTHON_BLOCKS, "no python block found in the documentation"
    assert len(skipped) * 2 < len(PYTHON_BLOCKS), [b.name for b in skipped]


def test_extraction_reads_markers_outputs_and_indented_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n"
        "```python\nprint('a')\n```\n\n"
        '```text title="Output"\na\n```\n'
        "<!-- docs-test: skip (needs a TPU) -->\n"
        "```python\nimport torch_xla\n```\n"
        "- a list item:\n\n"
        "    ```python\n    x = 1\n    print(x)\n    ```\n"
        "```bash\nmake test\n```\n",
        encoding="utf-8",
    )
    blocks = [b for b in extract_blocks(page) if b.language == "python"]
    assert [b.code for b in blocks] == ["print('a')\n", "import torch_xla\n", "x = 1\nprint(x)\n"]
    assert blocks[0].output == "a\n"
    assert [b.skip_reason for b in blocks] == [None, "needs a TPU", None]
    assert output_pattern("pid ... ended\nok").fullmatch("pid 42 ended\nok")
    assert not output_pattern("pid ... ended").fullmatch("pid 42 crashed")


def test_the_launcher_page_shows_the_real_signatures() -> None:
    """docs/launcher.md lists every argument with its default; the code must agree."""
    import inspect

    import notebook_launcher

    block = next(b for b in PYTHON_BLOCKS if b.page.name == "launcher.md")
    documented: dict[str, object] = {}
    exec(block.code, documented)
    for name in ("notebook_launcher", "debug_launcher"):
        real = inspect.signature(getattr(notebook_launcher, name))
        shown = inspect.signature(documented[name])  # type: ignore[arg-type]

        def shape(sig: inspect.Signature) -> list[tuple[str, object, object]]:
            return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

        assert sorted(shape(shown), key=str) == sorted(shape(real), key=str), name
        positional = [p.name for p in real.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [
            p.name for p in shown.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
        ] == positional
