"""Build sealed instances in-process over plain torch tensors (no network).

The core store is plain Python; these helpers let its tests (including the
property-based ones) run thousands of operations in seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from kvstore.copy import copier_for, region_from_tensor
from kvstore.store.blocks import BlockStore
from kvstore.store.pool import SlotPool
from kvstore.store.registry import LayerReg, Registration, Registry
from kvstore.wire.fingerprint import LayerGeometry


@dataclass
class Rank:
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
    tensors = [
        torch.zeros(2, num_blocks, block_bytes // 2, dtype=torch.uint8) for _ in range(layers)
    ]
    regs = []
    for i, t in enumerate(tensors):
        region = region_from_tensor(t.view(2, num_blocks, 1, 1, block_bytes // 2), "kv_first")
        regs.append(
            (
                LayerReg(
                    LayerGeometry(f"l{i}", "uint8", block_bytes, 2, "NHD"),
                    "kv_first",
                    num_blocks,
                    region.block_stride,
                    region.segment_stride,
                ),
                region,
            )
        )
    reg = Registration(
        instance, ns, tp_rank, tp_rank, tp_size, tp_size, 16, "h", [lr for lr, _ in regs]
    )
    reg.regions = {lr.geometry.name: r for lr, r in regs}
    return Rank(reg, tensors)


def make_instance(registry: Registry, instance: str, tp_size: int = 2, **kw) -> list[Rank]:
    ranks = [make_rank(instance, r, tp_size, **kw) for r in range(tp_size)]
    for rank in ranks:
        registry.register(rank.reg)
    return ranks


def make_store(
    pool_bytes: int = 1 << 20, slab_bytes: int = 64 << 10, events: list | None = None
) -> tuple[Registry, BlockStore]:
    store = BlockStore(
        {"cpu": SlotPool(pool_bytes, "cpu", slab_bytes)},
        {"cpu": copier_for("cpu")},
        on_event=(events.append if events is not None else None),
    )
    return Registry(), store


def run(coro):
    return asyncio.run(coro)
