"""Length-framed canonical encoding: the one byte format every identity hashes.

Each value becomes ``tag (1 byte) || length (u64 little-endian) || payload``:

    b"s"  str    UTF-8 bytes
    b"i"  int    the integer as signed 8-byte little-endian
    b"b"  bool   one byte, 0 or 1
    b"n"  None   empty payload
    b"l"  list   concatenated encodings of the items (tuples count as lists)

Why framing instead of joining strings: ``["ab", "c"]`` and ``["a", "bc"]``
must not hash alike, and neither must ``""`` and ``None`` or ``1`` and
``"1"``. The encoding is injective and has no dict ordering, so every reader
on every node computes the same bytes for the same fields.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

Framable = str | int | bool | None | Sequence["Framable"]


def frame(value: Framable) -> bytes:
    """Canonical bytes of ``value`` (see the module docstring)."""
    out = bytearray()
    _frame_into(out, value)
    return bytes(out)


def _frame_into(out: bytearray, value: Framable) -> None:
    if value is None:
        out += b"n" + struct.pack("<Q", 0)
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out += b"b" + struct.pack("<QB", 1, int(value))
    elif isinstance(value, int):
        out += b"i" + struct.pack("<Qq", 8, value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + struct.pack("<Q", len(data)) + data
    elif isinstance(value, (list, tuple)):
        inner = bytearray()
        for item in value:
            _frame_into(inner, item)
        out += b"l" + struct.pack("<Q", len(inner)) + inner
    else:
        raise TypeError(f"cannot frame {type(value).__name__}")
