"""Block hashes in the native format ``kvstore-blake3-v1`` (docs/design.md §6).

local[i] = blake3(little-endian u32 tokens of full block i)[:8]
seq[0]   = local[0]
seq[i]   = blake3(le64(seq[i-1]) || le64(local[i]))[:8]

Each hash is the first 8 bytes of the digest read as a little-endian u64.
Partial blocks are never hashed: a prompt of n tokens yields n // block_size.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import blake3
import numpy as np

HASH_FORMAT = "kvstore-blake3-v1"
# SGLang's HiCache page keys: chained SHA-256 hex strings; kvstore keys a page
# by its first 16 hex digits read as an unsigned 64-bit integer (the same 64
# bits SGLang's KV events publish, there as a signed int64).
SGLANG_HASH_FORMAT = "sglang-sha256-hex16"


def _u64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


def local_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Hash of each full block on its own, before chaining."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = np.asarray(tokens, dtype="<u4")
    full = len(arr) // block_size
    return [
        _u64(blake3.blake3(arr[i * block_size : (i + 1) * block_size].tobytes()).digest())
        for i in range(full)
    ]


def chain(local: Sequence[int]) -> list[int]:
    """Chain local hashes so each hash names its whole prefix."""
    seq: list[int] = []
    for i, h in enumerate(local):
        if i == 0:
            seq.append(h)
        else:
            seq.append(_u64(blake3.blake3(struct.pack("<QQ", seq[-1], h)).digest()))
    return seq


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Chained hashes of every full block of ``tokens``."""
    return chain(local_hashes(tokens, block_size))
