"""The store's core in one line, in-process, over plain torch tensors (no network).

:func:`make_store` builds a :class:`StoreNode` (registry, block index on one
host slot pool, host copier); :func:`make_instance` registers a sealed
instance of fake ranks whose layers are ordinary tensors (no shared memory,
nothing mapped). The core is plain Python, so its tests (including the
property-based ones) run thousands of operations in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.copy import copier_for, region_from_tensor
from kvstore.store.blocks import BlockIndex
from kvstore.store.node import StoreNode
from kvstore.store.pool import SlotPool
from kvstore.store.registry import LayerReg, Registration, Registry
from kvstore.wire.events import StoreEvent
from kvstore.wire.fingerprint import LayerGeometry
from kvstore.wire.kv_layout import LayoutKind


@dataclass
class Rank:
    """One fake rank: its registration and the tensors its regions point into."""

    reg: Registration
    tensors: list[torch.Tensor]

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [t[:, block_id].clone() for t in self.tensors]


def make_rank(
    instance: str,
    tp_rank: int,
    tp_size: int,
    layers: int = 2,
    num_blocks: int = 16,
    block_bytes: int = 1024,
    ns: str = "ns",
) -> Rank:
    """A kv_first rank of ``layers`` uint8 layers, ``block_bytes`` per block per layer."""
    tensors = [
        torch.zeros(2, num_blocks, block_bytes // 2, dtype=torch.uint8) for _ in range(layers)
    ]
    regs = []
    for i, t in enumerate(tensors):
        kind = LayoutKind.KV_FIRST
        region = region_from_tensor(t.view(2, num_blocks, 1, 1, block_bytes // 2), kind.value)
        geometry = LayerGeometry(f"l{i}", "uint8", block_bytes, kind.segments, "NHD")
        layer = LayerReg(geometry, kind, num_blocks, region.block_stride, region.segment_stride)
        regs.append((layer, region))
    reg = Registration(
        instance, ns, tp_rank, tp_rank, tp_size, tp_size, 16, "h", [lr for lr, _ in regs]
    )
    reg.regions = {lr.geometry.name: r for lr, r in regs}
    return Rank(reg, tensors)


def make_instance(registry: Registry, instance: str, tp_size: int = 2, **kw) -> list[Rank]:
    """Register ``tp_size`` ranks of ``instance`` (``kw`` as for make_rank); it seals."""
    ranks = [make_rank(instance, r, tp_size, **kw) for r in range(tp_size)]
    for rank in ranks:
        registry.register(rank.reg)
    return ranks


def make_store(
    pool_bytes: int = 1 << 20,
    slab_bytes: int = 64 << 10,
    events: list | None = None,
    on_event: Callable[[StoreEvent], None] | None = None,
) -> StoreNode:
    """A store node on one host pool, no peers; ``events`` collects what its index
    emits, or ``on_event`` is handed each."""
    index = BlockIndex(
        {"cpu": SlotPool(pool_bytes, "cpu", slab_bytes)},
        on_event=(events.append if events is not None else on_event),
    )
    return StoreNode(Registry(), index, {"cpu": copier_for("cpu")})


def run(coro):
    """Run one coroutine of the core to completion."""
    return asyncio.run(coro)
