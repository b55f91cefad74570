"""Byte geometry of one layer of a worker's paged KV cache.

The copy engine never looks at dtypes or head layouts: it moves the bytes of
whole block segments as they lie in memory. A `LayerRegion` is everything it
needs to find those bytes, derived once per layer at registration time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.wire.kv_layout import KINDS


@dataclass(frozen=True)
class LayerRegion:
    """Where one layer of one rank's paged KV cache lives, in bytes.

    Inside a slot the layer's bytes are segment 0 of the block, then segment 1:
    a slot holds `slot_bytes = segments * segment_bytes` bytes.
    """

    base: int  # address of the layer tensor's first byte (host or CUDA device pointer)
    num_blocks: int
    segments: int  # 2 for vLLM K/V-first [2, nb, ...]; 1 for blocks-first and MLA
    segment_bytes: int  # bytes of one block inside one segment
    block_stride: int  # bytes between block b and b+1
    segment_stride: int  # bytes between segment 0 and 1 of one block (0 when segments == 1)

    def __post_init__(self) -> None:
        if self.segments not in (1, 2):
            raise ValueError(f"segments must be 1 or 2, got {self.segments}")
        if self.segments == 1 and self.segment_stride != 0:
            raise ValueError("segment_stride must be 0 when segments == 1")
        if self.num_blocks < 0 or self.segment_bytes <= 0:
            raise ValueError(
                f"bad region: num_blocks={self.num_blocks}, segment_bytes={self.segment_bytes}"
            )
        if min(self.base, self.block_stride, self.segment_stride) < 0:
            raise ValueError("base and strides must be non-negative")

    @property
    def slot_bytes(self) -> int:
        """Bytes this layer takes in one slot."""
        return self.segments * self.segment_bytes


def region_from_tensor(t: torch.Tensor, kind: str) -> LayerRegion:
    """Derive the byte geometry of one layer's KV-cache tensor.

    Shapes: kv_first [2, nb, a, b, d]; blocks_first [nb, 2, a, b, d];
    mla [nb, bs, dim]; paged [nb, ...] (vLLM's standardised view, any storage
    offset: ``data_ptr`` already includes it). NHD and HND need nothing special: the dims inside one
    block segment may be in any order (a permuted view, as vLLM builds for
    HND) as long as they cover a dense byte range, which is copied as it is.
    """
    segment_dim, block_dim, inner_from = _dims(t, kind)
    el = t.element_size()
    inner = list(range(inner_from, t.dim()))
    if not _is_dense(t, inner):
        raise ValueError(
            f"{kind} tensor of shape {tuple(t.shape)} and strides {t.stride()}: "
            f"the bytes of one block segment (dims {inner}) must be dense"
        )
    segment_bytes = math.prod(t.shape[d] for d in inner) * el
    num_blocks = t.shape[block_dim]
    segments = 2 if segment_dim is not None else 1
    block_stride = t.stride(block_dim) * el
    segment_stride = t.stride(segment_dim) * el if segment_dim is not None else 0
    if num_blocks > 1 and block_stride < segment_bytes:
        raise ValueError(f"{kind} tensor: blocks overlap (block stride {block_stride} B)")
    if segments == 2 and segment_stride < segment_bytes:
        raise ValueError(f"{kind} tensor: K and V segments overlap (stride {segment_stride} B)")
    return LayerRegion(
        base=t.data_ptr(),
        num_blocks=num_blocks,
        segments=segments,
        segment_bytes=segment_bytes,
        block_stride=block_stride,
        segment_stride=segment_stride,
    )


def _dims(t: torch.Tensor, kind: str) -> tuple[int | None, int, int]:
    """(segment dim or None, block dim, first dim inside a segment) for a layout kind.

    blocks_first keeps its K/V dim inside the block: one block is one dense
    segment holding K then V, so it is a single segment of the slot.
    """
    shape = tuple(t.shape)
    if kind == "kv_first":
        if t.dim() != 5 or shape[0] != 2:
            raise ValueError(f"kv_first expects [2, nb, a, b, d], got {shape}")
        return 0, 1, 2
    if kind == "blocks_first":
        if t.dim() != 5 or shape[1] != 2:
            raise ValueError(f"blocks_first expects [nb, 2, a, b, d], got {shape}")
        return None, 0, 1
    if kind == "mla":
        if t.dim() != 3:
            raise ValueError(f"mla expects [nb, bs, dim], got {shape}")
        return None, 0, 1
    if kind == "paged":
        if t.dim() < 2:
            raise ValueError(f"paged expects [nb, ...] with at least 2 dims, got {shape}")
        return None, 0, 1
    raise ValueError(f"unknown layout kind {kind!r}; expected one of {KINDS}")


def physical_order(t: torch.Tensor, dims: list[int]) -> list[int]:
    """`dims` sorted from the largest stride to the smallest: their order in memory."""
    return sorted(dims, key=lambda d: (-t.stride(d), d))


def _is_dense(t: torch.Tensor, dims: list[int]) -> bool:
    """True when `dims`, taken in memory order, tile one contiguous range with no gaps."""
    expected = 1
    for d in reversed(physical_order(t, dims)):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True
