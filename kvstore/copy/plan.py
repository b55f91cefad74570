"""Turn (layers, block ids, slot addresses) into a flat list of byte copies.

A plan is direction-agnostic: save copies paged -> slot, load copies
slot -> paged, over the same pieces. Everything is vectorised with numpy
because a request can carry tens of thousands of pieces (layers x blocks x
K/V) and a Python loop per piece would cost more than the copy itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.copy.geometry import LayerRegion
from kvstore.wire.errors import invalid

U64 = np.uint64


@dataclass(frozen=True)
class Pieces:
    """Byte copies between paged KV memory and slots, one row per piece.

    A row is one (layer, block, segment) piece, or several of them merged when
    they are adjacent on both sides (fewer, larger copies are cheaper).
    Rows never overlap on either side when the plan came from distinct
    blocks and distinct slots.
    """

    paged_addr: np.ndarray  # uint64
    slot_addr: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum(dtype=U64))


def plan(
    regions: Sequence[LayerRegion],
    block_ids: Sequence[int] | np.ndarray,
    slot_addrs: np.ndarray,
    *,
    merge: bool = True,
) -> Pieces:
    """Pieces that move `block_ids` of every layer to/from their slots.

    `slot_addrs[l, i]` is the address of the slot holding layer `l` of block
    `block_ids[i]`; it receives segment 0 then segment 1 of that block.
    Raises ValueError naming the first block id out of range and its layer.
    """
    ids = _block_ids(block_ids)
    slots = _slot_addrs(slot_addrs, len(regions), len(ids))
    if len(regions) == 0 or len(ids) == 0:
        empty = np.zeros(0, dtype=U64)
        return Pieces(empty, empty.copy(), empty.copy())
    _check_block_ids(regions, ids)

    pieces = pieces_of(layer_columns(regions), ids, slots)
    return merge_adjacent(pieces) if merge else pieces


class LayerColumns(NamedTuple):
    """The layers' geometry as uint64 columns of shape (layers, 1), broadcast over blocks."""

    base: np.ndarray
    block_stride: np.ndarray
    segment_stride: np.ndarray
    segment_bytes: np.ndarray
    segments: np.ndarray


def layer_columns(regions: Sequence[LayerRegion]) -> LayerColumns:
    rows = [
        (r.base, r.block_stride, r.segment_stride, r.segment_bytes, r.segments) for r in regions
    ]
    geom = np.array(rows, dtype=U64).reshape(len(rows), 5).T[:, :, None]
    return LayerColumns(*geom)


def pieces_of(cols: LayerColumns, ids: np.ndarray, slots: np.ndarray) -> Pieces:
    """Unmerged pieces in (layer, block, segment) order; ids int64 in range, slots uint64."""
    if len(cols.base) == 0 or len(ids) == 0:
        empty = np.zeros(0, dtype=U64)
        return Pieces(empty, empty.copy(), empty.copy())
    block_start = cols.base + ids.astype(U64)[None, :] * cols.block_stride  # (layers, blocks)
    # rows in (layer, block, segment) order: segment 0 of a block, then its segment 1
    paged = np.stack([block_start, block_start + cols.segment_stride], axis=-1)
    slot = np.stack([slots, slots + cols.segment_bytes], axis=-1)
    nbytes = np.broadcast_to(cols.segment_bytes[..., None], paged.shape)
    if (cols.segments == 2).all():
        return Pieces(paged.ravel(), slot.ravel(), nbytes.ravel())
    if (cols.segments == 1).all():
        return Pieces(paged[..., 0].ravel(), slot[..., 0].ravel(), nbytes[..., 0].ravel())
    # mixed: segment 1 of a 1-segment layer does not exist, mask it out
    used = np.arange(2, dtype=U64) < np.broadcast_to(cols.segments[..., None], paged.shape)
    return Pieces(paged[used], slot[used], nbytes[used])


def merge_adjacent(p: Pieces) -> Pieces:
    """Fuse consecutive rows that continue each other on both sides.

    Blocks-first and MLA layers whose consecutive block ids land in consecutive
    slots collapse into one copy per run; K/V-first layers never do (K and V
    are far apart in the paged tensor but adjacent in the slot).
    """
    if len(p) < 2:
        return p
    end_paged = p.paged_addr[:-1] + p.nbytes[:-1]
    end_slot = p.slot_addr[:-1] + p.nbytes[:-1]
    continues = (p.paged_addr[1:] == end_paged) & (p.slot_addr[1:] == end_slot)
    if not continues.any():
        return p
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return Pieces(
        p.paged_addr[starts], p.slot_addr[starts], np.add.reduceat(p.nbytes, starts).astype(U64)
    )


def split_pieces(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every copy into chunks of at most `max_bytes` (a multiple of 16 keeps alignment).

    Used to spread a few large copies over several CPU threads or CUDA blocks.
    """
    if len(nbytes) == 0:
        return src, dst, nbytes
    step = U64(max_bytes)
    counts = np.maximum((nbytes + step - U64(1)) // step, U64(1)).astype(np.int64)
    if int(counts.max()) == 1:
        return src, dst, nbytes
    row = np.repeat(np.arange(len(nbytes)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(len(row)) - first).astype(U64) * step
    size = np.minimum(step, nbytes[row] - offset)
    return src[row] + offset, dst[row] + offset, size


def check_disjoint(addr: np.ndarray, nbytes: np.ndarray, side: str) -> None:
    """Raise KVError INVALID_ARGUMENT if two destination ranges overlap.

    Overlapping writes would make the result depend on copy order, which
    differs between the threaded host path and the CUDA kernel.
    """
    if len(addr) < 2:
        return
    if (np.diff(np.sort(addr)) >= nbytes.max()).all():
        return  # fast path: neighbours are at least the largest piece apart
    order = np.argsort(addr)
    start = addr[order]
    end = start + nbytes[order]
    clash = np.flatnonzero(start[1:] < end[:-1])
    if len(clash):
        at = int(start[clash[0] + 1])
        raise invalid(
            f"destination pieces overlap on the {side} side at 0x{at:x}: two blocks of the "
            "request, or two registered layers, share bytes"
        )


def _block_ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"block_ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def _slot_addrs(slot_addrs: np.ndarray, num_layers: int, num_blocks: int) -> np.ndarray:
    slots = np.asarray(slot_addrs)
    if slots.shape != (num_layers, num_blocks):
        raise ValueError(
            f"slot_addrs must have shape (layers, blocks) = {(num_layers, num_blocks)}, "
            f"got {slots.shape}"
        )
    if slots.size and np.issubdtype(slots.dtype, np.signedinteger) and (slots < 0).any():
        raise ValueError("slot_addrs must be non-negative addresses")
    return slots.astype(U64, copy=False)


def _check_block_ids(regions: Sequence[LayerRegion], ids: np.ndarray) -> None:
    limit = np.array([r.num_blocks for r in regions], dtype=np.int64)[:, None]
    bad = (ids[None, :] < 0) | (ids[None, :] >= limit)
    if bad.any():
        layer, i = np.argwhere(bad)[0]
        raise ValueError(
            f"block id {int(ids[i])} out of range [0, {int(limit[layer, 0])}) "
            f"for layer index {int(layer)}"
        )
