"""Random churn of the block index over two small pools: after every step each
pool's accounts hold and every allocated slot belongs to exactly one block.

Claims (whole ranks and parts of ranks, TP1 and TP2, ranks on either device),
finishes and abandons (engine steps counted or not: a claim of another step
drops the stale inflight blocks), pins, detached reservations adopted or discarded,
departed writers, clears and expiries, in random order, over pools small enough
that nearly every claim evicts: the paths where a save takes over its victims'
slots (kvstore.store.eviction.SlotFrees.take), frees the rest, or gives them
back when the remainder cannot be had. Slot sizes 800, 1000 and 1024 round to
one 256-byte class, so victims of one layout serve another's slots.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import pytest

from kvstore.store.block import Block, SlotSet, tp_rank_slots
from kvstore.store.blocks import BlockIndex, Claim, Lease, Writer
from kvstore.store.pool import SlotPool, round_size
from kvstore.wire.errors import KVError

DEVICES = ("d0", "d1")
SESSIONS = ("s0", "s1", "s2")
LAYOUTS = (  # (slot bytes, tp_size)
    ((1024, 1024), 1),
    ((1000, 1024, 1000, 1024), 2),
    ((2048,), 1),
    ((800, 1024, 800, 1024, 1000, 1000), 2),
    ((512, 512, 512, 512), 2),
)


@dataclass(frozen=True)
class Shape:
    slot_bytes: np.ndarray
    tp_size: int


def shape(sizes: tuple[int, ...], tp_size: int) -> Shape:
    slot_bytes = np.array(sizes, dtype=np.int64)
    slot_bytes.flags.writeable = False
    return Shape(slot_bytes, tp_size)


@dataclass
class Churn:
    """The index and what is held outside it: claims in flight, detached blocks, leases."""

    index: BlockIndex
    pools: dict[str, SlotPool]
    claims: list[Claim]
    detached: list[list[Block]]
    leases: list[Lease]
    copying: dict[int, list[tuple[Block, int, int]]]  # claim id -> (block, slot, offset)
    steps: bool  # writers count engine steps (stale inflight blocks are dropped)

    def check(self) -> None:
        """Pool invariants; each allocated slot held once; used bytes as the blocks
        say; a claim's slots stay where its copy writes until it ends."""
        for claim in self.claims:
            for block, slot, offset in self.copying[id(claim)]:
                assert block.offsets[slot] == offset, "a slot under a copy was freed or moved"
        for pool in self.pools.values():
            pool.check()
        blocks = list(self.index.blocks.values())
        blocks += [b for c in self.claims for b in c.blocks]
        blocks += [b for made in self.detached for b in made]
        holder: dict[tuple[str, int], Block] = {}
        used = dict.fromkeys(self.pools, 0)
        for block in {id(b): b for b in blocks}.values():
            for slot, offset in enumerate(block.offsets.tolist()):
                if offset < 0:
                    continue
                device = block.devices[slot % block.tp_size]
                assert (device, offset) not in holder, f"slot {offset} on {device} held twice"
                holder[device, offset] = block
                used[device] += round_size(int(block.slot_bytes[slot]))
        assert used == {d: p.used_bytes for d, p in self.pools.items()}


def step(churn: Churn, rng: random.Random, shapes: list[Shape]) -> None:
    index, op = churn.index, rng.random()
    if op < 0.45:
        i = rng.randrange(len(shapes))
        layout, tp_rank = shapes[i], rng.randrange(shapes[i].tp_size)
        slots = tp_rank_slots(layout.slot_bytes, layout.tp_size, tp_rank).slots.tolist()
        if len(slots) > 1 and rng.random() < 0.3:  # a part of the rank's slots
            slots = sorted(rng.sample(slots, rng.randrange(1, len(slots))))
        step_no = rng.randrange(3) if churn.steps else 0
        writer = Writer(rng.choice(SESSIONS), tp_rank, rng.choice(DEVICES), f"i{i}", step_no)
        hashes = rng.sample(range(40), rng.randrange(1, 6))
        set_ = SlotSet.of(slots, layout.slot_bytes)
        claim = index.claim(f"ns{i}", hashes, layout, set_, writer)
        churn.claims.append(claim)
        churn.copying[id(claim)] = [
            (b, s, int(b.offsets[s])) for b in claim.blocks for s in set_.slots.tolist()
        ]
    elif op < 0.62 and churn.claims:
        claim = churn.claims.pop(rng.randrange(len(churn.claims)))
        index.finish(claim) if rng.random() < 0.8 else index.abandon(claim)
    elif op < 0.70:
        sealed = [b for b in index.blocks.values() if b.sealed]
        if sealed:
            churn.leases.append(index.pin(rng.sample(sealed, min(len(sealed), 3))))
    elif op < 0.78 and churn.leases:
        index.unpin(churn.leases.pop(rng.randrange(len(churn.leases))))
    elif op < 0.86:
        i = rng.randrange(len(shapes))
        devices = [rng.choice(DEVICES) for _ in range(shapes[i].tp_size)]
        hashes = rng.sample(range(40), rng.randrange(1, 4))
        churn.detached.append(index.reserve(f"ns{i}", hashes, shapes[i], devices).blocks)
    elif op < 0.93 and churn.detached:
        made = churn.detached.pop(rng.randrange(len(churn.detached)))
        index.adopt(made) if rng.random() < 0.7 else index.discard(made)
    elif op < 0.96:
        index.drop_writer(rng.choice(SESSIONS))
    elif op < 0.98:
        index.clear(rng.choice([None, "ns0", "ns1"]))
    else:
        index.expire(now=1e18 if rng.random() < 0.2 else None)


@pytest.mark.parametrize("steps", [False, True], ids=["no-steps", "steps"])
@pytest.mark.parametrize("seed", range(4))
def test_random_churn_keeps_every_slot_held_once(seed, steps, caplog):
    caplog.set_level(logging.ERROR)  # dropped-inflight warnings by the hundred
    rng = random.Random(seed)
    pools = {}
    for device in DEVICES:  # host memory, told apart by name as two GPUs' pools would be
        pool = pools[device] = SlotPool(64 << 10, "cpu", 8 << 10)
        pool.device = device
    churn = Churn(BlockIndex(pools), pools, [], [], [], {}, steps)
    shapes = [shape(*layout) for layout in LAYOUTS]
    refused = 0
    for _ in range(1500):
        try:
            step(churn, rng, shapes)
        except KVError:  # the pool cannot hold the request now: nothing may change
            refused += 1
        churn.check()
    assert churn.index.stats().evictions > 5 and refused
