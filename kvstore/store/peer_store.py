"""The block store as the two ends of a peer transfer.

:class:`StoreSource` leases sealed blocks to a fetching peer: their slots are
pinned (never evicted) until the last byte is sent. :class:`StoreSink`
reserves slots for blocks coming in: they live in *detached* blocks, outside
the index, so nothing half-written can ever be seen; ``commit`` seals them
into the index in one synchronous step, ``abort`` frees them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.store.blocks import Block, BlockStore
from kvstore.store.registry import Seal
from kvstore.transfer import SlotTable
from kvstore.wire.errors import invalid, precondition

log = logging.getLogger(__name__)


def slot_table(store: BlockStore, blocks: list[Block]) -> SlotTable:
    """The blocks' slots as a transfer reads or writes them (straight in the pool)."""
    ptr, size, memory = store.slot_addresses(blocks)
    counts = np.fromiter((len(b.slot_bytes) for b in blocks), dtype=np.int64, count=len(blocks))
    return SlotTable(ptr, size, memory, counts, owner=store.pools)


@dataclass
class StoreLease:
    hashes: list[int]
    slots: SlotTable
    _release: Callable[[], None]

    def release(self) -> None:
        self._release()


class StoreSource:
    """Serves a peer's fetch out of this node's sealed blocks."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.served_blocks = 0  # blocks leased to fetching peers

    def lease(self, namespace: str, hashes: list[int]) -> StoreLease | None:
        blocks = self.store.sealed_prefix(namespace, hashes)
        if not blocks:
            return None
        self.served_blocks += len(blocks)
        for block in blocks:
            block.pins += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                for block in blocks:
                    block.pins -= 1

        return StoreLease([b.key[1] for b in blocks], slot_table(self.store, blocks), release)


@dataclass
class StoreReservation:
    store: BlockStore
    blocks: list[Block]
    slots: SlotTable = None
    done: bool = False

    def commit(self) -> None:
        """Make every received block visible (a block saved meanwhile wins)."""
        if self.done:
            return
        self.done = True
        kept = 0
        for block in self.blocks:
            block.written = block.all_slots
            kept += self.store.adopt(block)
        log.info("fetched %d blocks from a peer (%d already here)", kept, len(self.blocks) - kept)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        for block in self.blocks:
            self.store.free_detached(block)


class StoreSink:
    """Reserves local slots for blocks of a namespace that a local instance serves."""

    def __init__(self, store: BlockStore, local_layout: Callable[[str], tuple[Seal, list[str]]]):
        """``local_layout(namespace)`` -> (seal, device of each tp_rank) or KVError."""
        self.store = store
        self.local_layout = local_layout

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> StoreReservation:
        seal, devices = self.local_layout(namespace)
        expect = seal.slot_bytes.tolist()
        for i, sizes in enumerate(slot_sizes):
            if list(sizes) != expect:
                raise invalid(
                    f"peer offered block {i} with slot sizes that do not match "
                    f"the layout of namespace {namespace}"
                )
        blocks = self.store.reserve_detached(namespace, hashes, seal, devices)
        return StoreReservation(self.store, blocks, slot_table(self.store, blocks))


def local_layout_from(registry) -> Callable[[str], tuple[Seal, list[str]]]:
    """Layout of a namespace as a sealed local instance of it defines it."""

    def lookup(namespace: str) -> tuple[Seal, list[str]]:
        for inst in registry.instances.values():
            if inst.seal is not None and inst.seal.final_namespace == namespace:
                devices = ["cpu"] * inst.seal.tp_size
                for reg in inst.ranks.values():
                    devices[reg.tp_rank] = reg.device
                return inst.seal, devices
        raise precondition(
            f"no sealed local instance serves namespace {namespace}; "
            "register one before fetching its blocks"
        )

    return lookup


__all__ = ["StoreSource", "StoreSink", "StoreReservation", "local_layout_from"]
