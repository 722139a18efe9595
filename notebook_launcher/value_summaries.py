"""What a rank sends back when a value is shown: a small summary, computed on the rank.

A tensor of any size becomes its shape, dtype, device, a few statistics, a digest of its
full contents (so the kernel can tell equal values from different ones without seeing
them), every element when it is small, and a picture of at most ``GRID_ROWS`` x
``GRID_COLS`` block means when it is not. So showing a 10-million-element tensor moves a
few kilobytes, not 40 MB. Other values become their text, cut. Summaries hold only plain
Python values and are pickled by reference to this module, so they load in the kernel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

SMALL = 64  # tensors up to this many elements send every element
GRID_ROWS = 16
GRID_COLS = 32
BARS = 64  # a 1-D tensor is drawn as up to this many bars
TEXT_LIMIT = 300  # characters of a string or repr that travel
_NAME = re.compile(r"[A-Za-z_]\w*(\.\w+)*\Z")


@dataclasses.dataclass(frozen=True)
class ValueSummary:
    """One rank's value of one name, as the inspector draws it."""

    name: str
    rank: int
    kind: str  # "tensor", "number", "text", "object", "missing"
    type_name: str = ""
    text: str = ""  # a number's or string's text, an object's repr (cut), or why it is missing
    key: str = ""  # equal keys on two ranks mean equal values
    shape: tuple[int, ...] = ()
    dtype: str = ""
    device: str = ""
    numel: int = 0
    elements: tuple[str, ...] = ()  # every element as text (small tensors), row-major
    grid: tuple[tuple[float, ...], ...] = ()  # the picture: rows of numbers (NaN and inf kept)
    grid_note: str = ""  # what one cell of the picture is, when not one element
    minimum: float | None = None  # over the finite values (absolute values for complex)
    maximum: float | None = None
    mean: float | None = None
    nan: int = 0
    inf: int = 0
    note: str = ""  # e.g. which shard of a sharded tensor this rank holds

    @property
    def present(self) -> bool:
        return self.kind != "missing"


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """Names or dotted attribute paths (``model.weight.grad``); anything else is refused."""
    from notebook_launcher.errors import LaunchTypeError

    if isinstance(names, str):
        names = [names]
    checked = tuple(names)
    bad = [n for n in checked if not isinstance(n, str) or not _NAME.match(n)]
    if bad or not checked:
        raise LaunchTypeError(
            f"show() takes names of the ranks' variables, such as 'total' or 'model.weight'; "
            f"got {list(bad) if bad else list(checked)!r}."
        )
    return checked


def summarize_names(namespace: dict[str, Any], names: Sequence[str]) -> list[ValueSummary]:
    """Rank side: one summary per name, looked up in the rank's namespace."""
    rank = int(os.environ.get("RANK", "0"))  # the namespace's own ``rank`` may be rebound
    return [summarize_name(namespace, name, rank) for name in names]


def summarize_name(namespace: dict[str, Any], name: str, rank: int) -> ValueSummary:
    head, *attributes = name.split(".")
    if head not in namespace:
        return ValueSummary(name, rank, "missing", text=f"{head} is not defined on rank {rank}")
    value = namespace[head]
    for depth, attribute in enumerate(attributes):
        try:
            value = getattr(value, attribute)
        except Exception as error:
            where = ".".join([head, *attributes[:depth]])
            why = (
                f"{where} has no attribute {attribute}"
                if isinstance(error, AttributeError)
                else f"reading {where}.{attribute} raised {type(error).__name__}"
            )
            return ValueSummary(name, rank, "missing", text=f"{why} on rank {rank}")
    try:
        return summarize(value, name, rank)
    except Exception as error:  # a value whose own methods fail still gets a card
        return _object(value, name, rank, f" (could not be summarised: {type(error).__name__})")


def summarize(value: Any, name: str = "", rank: int = 0) -> ValueSummary:
    import sys

    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor(torch, value, name, rank)
    if numpy is not None and isinstance(value, numpy.ndarray) and torch is not None:
        try:
            tensor = torch.from_numpy(value)
        except (TypeError, ValueError):
            return _object(value, name, rank)
        return dataclasses.replace(
            _tensor(torch, tensor, name, rank), type_name="ndarray", device="numpy"
        )
    if isinstance(value, numbers.Number):
        text = repr(value)
        return ValueSummary(
            name,
            rank,
            "number",
            type(value).__name__,
            _cut(text),
            key=_digest(f"{type(value).__name__}:{text}".encode()),
        )
    if isinstance(value, str):
        return ValueSummary(
            name,
            rank,
            "text",
            "str",
            _cut(value),
            key=_digest(b"str:" + value.encode("utf-8", "surrogatepass")),
        )
    return _object(value, name, rank)


def _object(value: Any, name: str, rank: int, why: str = "") -> ValueSummary:
    try:
        text = repr(value)
    except Exception as error:
        text = f"<{type(value).__name__} (repr failed: {type(error).__name__})>"
    return ValueSummary(
        name,
        rank,
        "object",
        type(value).__name__,
        _cut(text) + why,
        key=_digest(f"{type(value).__qualname__}:{text}".encode("utf-8", "surrogatepass")),
    )


