"""Copy engine: move KV blocks between a worker's paged KV cache and store slots.

    regions = [region_from_tensor(t, "kv_first") for t in kv_caches]   # once, at registration
    table = RegionTable(regions)                                         # once, at registration
    copier_for("cuda:0").save_blocks(table, block_ids, slot_addrs)      # paged -> slots
    copier_for("cuda:0").load_blocks(table, block_ids, slot_addrs)      # slots -> paged

Per request only block ids and slot addresses travel, checked in O(blocks);
the pieces are computed by the native helper / the kernel. The older path,
`plan()` -> `Pieces` -> ``save(pieces)``/``load(pieces)``, still works and
sorts the pieces to prove their destinations apart (docs/design.md §3).

HostCopier (CPU) and CudaCopier (GPU) give byte-identical results; the torch
reference in kvstore.copy.testing is the oracle both are tested against.
"""

from __future__ import annotations

import functools

from kvstore.copy.cuda import CudaCopier, DeviceFault, cuda_errors
from kvstore.copy.geometry import LayerRegion, region_from_tensor
from kvstore.copy.host import HostCopier, MemoryFault
from kvstore.copy.plan import Pieces, merge_adjacent, plan, split_pieces
from kvstore.copy.table import BlockArgs, Overlap, RegionTable, first_overlap
from kvstore.wire.devices import Device

__all__ = [
    "BlockArgs",
    "CudaCopier",
    "DeviceFault",
    "HostCopier",
    "LayerRegion",
    "MemoryFault",
    "Pieces",
    "Overlap",
    "RegionTable",
    "first_overlap",
    "copier_for",
    "cuda_errors",
    "merge_adjacent",
    "plan",
    "region_from_tensor",
    "split_pieces",
]


def copier_for(device: str) -> HostCopier | CudaCopier:
    """The shared copier for "cpu", "cuda" or "cuda:N" (one instance per device:
    "cuda" and "cuda:0" are one)."""
    return _copier(Device.parse(device))


@functools.cache
def _copier(where: Device) -> HostCopier | CudaCopier:
    return HostCopier() if where.is_host else CudaCopier(where.gpu)
