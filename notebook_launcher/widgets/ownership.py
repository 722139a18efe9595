"""Who owns which part of a tensor: the whole tensor, each element coloured by its rank.

The picture torch's ``visualize_sharding`` and JAX's ``visualize_array_sharding`` draw as
text tables: the global tensor, with each element in the colour of the rank that holds it,
then one copy per rank with that rank's part highlighted and the rest faded. It is built
from plain facts (a shape and, per element, the ranks that hold it), so it serves a
``DTensor``'s ``Shard`` placement (see :func:`from_shards`) as well as a data loader's
strided or contiguous split of a data set (see :func:`Ownership.from_indices`).
Like the inspector, it is an ordinary display output: HTML with the pictures as SVG images,
and a plain-text twin.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Iterable, Mapping, Sequence

# One colour per rank, then repeated. None is blue or red, nor near them: in the inspector blue
# and red are a value's sign (white at zero), and a rank must never read as a value.
RANK_COLOURS = (
    "#e69f00",  # orange
    "#009e73",  # bluish green
    "#8a5fb8",  # violet
    "#b5b51c",  # olive
    "#00b3a0",  # turquoise
    "#f0e442",  # yellow
    "#7a5c1e",  # umber
    "#66a61e",  # leaf green
)
SEVERAL_COLOUR = "#6b6b6b"  # an element held by more than one rank (replicated, padded)
NOBODY_COLOUR = "#ffffff"
_MAX_ROWS = 16
_MAX_COLS = 32
_WIDTH = 240


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


class Ownership:
    """A tensor's elements and the ranks holding each.

    ``holders`` is row-major: for each element of ``shape``, the ranks that hold it.
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        holders: Sequence[frozenset[int]],
        ranks: Sequence[int],
    ) -> None:
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        if math.prod(self.shape) != len(holders):
            raise ValueError(
                f"{name}: {len(holders)} owners given for shape {self.shape} ({math.prod(self.shape)} elements)"
            )
        self.holders = list(holders)
        self.ranks = sorted(ranks)

    @classmethod
    def from_indices(
        cls, name: str, shape: int | Sequence[int], per_rank: Sequence[Iterable[int]]
    ) -> Ownership:
        """Rank ``r`` holds the elements ``per_rank[r]`` (flat, row-major indices), e.g. the
        sample indices a ``DistributedSampler`` gave each rank, gathered from the ranks."""
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        holders: list[set[int]] = [set() for _ in range(math.prod(dims))]
        for rank, indices in enumerate(per_rank):
            for index in indices:
                holders[int(index)].add(rank)
        return cls(name, dims, [frozenset(h) for h in holders], range(len(per_rank)))

    # What a rank holds, in words ------------------------------------------------------------

    def held_by(self, rank: int) -> list[int]:
        return [i for i, h in enumerate(self.holders) if rank in h]

    def words(self, rank: int) -> str:
        mine = self.held_by(rank)
        return f"{_spans(mine)} ({len(mine)} of {len(self.holders)} elements)"

    def __repr__(self) -> str:
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        shared = sum(len(h) > 1 for h in self.holders)
        unheld = sum(not h for h in self.holders)
        extra = "".join(
            [
                f"; {shared} held by several ranks" if shared else "",
                f"; {unheld} held by none" if unheld else "",
            ]
        )
        lines = [f"{self.name} {shape}: owned by rank{extra}"]
        lines += [f"  rank {r}: {self.words(r)}" for r in self.ranks]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        printer.text(repr(self))  # type: ignore[attr-defined]

    def _repr_html_(self) -> str:
        cards = "".join(
            f'<div class="nl-owned" data-rank="{r}" style="display: inline-block; vertical-align: top; '
            f'margin: 0 8px 8px 0; font-size: 12px;"><div style="font-weight: 600;">rank {r} holds</div>'
            f"{self.picture(highlight=r)}<div>{html.escape(self.words(r))}</div></div>"
            for r in self.ranks
        )
        return (
            '<div class="notebook-launcher-ownership tex2jax_ignore mathjax_ignore" style="font-size: 12.5px; margin: 2px 0;">'
            f'<div style="margin: 4px 0;"><b>{html.escape(self.name)}</b>, the whole tensor, each element '
            f"in the colour of the rank that holds it</div>{self.picture()}{self.legend()}<div>{cards}</div></div>"
        )

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        return {"text/plain": repr(self), "text/html": self._repr_html_()}

    # Pictures -------------------------------------------------------------------------------

    def _grid(self) -> tuple[int, int, int, int]:
        rows, cols = (
            (1, self.shape[0])
            if len(self.shape) == 1
            else (math.prod(self.shape[:-1]), self.shape[-1])
            if self.shape
            else (1, 1)
        )
        return rows, cols, min(rows, _MAX_ROWS), min(cols, _MAX_COLS)

    def cell(self) -> int:
        """The side of one element's square, in pixels: a picture of a part of this tensor
        (a rank's shard) drawn at this size keeps the proportions of the whole."""
        _, _, shown_rows, shown_cols = self._grid()
        return max(4, min(22, _WIDTH // shown_cols, 176 // shown_rows))

    def picture(self, highlight: int | None = None) -> str:
        """The whole tensor; with ``highlight``, that rank's elements full and outlined, the
        others faded."""
        rows, cols, shown_rows, shown_cols = self._grid()
        cell = self.cell()
        label = cell >= 14
        items = []
        for i in range(shown_rows):
            for j in range(shown_cols):
                # One element stands for its block when the tensor is larger than the picture.
                index = (i * rows // shown_rows) * cols + (j * cols // shown_cols)
                holders = self.holders[index]
                fill = _fill(holders)
                mine = highlight is None or highlight in holders
                stroke = (
                    ' stroke="#111" stroke-width="1.5"'
                    if highlight is not None and mine
                    else ' stroke="#fff" stroke-width="0.5"'
                )
                opacity = "" if mine else ' fill-opacity="0.18"'
                items.append(
                    f'<rect x="{j * cell}" y="{i * cell}" width="{cell}" height="{cell}" fill="{fill}"{opacity}{stroke}/>'
                )
                if label and mine and holders:
                    text = str(next(iter(holders))) if len(holders) == 1 else "*"
                    items.append(
                        f'<text x="{j * cell + cell / 2}" y="{i * cell + cell / 2 + 3.5}" font-size="9" '
                        f'font-family="sans-serif" text-anchor="middle" fill="{ink(fill)}">{text}</text>'
                    )
        w, h = shown_cols * cell, shown_rows * cell
        who = f" with rank {highlight}'s part highlighted" if highlight is not None else ""
        return _image(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{"".join(items)}</svg>',
            w,
            h,
            f"ownership of {self.name}{who}",
        )

    def legend(self) -> str:
        keys = [(rank_colour(r), f"rank {r}") for r in self.ranks]
        if any(len(h) > 1 for h in self.holders):
            keys.append((SEVERAL_COLOUR, "several ranks (*)"))
        if any(not h for h in self.holders):
            keys.append((NOBODY_COLOUR, "no rank"))
        return (
            '<div class="nl-legend" style="margin: 2px 0 6px 0;">'
            + "".join(
                f'<span style="display: inline-block; width: 10px; height: 10px; background: {c}; '
                f'border: 1px solid #999; margin: 0 3px 0 8px; vertical-align: middle;"></span>{html.escape(t)}'
                for c, t in keys
            )
            + "</div>"
        )


def from_shards(name: str, shape: Sequence[int], dim: int, sizes: Mapping[int, int]) -> Ownership:
    """A ``Shard(dim)`` placement on a one-dimensional mesh: rank ``r`` (in rank order) holds
    the next ``sizes[r]`` slices along ``dim``, as torch's ``chunk`` splits them."""
    shape = tuple(shape)
    start = 0
    owner_of_slice: list[frozenset[int]] = []
    for rank in sorted(sizes):
        owner_of_slice += [frozenset({rank})] * sizes[rank]
        start += sizes[rank]
    owner_of_slice += [frozenset()] * (shape[dim] - start)
    holders = []
    inner = math.prod(shape[dim + 1 :])
    for flat in range(math.prod(shape)):
        holders.append(owner_of_slice[(flat // inner) % shape[dim]])
    return Ownership(name, shape, holders, sorted(sizes))


def ink(fill: str) -> str:
    """Dark text on light fills (yellow, olive), white on dark ones."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#222" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#fff"


def _fill(holders: frozenset[int]) -> str:
    if not holders:
        return NOBODY_COLOUR
    if len(holders) > 1:
        return SEVERAL_COLOUR
    return rank_colour(next(iter(holders)))


def _spans(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 9] -> "0-2, 5, 7, 9": runs of consecutive indices joined."""
    if not indices:
        return "nothing"
    parts = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "elements " + ", ".join(parts)


def _image(svg: str, width: int, height: int, alt: str) -> str:
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<img class="nl-picture nl-ownership" alt="{html.escape(alt)}" width="{width}" height="{height}" '
        f'style="display: block; margin: 3px 0; border: 1px solid rgba(128,128,128,0.4);" '
        f'src="data:image/svg+xml;base64,{data}">'
    )
