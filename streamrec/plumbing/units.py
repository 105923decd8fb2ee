"""Sizes in configuration: ``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` or a number of bytes."""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class SizeError(ValueError):
    """A size that does not parse."""


def parse_bytes(value: int | str, name: str) -> int:
    """``4294967296``, ``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` -> bytes (GiB/MiB/KiB binary,
    GB/MB/KB decimal)."""
    if isinstance(value, bool):
        raise SizeError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in UNITS:
            raise SizeError(f"{name} must be a size like 512MiB, 4GiB, 1.5GB or a number of bytes, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise SizeError(f"{name} must be >= 0, got {value!r}")
    return int(number * UNITS[unit])
