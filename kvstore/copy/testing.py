"""Torch oracle for the copy engine: plain tensor indexing, no address arithmetic.

A slot image of one layer for one block is the block's bytes in memory
order: segment 0 (K) then segment 1 (V) for kv_first, the whole block for
blocks_first and MLA. Inner dims are put back in memory order first, so a
permuted view (vLLM's HND) gives its physical bytes, exactly what the copy
engine moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.copy.geometry import physical_order, region_from_tensor


def reference_gather(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], block_ids: Sequence[int] | np.ndarray
) -> list[torch.Tensor]:
    """Per layer, a uint8 tensor [len(block_ids), slot_bytes] of slot images, on its device."""
    ids = _ids(block_ids, tensors)
    images = []
    for t, kind in zip(tensors, kinds, strict=True):
        region_from_tensor(t, kind)  # same validation as the copy engine
        blocks = _blocks_major(t, kind)[ids]  # [B, (2,) inner...] in memory order
        images.append(blocks.contiguous().view(torch.uint8).reshape(len(ids), -1))
    return images


def reference_scatter(
    tensors: Sequence[torch.Tensor],
    kinds: Sequence[str],
    block_ids: Sequence[int] | np.ndarray,
    images: Sequence[torch.Tensor],
) -> None:
    """Write slot images back into the blocks `block_ids` of each tensor, in place."""
    ids = _ids(block_ids, tensors)
    for t, kind, image in zip(tensors, kinds, images, strict=True):
        region_from_tensor(t, kind)
        view = _blocks_major(t, kind)
        values = image.to(t.device).contiguous().view(t.dtype).reshape((len(ids), *view.shape[1:]))
        view[ids] = values


def _blocks_major(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of `t` indexed by block first, then segment, then inner dims in memory order."""
    if kind == "kv_first":
        return t.permute(1, 0, *physical_order(t, [2, 3, 4]))
    return t.permute(0, *physical_order(t, list(range(1, t.dim()))))


def _ids(block_ids: Sequence[int] | np.ndarray, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    device = tensors[0].device if tensors else "cpu"
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=device)
