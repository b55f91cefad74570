"""Byte sizes as operators write them: ``64GiB``, ``512MiB``, ``4G``, ``1048576``.

parse_size("1.5GiB")   # 1610612736 (binary units; ValueError naming the text)
format_size(16 << 20)  # "16 MiB"
"""

from __future__ import annotations

import re

SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]i?B?|B)?", re.I)
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
MAX_SIZE = 2**50  # 1 PiB: beyond any pool, and far inside an int64


def parse_size(text: str) -> int:
    """Bytes of ``text``, 0..MAX_SIZE; ValueError naming it otherwise."""
    m = SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a size like 4GiB, 512MiB or 1048576")
    unit = (m.group(2) or "").upper()[:1]
    number = float(m.group(1)) * UNITS[unit if unit != "B" else ""]
    if not number <= MAX_SIZE:  # also inf, from a number too long for a float
        raise ValueError(f"{text!r} is more than {format_size(MAX_SIZE)}")
    return int(number)


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it fills, to 3 significant digits."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = UNITS[unit[0]]
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
