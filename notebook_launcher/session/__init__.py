"""Ranks that stay alive across cells: :class:`Session` and the ``%distributed`` magics."""

from __future__ import annotations

from notebook_launcher.session.session import Session

__all__ = ["Session"]
