"""Recognising the progress bars that ranks print with plain ``tqdm``.

A rank's ``tqdm(...)`` bar arrives as text redrawn with ``\\r``; its standard format
(``desc: 45%|####5     | 45/100 [00:01<00:01, 40.2it/s]``, or ``desc: 45it [00:01,
40.2it/s]`` without a total) is parsed here, so a loop that already uses tqdm gets a
progress row in the dashboard without any change. Pure functions only.
"""

from __future__ import annotations

import dataclasses
import re

# tqdm's scaled counts ("12.3M") use SI prefixes; without unit_scale they are integers.
_COUNT = r"\d+(?:\.\d+)?[kMGTPEZY]?"
_WITH_TOTAL = re.compile(
    r"^(?:(?P<desc>.*?): )?\s*(?P<percent>\d{1,3})%\|[^|]*\| "
    rf"(?P<n>{_COUNT})/(?P<total>{_COUNT}) "
    r"\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:?]+), (?P<rate>[^,\]]*)(?:, (?P<postfix>[^\]]*))?\]\s*$"
)
_WITHOUT_TOTAL = re.compile(
    rf"^(?:(?P<desc>.*?): )?(?P<n>{_COUNT})(?P<unit>[^\s\[\]]*) "
    r"\[(?P<elapsed>[\d:]+), (?P<rate>[^,\]]*)(?:, (?P<postfix>[^\]]*))?\]\s*$"
)
_SCALE = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}


@dataclasses.dataclass(frozen=True)
class TextProgress:
    """One state of a printed bar, as numbers."""

    n: float
    total: float | None
    description: str
    rate: str  # as tqdm printed it, e.g. "40.2it/s" ("?it/s" before the first update)
    remaining: str | None  # "00:01", or None when the total is unknown


def parse_progress_line(text: str) -> TextProgress | None:
    """The bar's state if ``text`` is a line in tqdm's standard format, else None."""
    if "[" not in text or "]" not in text:  # cheap rejection of ordinary lines
        return None
    match = _WITH_TOTAL.match(text)
    if match is not None:
        return TextProgress(
            n=_count(match["n"]),
            total=_count(match["total"]),
            description=(match["desc"] or "").strip(),
            rate=match["rate"].strip(),
            remaining=match["remaining"],
        )
    match = _WITHOUT_TOTAL.match(text)
    if match is not None:
        return TextProgress(
            n=_count(match["n"]),
            total=None,
            description=(match["desc"] or "").strip(),
            rate=match["rate"].strip(),
            remaining=None,
        )
    return None


def _count(text: str) -> float:
    if text[-1] in _SCALE:
        return float(text[:-1]) * _SCALE[text[-1]]
    return float(text)
