"""How a worker's paged KV cache is shaped: layout kinds and in-block byte orders.

One home for the shapes every process agrees on (``docs/design.md`` §1):

    kind          tensor shape                         segments in a slot
    kv_first      [2, num_blocks, *inner]              2 (K, then V)
    blocks_first  [num_blocks, 2, *inner]              1 (K and V inside the block)
    mla           [num_blocks, block_size, head_dim]   1

where ``inner`` is ``[block_size, heads, head_dim]`` for the NHD byte order and
``[heads, block_size, head_dim]`` for HND. A kind's ``proto`` value is its
``KVLayoutKind`` number in ``proto/store.proto`` (a test checks they agree).
"""

from __future__ import annotations

import enum

KV_LAYOUTS = ("NHD", "HND", "MLA")


class LayoutKind(enum.Enum):
    """Where the block dimension sits in a layer's KV tensor."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"
    MLA = "mla"

    @property
    def segments(self) -> int:
        """Segments of this kind in one slot: K and V apart (2) or together (1)."""
        return 2 if self is LayoutKind.KV_FIRST else 1

    @property
    def proto(self) -> int:
        return _PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> LayoutKind | None:
        """The kind of a proto enum value, or None when unset or unknown."""
        return _FROM_PROTO.get(value)

    def shape(
        self, num_blocks: int, block_size: int, heads: int, head_dim: int, kv_layout: str = "NHD"
    ) -> tuple[int, ...]:
        """The KV tensor shape of one layer with this kind (see the module docstring)."""
        if self is LayoutKind.MLA:
            return (num_blocks, block_size, head_dim)
        inner = (
            (block_size, heads, head_dim) if kv_layout == "NHD" else (heads, block_size, head_dim)
        )
        if self is LayoutKind.KV_FIRST:
            return (2, num_blocks, *inner)
        return (num_blocks, 2, *inner)


KINDS = tuple(k.value for k in LayoutKind)
_PROTO = {LayoutKind.KV_FIRST: 1, LayoutKind.BLOCKS_FIRST: 2, LayoutKind.MLA: 3}
_FROM_PROTO = {v: k for k, v in _PROTO.items()}
