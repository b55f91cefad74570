"""How a worker's paged KV cache is shaped: layout kinds and in-block byte orders.

One home for the shapes every process agrees on (``docs/design.md`` §1):

    kind          tensor shape                         segments in a slot
    kv_first      [2, num_blocks, *inner]              2 (K, then V)
    blocks_first  [num_blocks, 2, *inner]              1 (K and V inside the block)
    mla           [num_blocks, block_size, head_dim]   1
    paged         [num_blocks, *cell]                  1 (any dense block)

where ``inner`` is ``[block_size, heads, head_dim]`` for the NHD byte order and
``[heads, block_size, head_dim]`` for HND. ``paged`` is vLLM's standardised
per-layer view (vLLM >= 0.32): ``cell`` is ``[heads, block_size, 2 * head_dim]``
with K and V packed in one cell, its ``kv_layout`` names vLLM's whole-cache
layout and the manager/kernel block ratio (:func:`paged_layout`), and its
layers may sit at any offset inside one shared buffer. A kind's ``proto``
value is its ``KVLayoutKind`` number in ``proto/store.proto`` (a test checks
they agree).
"""

from __future__ import annotations

import enum
import re

# vLLM's KVCacheLayout names (L layer, B block, H head, N token, C K+V cell);
# LBHNC is what its CPU backend uses, LBNHC its GPU default.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
MAX_BLOCK_RATIO = 64
_PAGED_RE = re.compile(rf"({'|'.join(VLLM_LAYOUTS)})/([1-9][0-9]?)")


def paged_layout(vllm_layout: str, block_ratio: int = 1) -> str:
    """The ``kv_layout`` of a paged layer: vLLM's layout name and its block ratio.

    ``block_ratio`` is how many kernel blocks make one scheduler block (vLLM
    registers kernel-granular views when the two sizes differ); both are part
    of the layout fingerprint, so engines that differ in either never share.
    """
    value = f"{vllm_layout}/{block_ratio}"
    if not is_paged_layout(value):
        raise ValueError(
            f"paged layout {value!r}: layout must be one of {VLLM_LAYOUTS}, "
            f"block_ratio in [1, {MAX_BLOCK_RATIO}]"
        )
    return value


def is_paged_layout(value: str) -> bool:
    m = _PAGED_RE.fullmatch(value)
    return m is not None and int(m.group(2)) <= MAX_BLOCK_RATIO


class LayoutKind(enum.Enum):
    """Where the block dimension sits in a layer's KV tensor."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"
    MLA = "mla"
    PAGED = "paged"

    @property
    def segments(self) -> int:
        """Segments of this kind in one slot: K and V apart (2) or together (1)."""
        return 2 if self is LayoutKind.KV_FIRST else 1

    def accepts(self, kv_layout: str) -> bool:
        """True when ``kv_layout`` is a byte order this kind may declare."""
        if self is LayoutKind.PAGED:
            return is_paged_layout(kv_layout)
        if self is LayoutKind.MLA:
            return kv_layout == "MLA"
        return kv_layout in ("NHD", "HND")

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
        if self is LayoutKind.PAGED:
            if kv_layout.startswith("LBNHC") or kv_layout.startswith("BLNHC"):
                return (num_blocks, block_size, heads, 2 * head_dim)
            return (num_blocks, heads, block_size, 2 * head_dim)
        inner = (
            (block_size, heads, head_dim) if kv_layout == "NHD" else (heads, block_size, head_dim)
        )
        if self is LayoutKind.KV_FIRST:
            return (2, num_blocks, *inner)
        return (num_blocks, 2, *inner)


KINDS = tuple(k.value for k in LayoutKind)
_PROTO = {
    LayoutKind.KV_FIRST: 1,
    LayoutKind.BLOCKS_FIRST: 2,
    LayoutKind.MLA: 3,
    LayoutKind.PAGED: 4,
}
_FROM_PROTO = {v: k for k, v in _PROTO.items()}
