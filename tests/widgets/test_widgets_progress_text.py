"""Plain tqdm bars printed by ranks are recognised from their standard text format."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from notebook_launcher.widgets.progress_text import TextProgress, parse_progress_line


def drawn(n: int, **options) -> list[str]:
    """The states tqdm itself draws for a bar advanced to ``n`` (redraws and final line)."""
    out = io.StringIO()
    bar = tqdm(file=out, mininterval=0, **options)
    bar.update(n)
    bar.refresh()
    bar.close()
    return [state.strip("\n") for state in out.getvalue().split("\r") if state.strip()]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"total": 100}, (45, 100, "")),
        ({"total": 100, "desc": "train"}, (45, 100, "train")),
        ({"total": 100, "ascii": True}, (45, 100, "")),
        ({"total": 50, "unit": "batch"}, (45, 50, "")),
        ({"total": 100, "postfix": {"loss": 0.5}}, (45, 100, "")),
        ({"total": 12_345_678, "unit_scale": True}, (45, 12_300_000, "")),
        ({}, (45, None, "")),
        ({"desc": "epoch 1: warm-up"}, (45, None, "epoch 1: warm-up")),
    ],
)
def test_every_state_tqdm_draws_is_read_back_as_numbers(options, expected):
    states = drawn(45, **options)
    parsed = [parse_progress_line(state) for state in states]
    assert None not in parsed, states
    last = parsed[-1]
    assert (last.n, last.total, last.description) == expected


def test_the_state_before_the_first_update_has_no_rate_yet():
    first = drawn(0, total=30)[0]
    assert parse_progress_line(first) == TextProgress(0, 30, "", "?it/s", "?")


def test_the_rate_and_remaining_time_are_kept_as_printed():
    parsed = parse_progress_line(
        "train:  45%|####5     | 45/100 [00:01<00:01, 40.20it/s, loss=0.3]"
    )
    assert parsed == TextProgress(45, 100, "train", "40.20it/s", "00:01")


@pytest.mark.parametrize(
    "line",
    [
        "epoch 3: loss 0.25",
        "[rank0]: hello",
        "see [docs] for more",
        "100% done",
        "Traceback (most recent call last):",
        "45 items [in the list]",
        "",
    ],
)
def test_ordinary_lines_are_not_taken_for_progress(line):
    assert parse_progress_line(line) is None
