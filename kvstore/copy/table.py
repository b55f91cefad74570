"""A registration's layers as arrays, derived once; per request only block ids and slots.

`plan()` rebuilds the layers' geometry and every piece on each request, and the
copiers then sort the pieces to prove that no two destinations overlap. A
`RegionTable` does the geometry once per registration (docs/design.md §3):
per-layer columns for the vectorised planner, descriptor rows for the native
host helper and the CUDA kernel (which compute every piece themselves), and a
proof, taken once, that distinct block ids land on disjoint paged bytes. A
request is then checked in O(blocks): block ids in range and distinct; slots
come distinct from the store's pool.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.copy.geometry import LayerRegion
from kvstore.copy.plan import LayerColumns, Pieces, layer_columns, merge_adjacent, pieces_of
from kvstore.wire.errors import invalid

U64 = np.uint64
DESCRIPTOR_FIELDS = 6  # base, block_stride, segment_stride, segment_bytes, segments, num_blocks
MAX_PAIRWISE_LAYERS = 2048  # above this, layers whose extents interleave are not analysed
MAX_SEGMENTS_PROVEN = 8  # layers of more segments are proven apart by their extents only


class RegionTable:
    """The layers of one registration (in slot order), ready for many requests.

    `descriptors` is a C-contiguous uint64 array of one row per layer:
    base, block_stride, segment_stride, segment_bytes, segments, num_blocks.
    Immutable after construction; safe to share between threads.
    """

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        self.regions = tuple(regions)
        self.columns: LayerColumns = layer_columns(self.regions)
        rows = [
            (r.base, r.block_stride, r.segment_stride, r.segment_bytes, r.segments, r.num_blocks)
            for r in self.regions
        ]
        self.descriptors = np.array(rows, dtype=U64).reshape(len(rows), DESCRIPTOR_FIELDS)
        self.descriptors.flags.writeable = False
        self.num_blocks = np.array([r.num_blocks for r in self.regions], dtype=np.int64)
        self.min_blocks = int(self.num_blocks.min()) if len(rows) else 0
        self.bytes_per_block = sum(r.slot_bytes for r in self.regions)
        self.min_segment_bytes = min((r.segment_bytes for r in self.regions), default=0)
        self.paged_disjoint = paged_disjoint(self.regions)
        self._stamp: np.ndarray | None = None  # made on first use; only touched pages count
        self._positions = np.arange(0, dtype=np.int32)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.regions)

    def check(
        self, block_ids: Sequence[int] | np.ndarray, slot_addrs: np.ndarray, *, distinct: bool
    ) -> BlockArgs:
        """The request as (int64 ids, uint64 C-contiguous slots), or KVError INVALID_ARGUMENT.

        O(blocks + slots), vectorised: ids 1-D integers, each in range of every
        layer and, when ``distinct`` (a load: two writes into one block would
        race), named once; slots shaped (layers, blocks), non-negative. A save
        may read one block into two blocks' slots.
        """
        ids = _ids(block_ids)
        slots = _slots(slot_addrs, len(self.regions), len(ids))
        if len(ids) and len(self.regions):
            self._check_range(ids)
            if distinct:
                self._check_distinct(ids)
        return BlockArgs(ids, slots)

    def pieces(self, args: BlockArgs, *, merge: bool = True) -> Pieces:
        """The request's byte copies, vectorised (what the kernels compute themselves)."""
        p = pieces_of(self.columns, args.ids, args.slots)
        return merge_adjacent(p) if merge else p

    def _check_range(self, ids: np.ndarray) -> None:
        if int(ids.min()) >= 0 and int(ids.max()) < self.min_blocks:
            return
        bad = (ids[None, :] < 0) | (ids[None, :] >= self.num_blocks[:, None])
        layer, i = (int(x) for x in np.argwhere(bad)[0])
        raise invalid(
            f"block_ids[{i}] = {int(ids[i])} out of range [0, {int(self.num_blocks[layer])}) "
            f"for layer index {layer}"
        )

    def _check_distinct(self, ids: np.ndarray) -> None:
        """Each position writes its index at its id; a repeated id loses one of its writes."""
        n = len(ids)
        with self._lock:
            if self._stamp is None:
                self._stamp = np.empty(self.min_blocks, dtype=np.int32)
            if len(self._positions) < n:
                self._positions = np.arange(max(n, 2 * len(self._positions)), dtype=np.int32)
            positions = self._positions[:n]
            self._stamp[ids] = positions
            won = self._stamp[ids]
        clash = np.flatnonzero(won != positions)
        if len(clash):
            i = int(clash[0])
            first, second = sorted((i, int(won[i])))
            raise invalid(
                f"block_ids[{second}] = {int(ids[i])} repeats block_ids[{first}]: "
                "a request names each block once"
            )


@dataclass(frozen=True)
class BlockArgs:
    """One checked request: int64 block ids and their (layers, blocks) uint64 slot addresses."""

    ids: np.ndarray
    slots: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.ids)


def paged_disjoint(regions: Sequence[LayerRegion]) -> bool:
    """True when distinct block ids always give disjoint paged bytes, across all layers.

    Within a layer blocks never overlap (`region_from_tensor` checks it); K and
    V of one layer, and two layers, are proven apart by their extents or, for
    layers with one block stride (vLLM's views into one buffer that interleaves
    layers block by block), by their segments' offsets modulo that stride.
    Anything else (a layer listed twice, exotic strides) is reported as not proven.
    """
    if not all(layer_apart(r) for r in regions):
        return False
    if len(regions) < 2:
        return True
    start = np.array([r.base for r in regions], dtype=np.int64)
    end = start + np.array([_extent(r) for r in regions], dtype=np.int64)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    if (s[1:] >= np.maximum.accumulate(e)[:-1]).all():
        return True
    if len(regions) > MAX_PAIRWISE_LAYERS:
        return False
    return _interleaved_apart(regions, start, end)


