"""Layer geometry and the layout fingerprint (docs/design.md §1).

The fingerprint is the block-compatibility identity: two workers may share a
block only if their fingerprints match. It is a canonical msgpack encoding
(lists only, no maps, so no ordering ambiguity) hashed with BLAKE3, so every
node computes the same value for the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import msgpack

FINGERPRINT_TAG = "kvstore/layout/v1"


@dataclass(frozen=True)
class LayerGeometry:
    """What must agree across ranks for one layer, and enters the fingerprint."""

    name: str
    dtype: str
    bytes_per_block: int
    segments: int
    kv_layout: str

    def row(self) -> list:
        return [self.name, self.dtype, self.bytes_per_block, self.segments, self.kv_layout]


def fingerprint(
    block_size: int, hash_format: str, tp_size: int, layers: list[LayerGeometry]
) -> str:
    """16 hex chars of BLAKE3 over the canonical layout encoding."""
    rows = [g.row() for g in sorted(layers, key=lambda g: g.name)]
    payload = msgpack.packb(
        [FINGERPRINT_TAG, block_size, hash_format, tp_size, rows], use_bin_type=True
    )
    return blake3.blake3(payload).hexdigest()[:16]
