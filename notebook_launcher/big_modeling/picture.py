"""The plan, drawn: one bar per device with its budget and the blocks it holds, coloured by
device, the largest block marked; the room each device has left (for the KV cache), and
the bytes each forward brings in from the CPU and the disk. HTML in a notebook, text in a script. Every module name is
escaped (and kept from MathJax), so a name with ``<img onerror>`` or ``$`` shows as written."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from notebook_launcher.big_modeling.sizes import format_bytes

_COLOURS = {"cpu": "#e8892b", "disk": "#7a7f87"}
_GPU_COLOURS = (
    "#2f6fde",
    "#2a9d5b",
    "#8e44ad",
    "#c0392b",
    "#16a2b8",
    "#b8860b",
    "#d6336c",
    "#5c6bc0",
)
_SHOWN_NAMES = 12


@dataclass
class DeviceRow:
    device: str
    budget: int | None  # None: no limit (the disk)
    blocks: list[tuple[str, int]]

    @property
    def used(self) -> int:
        return sum(size for _name, size in self.blocks)

    @property
    def room(self) -> int | None:
        """What the budget leaves beside the weights: the room for the KV cache and activations."""
        return None if self.budget is None else max(0, self.budget - self.used)


def moved_per_forward(all_rows: list[DeviceRow]) -> tuple[int, int]:
    """Bytes of weights each forward brings in: (from CPU memory, from disk). CPU blocks
    move only where a GPU runs them; disk blocks are read every forward."""
    gpus = any(r.device.startswith("cuda:") and r.blocks for r in all_rows)
    cpu = sum(r.used for r in all_rows if r.device == "cpu") if gpus else 0
    disk = sum(r.used for r in all_rows if r.device == "disk")
    return cpu, disk


def _moves(all_rows: list[DeviceRow]) -> str:
    cpu, disk = moved_per_forward(all_rows)
    parts = [f"reads {format_bytes(disk)} from disk"] if disk else []
    parts += [f"copies {format_bytes(cpu)} from CPU memory to the GPU"] if cpu else []
    return "Each forward " + " and ".join(parts) + "." if parts else ""


def _room(row: DeviceRow, all_rows: list[DeviceRow]) -> str:
    """The room a device has left; the KV cache sits where the layers run: the GPUs, or the
    CPU when no GPU is used."""
    if row.room is None:
        return ""
    gpus = any(r.device.startswith("cuda:") and r.blocks for r in all_rows)
    runs_layers = row.device.startswith("cuda:") or not gpus
    return f"{format_bytes(row.room)} {'left for the KV cache' if runs_layers else 'free'}"


def colour(device: str) -> str:
    if device.startswith("cuda:"):
        return _GPU_COLOURS[int(device[5:]) % len(_GPU_COLOURS)]
    return _COLOURS.get(device, "#999999")


def rows(
    device_map: Mapping[str, str], sizes: Mapping[str, int], budgets: Mapping[str, int]
) -> list[DeviceRow]:
    order: dict[str, DeviceRow] = {}
    for device in budgets:
        if device != "disk":
            order[device] = DeviceRow(device, budgets[device], [])
    for name, device in device_map.items():
        device = str(device)
        if device not in order:
            order[device] = DeviceRow(device, budgets.get(device) if device != "disk" else None, [])
        order[device].blocks.append((name, int(sizes.get(name, 0))))
    return list(order.values())


def _largest(all_rows: list[DeviceRow]) -> str | None:
    blocks = [b for row in all_rows for b in row.blocks]
    return max(blocks, key=lambda b: b[1])[0] if blocks else None


def _label(name: str) -> str:
    return name if name else "(whole model)"


def plan_text(device_map: Any) -> str:
    """One line per device: a bar of its budget, what it holds, then its blocks."""
    all_rows = rows(
        device_map, getattr(device_map, "sizes", {}), getattr(device_map, "budgets", {})
    )
    largest = _largest(all_rows)
    total = sum(r.used for r in all_rows)
    lines = [
        f"Device map: {_count(len(device_map))}, {format_bytes(total)} of weights (* the largest block)"
    ]
    width = max([len(r.device) for r in all_rows] + [4])
    for row in all_rows:
        scale = row.budget if row.budget else max(row.used, 1)
        filled = min(20, round(20 * row.used / scale)) if scale else 0
        bar = "#" * filled + "." * (20 - filled)
        limit = f"of {format_bytes(row.budget)}" if row.budget is not None else "(no limit)"
        if _room(row, all_rows):
            limit += f", {_room(row, all_rows)}"
        names = [(_label(n) + ("*" if n == largest else "")) for n, _s in row.blocks]
        shown = ", ".join(names[:_SHOWN_NAMES]) + (
            f", ... ({len(names)} blocks)" if len(names) > _SHOWN_NAMES else ""
        )
        lines.append(
            f"{row.device:<{width}} [{bar}] {format_bytes(row.used)} {limit}: {shown or 'nothing'}"
        )
    if _moves(all_rows):
        lines.append(_moves(all_rows))
    return "\n".join(_printable(line) for line in lines)


def _printable(text: str) -> str:
    # Control characters (ANSI colour codes in a name) would repaint the terminal.
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def plan_html(device_map: Any) -> str:
    """The plan as HTML: bars scaled to each device's budget, blocks coloured by device."""
    all_rows = rows(
        device_map, getattr(device_map, "sizes", {}), getattr(device_map, "budgets", {})
    )
    largest = _largest(all_rows)
    total = sum(r.used for r in all_rows)
    esc = _escape
    parts = [
        '<div class="nl-device-map tex2jax_ignore mathjax_ignore" style="font-family:system-ui,'
        'sans-serif;font-size:13px;max-width:760px">',
        f'<div style="margin-bottom:6px"><b>Device map</b>: {_count(len(device_map))}, '
        f"{esc(format_bytes(total))} of weights. &#9733; marks the largest block"
        f"{': <code>' + esc(_label(largest)) + '</code>' if largest is not None else ''}."
        f"{' ' + esc(_moves(all_rows)) if _moves(all_rows) else ''}</div>",
    ]
    for row in all_rows:
        scale = max(row.budget or 0, row.used, 1)
        limit = f"of {format_bytes(row.budget)}" if row.budget is not None else "no limit"
        over = row.budget is not None and row.used > row.budget
        parts.append('<div style="display:flex;align-items:center;gap:8px;margin:3px 0">')
        parts.append(f'<div style="width:64px;font-weight:600">{esc(row.device)}</div>')
        parts.append(
            '<div style="flex:1;height:22px;background:#eef0f3;border:1px solid #c8ccd2;'
            'display:flex;overflow:hidden" role="img" '
            f'aria-label="{esc(row.device)}: {esc(format_bytes(row.used))} {esc(limit)}">'
        )
        for position, (name, size) in enumerate(row.blocks):
            share = 100.0 * size / scale
            mark = name == largest
            shade = "filter:brightness(0.88);" if position % 2 else ""
            border = "outline:2px solid #111;outline-offset:-2px;" if mark else ""
            title = f"{_label(name)}: {format_bytes(size)}" + (" (largest block)" if mark else "")
            star = (
                (
                    '<span style="color:#fff;font-size:12px;line-height:22px;padding-left:2px">'
                    "&#9733;</span>"
                )
                if mark
                else ""
            )
            parts.append(
                f'<div title="{esc(title)}" style="width:{share:.3f}%;min-width:1px;'
                f'background:{colour(row.device)};{shade}{border}">{star}</div>'
            )
        parts.append("</div>")
        room = (
            f'<br><span style="color:#444">{esc(_room(row, all_rows))}</span>'
            if _room(row, all_rows)
            else ""
        )
        parts.append(
            f'<div style="width:190px;{"color:#b00020;" if over else ""}">'
            f"{esc(format_bytes(row.used))} {esc(limit)}{room}</div></div>"
        )
        names = [(("&#9733; " if n == largest else "") + esc(_label(n))) for n, _s in row.blocks]
        shown = ", ".join(names[:_SHOWN_NAMES])
        if len(names) > _SHOWN_NAMES:
            shown += f", &hellip; ({len(names)} blocks)"
        parts.append(
            f'<div style="margin:0 0 6px 72px;color:#444;font-size:12px">{shown or "nothing"}</div>'
        )
    parts.append("</div>")
    return "".join(parts)


def _escape(text: str) -> str:
    # html.escape for markup; "$" as an entity too, and the tex2jax_ignore class on the
    # container, so that a "$" in a module name is never typeset as mathematics.
    return html.escape(_printable(text), quote=True).replace("$", "&#36;")


def _count(blocks: int) -> str:
    return f"{blocks} block" if blocks == 1 else f"{blocks} blocks"
