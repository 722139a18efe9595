"""Which tests the quick tier (``make test-quick``) leaves to ``make test``: real
multi-process scenarios that take over about 5 s on a quiet 2-core machine, each marked
``slow`` with the reason."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

STARTS_PYTHON_AFRESH = (
    "spawn and the forkserver start a fresh Python that imports torch for each rank "
    "(6-11 s a launch on 2 cores)"
)


def fork_quick(methods: Iterable[str]) -> list[Any]:
    """``methods`` for a parametrization: fork stays in the quick tier; the start methods
    that start a fresh Python per rank are marked slow."""
    return [
        method
        if method == "fork"
        else pytest.param(method, marks=pytest.mark.slow(reason=STARTS_PYTHON_AFRESH))
        for method in methods
    ]