def _cut(text: str) -> str:
    # Lone surrogates (undecodable bytes a str carries) could not be sent as JSON to the
    # frontend: written as escapes instead.
    cut = text if len(text) <= TEXT_LIMIT else f"{text[:TEXT_LIMIT]}… ({len(text):,} characters)"
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def _digest(data: Any) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _tensor(torch: Any, value: Any, name: str, rank: int) -> ValueSummary:
    note = ""
    type_name = type(value).__name__
    if hasattr(value, "to_local") and hasattr(value, "placements"):  # a DTensor (FSDP2, TP)
        placements = ", ".join(repr(p) for p in value.placements)
        note = f"local shard of {tuple(value.shape)} ({placements})"
        value = value.to_local()
    device = str(value.device)
    tensor = value.detach()
    if tensor.is_sparse or tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.cpu().contiguous()
    shape = tuple(tensor.shape)
    numel = tensor.numel()
    flat = tensor.reshape(-1)
    raw = flat.view(torch.uint8) if numel else flat
    hasher = hashlib.sha1(f"{tensor.dtype}{shape}".encode())
    if numel:
        hasher.update(memoryview(raw.numpy()))
    if tensor.is_complex():
        real = tensor.abs()
    elif tensor.dtype == torch.bool:
        real = tensor.to(torch.uint8)
    else:
        real = tensor
    work = real.double() if real.dtype == torch.float64 else real.float()
    stats: dict[str, float | None] = {"minimum": None, "maximum": None, "mean": None}
    nan = inf = 0
    if numel:
        # min and max carry a NaN through, so finite ends mean every element is finite:
        # the common case costs two passes over the tensor, not five.
        low, high = (float(v) for v in torch.aminmax(work))
        good = work
        if not (math.isfinite(low) and math.isfinite(high)):
            finite = torch.isfinite(work)
            nan = int(torch.isnan(work).sum())
            inf = numel - nan - int(finite.sum())
            good = work[finite]
            low, high = (
                (float(v) for v in torch.aminmax(good)) if good.numel() else (math.nan, math.nan)
            )
        if good.numel():
            stats = {"minimum": low, "maximum": high, "mean": float(good.mean())}
    elements: tuple[str, ...] = ()
    if numel <= SMALL:
        elements = tuple(_element(x) for x in flat.tolist())
    grid, grid_note = _grid(torch, work)
    return ValueSummary(
        name,
        rank,
        "tensor",
        type_name,
        key=hasher.hexdigest(),
        shape=shape,
        dtype=str(tensor.dtype).replace("torch.", ""),
        device=device,
        numel=numel,
        elements=elements,
        grid=grid,
        grid_note=grid_note,
        nan=nan,
        inf=inf,
        note=note,
        text=elements[0] if shape == () and elements else "",
        **stats,
    )


def _element(x: Any) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, complex):
        return f"{x.real:.4g}{x.imag:+.4g}j"
    return str(x)


def _grid(torch: Any, work: Any) -> tuple[tuple[tuple[float, ...], ...], str]:
    """At most GRID_ROWS x GRID_COLS numbers (BARS for 1-D): the elements, or block means."""
    if work.dim() == 0 or work.numel() == 0:
        return (), ""
    if work.dim() == 1:
        rows, cols = 1, work.shape[0]
        plane = work.reshape(1, cols)
        target = (1, min(cols, BARS))
    else:
        cols = work.shape[-1]
        rows = work.numel() // cols
        plane = work.reshape(rows, cols)
        target = (min(rows, GRID_ROWS), min(cols, GRID_COLS))
    if target != (rows, cols):
        # adaptive_avg_pool2d: block means for any size; a NaN stays visible in its block.
        plane = torch.nn.functional.adaptive_avg_pool2d(plane[None, None], target)[0, 0]
        note = f"each cell the mean of about {math.ceil(rows / target[0])}x{math.ceil(cols / target[1])} elements"
        if work.dim() == 1:
            note = f"each bar the mean of about {math.ceil(cols / target[1]):,} elements"
    else:
        note = ""
    if work.dim() > 2:
        note = (note + "; " if note else "") + f"drawn as {rows} rows of the last dimension"
    return tuple(tuple(row) for row in plane.tolist()), note


class _Executes(Protocol):
    """What :func:`collect` needs of a session (a Protocol: this module sits below it)."""

    returned: dict[str, Any]
    returned_rank: int | None

    def execute(
        self, code: str, ranks: Sequence[int] | None = None, *, filename: str | None = None
    ) -> list[Any]: ...


def collect(
    session: _Executes, names: Sequence[str], ranks: Sequence[int] | None = None
) -> dict[str, list[ValueSummary]]:
    """Kernel side: every target rank's summary of each name, in rank order."""
    checked = check_names(names)
    # Through an ordinary execute: the summary is the cell's last expression.
    code = (
        "__import__('notebook_launcher.value_summaries', fromlist=['summarize_names'])"
        f".summarize_names(globals(), {checked!r})"
    )
    saved = session.returned, session.returned_rank
    try:
        per_rank = session.execute(code, ranks, filename="<show>")
    finally:
        session.returned, session.returned_rank = saved
    return {name: [summaries[i] for summaries in per_rank] for i, name in enumerate(checked)}
