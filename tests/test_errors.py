"""Every error the launcher raises is a LaunchError; the training core's an AcceleratorError."""

from __future__ import annotations

import inspect

from notebook_launcher import defaults, errors


def test_every_launcher_error_derives_from_launch_error() -> None:
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and not issubclass(c, Warning)
    ]
    for cls in classes:
        assert issubclass(cls, (errors.LaunchError, errors.AcceleratorError)), cls
    assert defaults.DefaultsError is errors.DefaultsError
    for cls in (errors.DefaultsError, errors.LaunchUnsupportedError, errors.LaunchTypeError):
        assert issubclass(cls, errors.LaunchConfigError) and issubclass(cls, ValueError)
    assert issubclass(errors.RankInputError, EOFError)
