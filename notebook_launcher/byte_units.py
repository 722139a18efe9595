"""Bytes in each unit a size string may name ("40MB", "2GiB"): MB = 10**6 bytes, MiB = 2**20.

One table for the training core's shard sizes and the big models' memory budgets.
"""

from __future__ import annotations

BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
