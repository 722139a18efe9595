"""The training core's exceptions: one base class, a few named cases.

Each also derives from the builtin a caller would catch without knowing this package
(``ValueError`` for a bad setting, ``ImportError`` for a missing optional package).
"""

from __future__ import annotations


class AcceleratorError(Exception):
    """Base of every error the training core raises about its use."""


class MixedPrecisionError(AcceleratorError, ValueError):
    """The precision asked for is unknown or cannot run on this device."""


class RankEnvironmentError(AcceleratorError, ValueError):
    """The rank variables (RANK, WORLD_SIZE, ...) are missing, malformed or inconsistent."""


class ShardingError(AcceleratorError, ValueError):
    """A data loader cannot be split across the ranks as configured."""


class MissingDependencyError(AcceleratorError, ImportError):
    """An optional package a chosen feature needs is not installed."""