# Segments enumerated, at most, to find two layers sharing bytes where
# paged_disjoint proves nothing (~0.1 s of a registration at the bound)
MAX_OVERLAP_SEGMENTS = 1 << 21


@dataclass(frozen=True)
class Overlap:
    """Layer ``layer_a``'s block ``block_a`` and layer ``layer_b``'s block ``block_b``
    (indices into the regions) share bytes."""

    layer_a: int
    block_a: int
    layer_b: int
    block_b: int


def first_overlap(table: RegionTable, limit: int = MAX_OVERLAP_SEGMENTS) -> Overlap | None:
    """Two of ``table``'s layers whose blocks share bytes (a layer listed twice,
    views of one tensor), found by enumerating every segment of every block;
    None when ``table.paged_disjoint`` proves them apart, when none do, or when
    the layers hold more than ``limit`` segments (not looked for: each Load's
    pieces are still checked, ``check_disjoint``). Layers each apart within
    themselves (``layer_apart``, checked at registration) are assumed."""
    if table.paged_disjoint:
        return None
    rows = table.descriptors.astype(np.int64)  # base, strides, bytes, segments, blocks
    counts = rows[:, 4] * rows[:, 5]
    if int(counts.sum()) > limit:
        return None
    layer = np.repeat(np.arange(len(rows)), counts)
    index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    seg = rows[layer, 4]
    block, part = index // seg, index % seg
    fields = rows[layer, :4]
    start = fields[:, 0] + block * fields[:, 1] + part * fields[:, 2]
    order = np.argsort(start, kind="stable")
    start, end = start[order], (start + fields[:, 3])[order]
    reach = np.maximum.accumulate(end)
    clash = np.flatnonzero(start[1:] < reach[:-1])
    if not len(clash):
        return None
    k = int(clash[0]) + 1
    j = int(np.argmax(end[:k] > start[k]))  # an earlier segment still open at start[k]
    a, b = order[j], order[k]
    return Overlap(int(layer[a]), int(block[a]), int(layer[b]), int(block[b]))


def _extent(r: LayerRegion) -> int:
    last = max(r.num_blocks - 1, 0) * r.block_stride
    return last + (r.segments - 1) * r.segment_stride + r.segment_bytes


def layer_apart(r: LayerRegion) -> bool:
    """Two distinct blocks of the layer never meet, nor K and V of any two blocks
    (exact: a registration whose layer fails it is refused)."""
    n, stride, shift = r.segment_bytes, r.block_stride, r.segment_stride
    if r.num_blocks > 1 and stride < n:
        return False
    if r.segments == 1:
        return True
    if shift >= max(r.num_blocks - 1, 0) * stride + n:
        return True  # every V lies past every K
    if stride == 0:
        return False
    d = shift % stride  # V of block b sits d bytes past K of some block, modulo the stride
    return n <= d <= stride - n


def _interleaved_apart(regions: Sequence[LayerRegion], start: np.ndarray, end: np.ndarray) -> bool:
    """Pairwise: extents apart, or one block stride and every segment of one layer
    clear of every segment of the other modulo that stride (layers interleaved in
    one buffer block by block, as vLLM's cross-layer layouts lay them out, K and V
    segments and all).

    Segment a of layer i lies at ``start_i + a * segment_stride_i`` plus a whole
    number of strides s; with d the offset of segment b of layer j after it,
    modulo s, the two never meet for any pair of blocks iff ``d >= bytes_i`` and
    ``s - d >= bytes_j``."""
    seg = np.array([r.segments for r in regions], dtype=np.int64)
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    size = np.array([r.segment_bytes for r in regions], dtype=np.int64)
    shift = np.array([r.segment_stride for r in regions], dtype=np.int64)
    apart = (start[:, None] >= end[None, :]) | (end[:, None] <= start[None, :])
    same = (stride[:, None] == stride[None, :]) & (stride[:, None] > 0)
    same &= (seg[:, None] <= MAX_SEGMENTS_PROVEN) & (seg[None, :] <= MAX_SEGMENTS_PROVEN)
    safe_stride = np.maximum(stride, 1)[:, None]
    fits = np.ones_like(same)
    for a in range(min(int(seg.max()), MAX_SEGMENTS_PROVEN)):
        for b in range(min(int(seg.max()), MAX_SEGMENTS_PROVEN)):
            d = ((start + b * shift)[None, :] - (start + a * shift)[:, None]) % safe_stride
            clear = (d >= size[:, None]) & (safe_stride - d >= size[None, :])
            fits &= clear | (a >= seg)[:, None] | (b >= seg)[None, :]  # no such segment
    ok = apart | (same & fits)
    np.fill_diagonal(ok, True)
    return bool(ok.all())


def _ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise invalid(f"block_ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise invalid(f"block_ids must be integers, got {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise invalid("block_ids out of the int64 range")
    return np.ascontiguousarray(ids, dtype=np.int64)


def _slots(slot_addrs: np.ndarray, num_layers: int, num_blocks: int) -> np.ndarray:
    slots = np.asarray(slot_addrs)
    if slots.shape != (num_layers, num_blocks):
        raise invalid(
            f"slot_addrs must have shape (layers, blocks) = {(num_layers, num_blocks)}, "
            f"got {slots.shape}"
        )
    if slots.size and not np.issubdtype(slots.dtype, np.integer):
        raise invalid(f"slot_addrs must be integers, got {slots.dtype}")
    if slots.size and np.issubdtype(slots.dtype, np.signedinteger) and int(slots.min()) < 0:
        raise invalid("slot_addrs must be non-negative addresses")
    return np.ascontiguousarray(slots, dtype=U64)
