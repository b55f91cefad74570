"""Peer-fetch benchmark: a store node pulls sealed blocks from another over UCX, against
raw ucxx moving the same bytes between the same two processes.

    python bench/transfer.py --quick                   # about a minute on a 2-core host
    python bench/transfer.py                           # full sweep
    python bench/transfer.py --tls all --tls tcp,self  # one sweep per UCX_TLS
    python bench/transfer.py --transport-only          # the transfer engine alone (stubs)
    python bench/transfer.py --mem cuda                # GPU pools, GPU host only
    UCX_MM_ERROR_HANDLING=y python bench/transfer.py   # same-host peers over shared memory
    python bench/transfer.py --quick --out bench/results/transfer_rma.json  # with one-sided
    python bench/transfer.py --no-rma                  # two-sided fetches only

With the project's UCX defaults (kvstore/transfer/ucx.py) same-host peers talk
over tcp; UCX_MM_ERROR_HANDLING=y lets them use shared memory (and its risk).

Two spawned processes, each with its own UCX context. The serving one holds a real
StoreNode (kvstore.testing.store.make_store: registry, BlockIndex, one slot pool of
8 MiB slabs like a server's, host copier) whose StoreSource a PeerServer serves. The
fetching one holds another StoreNode with a Fetcher on a StoreSink, told (as a
router would) that the serving node holds every block asked for; a fetch is
``StoreNode.prefetch``, the core of the Prefetch RPC and of a Load's missing prefix
(gRPC aside): REQUEST, reserve detached blocks (evicting) while the peer leases
(pins) and offers, GO, every slot, commit (adopt into the index), release.

Configurations: throughput rows with slots of 16 KiB .. 4 MiB, 16 slots a block, TP1,
as many blocks as --total-mib holds; then the latency case, a 32-block prefix of a
32-layer TP2 model (8 KV heads x 128, fp16, 16-token blocks: 64 slots of 32 KiB a
block, 64 MiB). Per configuration the serving node registers an instance of that
layout and SAVES two sets of blocks, A and B, through StoreNode.save from the ranks'
paged caches: int32 word j of slot s of block i of set k holds
``k * words_per_set + (i * slots_per_block + s) * words_per_slot + j``, so every
word of every block is distinct (checked in the serving pool after the saves). The
fetching node's pool holds exactly one set, so fetches alternate A, B, A, ... and
each one evicts the whole previous set, as a full cache does in steady state.

After a warm-up (fetch A, fetch B, both raw ops), each repeat runs these ops in a
fresh random order, the fetching pool's first total_bytes poisoned (0xFF,
untimed) before each op:

  fetch        StoreNode.prefetch of the next set's hashes (TIMED: the measured work)
  raw_one      the same total bytes as ONE ucxx message, serving pool to fetching
               pool, request round trip included (the old bench's baseline)
  fetch_rma    (one-sided rows) the same, the fetching node's Fetcher reading
               one-sided (REQUEST with the rma flag, grant, NIXL READ, commit, RELEASE)
  raw_seg      the same bytes as the same number of messages of the same sizes as
               the last fetch sent (recorded by the serving PeerServer), all posted
               at once, request round trip included
  nixl_one     (one-sided rows) the raw NIXL ceiling: the set's bytes as ONE NIXL READ
               (one run: a set's slots tile one stretch of the serving pool), the
               fetching node's own agent and registered pool, a blocking wait
  nixl_runs    (one-sided rows) the same set read as exactly the slot runs its
               fetch_rma reads (kvstore.transfer.onesided.runs_for: the serving
               side's lanes, into the slots the warm-up's fetch_rma of that set
               reserved)
  device_copy  (--mem cuda) one device-to-device copy of the same bytes, in-process:
               the serving pool's bytes (below) into the fetching pool's poisoned start

After every timed fetch every fetched byte is compared with the pattern: each block's
slots are read out of the fetching pool at the offsets the index gave them (a fetch
that moved nothing reads 0xFF). After every raw_one, raw_seg and device_copy (warm-up
included) the bytes that arrived are compared, untimed, with a copy of what the serving
pool holds there (its first total_bytes, taken once per configuration after the saves:
nothing writes the serving pool after them), on the fetching device; raw_seg's message
sizes must add up to total_bytes. The ceiling of a repeat is the faster of raw_one and
raw_seg; every ratio is taken per repeat (ceiling time / fetch time; the headline,
ratio_ceiling) and reported as its median, min-max and interquartile range. One-sided
fetches read with NIXL, faster than any ucxx message between these processes: their
ceiling is the faster of nixl_one and nixl_runs in the same repeat (ratio_nixl_ceiling:
ceiling time / fetch_rma time). Every raw NIXL read's bytes are checked like a fetch's
(the landing slots poisoned first).

--transport-only swaps both store nodes for the stubs the transfer layer was first
measured with (a lease that only computes where a block lies, a reservation from the
start of a plain pool, no index, no pins, no eviction): the transfer engine alone.

JSON (``--out``, default bench/results/transfer.json; rows of another (mem, source)
already there are kept, rows written before this field existed count as
source "stub"; a PNG of the same name is drawn beside it):

  benchmark, note, generated, quick   what, one-line definitions, UTC time, --quick
  ucx[]        per sweep: transport, mem, source, quick, env (every UCX_* / UCXPY_*
               variable both processes ran with), active_transports,
               server_active_transports, host
  rows[]       one per (transport, mem, source, slot size):
    transport, mem, source      UCX_TLS ("default": UCX chose), host/cuda, store/stub
    slot_bytes, slots_per_block, tp_size, num_blocks, total_bytes   one fetch's shape
    repeats                     interleaved repeats timed
    gbps                        total_bytes / median fetch time (1 GB = 1e9 bytes)
    baseline_gbps               the same for raw_one (the old baseline)
    ratio                       median over repeats of raw_one time / fetch time
                                (per repeat, as ratio_ceiling; not gbps / baseline_gbps)
    ratio_p10_p50_p90           its p10, p50 (= ratio), p90
    segments_gbps               the same for raw_seg
    ceiling_gbps                the same for the per-repeat faster of raw_one, raw_seg
    ratio_ceiling               median over repeats of ceiling time / fetch time
                                (the headline)
    ratio_ceiling_min_max, ratio_ceiling_iqr   its spread: [min, max], [p25, p75]
    fetch_ms_min_med_max        fetch wall time, ms
    messages                    data messages per fetch (median over repeats)
    evictions                   blocks the fetching node evicted during timed fetches
    layers_by_name              --layers-by-name: the serving ranks registered their
                                layers in name order (see --help)
    device_copy_gbps, ratio_device_copy   --mem cuda: one in-process device copy of
                                the same bytes, and the median over repeats of its
                                time / fetch time
    verified, verified_fetches  every byte of every fetch (warm-up included) compared
    verified_raw                raw_one, raw_seg, device_copy ops (warm-up included)
                                whose bytes were compared with the serving pool's
    rma                         (store rows, nixl installed, not --no-rma) the
                                same sets fetched one-sided, op fetch_rma interleaved
                                with the others: gbps, ms_p10_p50_p90,
                                two_sided_ms_p10_p50_p90, raw_one_ms_p10_p50_p90,
                                ratio_ceiling_p10_p50_p90 (ucxx ceiling / one-sided,
                                per repeat), speedup_vs_two_sided_p10_p50_p90;
                                nixl_one_ and nixl_runs_ms_p10_p50_p90, _gbps;
                                nixl_ceiling_gbps, nixl_ceiling_ms_p10_p50_p90 (per
                                repeat the faster of the two), ratio_nixl_ceiling_
                                p10_p50_p90 (NIXL ceiling time / fetch_rma time, per
                                repeat), over_nixl_ceiling_ms_p10_p50_p90 (fetch_rma
                                time minus it), nixl_runs (runs of nixl_runs, set A),
                                nixl_verified_reads
  control_floor[]  fetches of 1 and 2,048 slots of 16 KiB, then of 1 slot with
               idle_connections (--floor-idle) held open at the peer: mem, source, slots,
               slot_bytes, total_bytes, repeats, {op}_ms_p10_p50_p90 per op (fetch,
               fetch_rma, raw_one, raw_seg, nixl_one, nixl_runs), the nixl_ceiling_,
               ratio_nixl_ceiling_, over_nixl_ceiling_ fields above, verified_fetches,
               verified_raw, nixl_verified_reads
  latency[]    per sweep, the TP2 prefix: transport, mem, source, model, block_tokens,
               slot_bytes, slots_per_block, num_blocks, total_bytes, iters,
               p50_ms, p99_ms, min_ms (fetch), ceiling_p50_ms, ratio_ceiling
               (+ _min_max, _iqr), messages, evictions, layers_by_name, verified,
               verified_fetches, verified_raw
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from rma import (  # bench/ is sys.path[0]; bench/rma.py holds what both benches share
    RAW_DATA_TAG,
    RAW_ONE,
    RAW_REQUEST_TAG,
    idle_recv,
    one_run,
    polled,
    quantiles,
    timed_read,
    ucx_env,
)

from kvstore.copy import copier_for, region_from_tensor
from kvstore.store.blocks import BlockIndex
from kvstore.store.fetch import Fetcher, StoreSink, StoreSource
from kvstore.store.node import StoreNode
from kvstore.store.pool import DEFAULT_SLAB_BYTES, SlotPool
from kvstore.store.registry import Registry
from kvstore.testing.store import Rank, make_rank, make_store
from kvstore.transfer import PeerServer, SlotTable, rma
from kvstore.transfer.onesided import RmaReader, runs_for
from kvstore.transfer.server import PortLimits
from kvstore.transfer.slots import choose_lanes
from kvstore.transfer.wire import Grant
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST
from kvstore.wire.peers import PeerPrefix

RESULTS = Path(__file__).resolve().parent / "results"
STUB_NS = "bench.0000000000000000"
SLOT_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
FLOOR_SLOT = 16 << 10  # control floor: fetches of 1 and 2,048 slots of this size
IDLE_CONNECTIONS = 250  # and of 1 slot, with this many idle connections at the peer
SLOTS_PER_BLOCK = 16  # throughput rows (TP1); the latency case uses 64 (32 layers x TP2)
# Latency case: Llama-3-8B-like, 32 layers, 8 KV heads x 128 dim, fp16,
# 16-token blocks, TP2: each rank holds 4 heads of K and V of one layer:
# 16 tokens * 4 heads * 128 dim * 2 bytes * 2 (K+V) = 32 KiB per slot,
# 32 layers * 2 ranks = 64 slots per block, 2 MiB per block, 64 MiB per prefix.
LATENCY_LAYERS, LATENCY_TP, LATENCY_BLOCKS = 32, 2, 32
LATENCY_SLOT = 16 * (8 // LATENCY_TP) * 128 * 2 * 2
SLAB_BYTES = DEFAULT_SLAB_BYTES  # a store server's default slab
CACHE_BYTES = 64 << 20  # a serving rank's paged cache (blocks are saved through it in batches)
POISON = 0xFF  # int32 -1: never a pattern word
RAW_SEG = 1  # raw ucxx mode (RAW_ONE, the tags: bench/rma.py): the last fetch's messages
NIXL_OPS = ("nixl_one", "nixl_runs")  # the raw one-sided ceiling's two ops
NOTE = (
    "gbps = total_bytes / median wall time of one fetch; baseline_gbps = the same bytes as "
    "ONE raw ucxx message, segments_gbps = as the same messages the fetch sent, "
    "ceiling = per repeat the faster of the two; ratio_ceiling (headline) = median over "
    "interleaved repeats of ceiling time / fetch time, ratio = the same for raw_one time; "
    "every fetched and raw-received byte verified; rma: the same sets fetched one-sided (NIXL "
    "READ into reserved slots), interleaved with the rest, against the raw NIXL ceiling "
    "(per repeat the faster of ONE NIXL READ of the bytes and a READ of the fetch's own "
    "slot runs, bytes verified): ratio_nixl_ceiling = ceiling time / fetch_rma time; "
    "control_floor: 1- and 2048-slot fetches, and 1-slot ones with idle_connections open at "
    "the peer, ms p10/p50/p90 per op; fields: "
    "bench/transfer.py docstring"
)


# ---- shapes and the byte pattern --------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One fetch: ``blocks`` blocks of ``per_block`` slots of ``slot`` bytes, TP ``tp``."""

    slot: int
    per_block: int
    tp: int
    blocks: int

    @property
    def nbytes(self) -> int:
        return self.blocks * self.per_block * self.slot

    @property
    def words(self) -> int:
        return self.slot // 4  # int32 words per slot

    def base(self, k: int) -> int:
        """The first pattern word of set ``k``."""
        return k * self.blocks * self.per_block * self.words


def set_words(shape: Shape, k: int, device: str) -> torch.Tensor:
    """Set ``k``'s pattern, one row of int32 words per slot, block after block."""
    n = shape.blocks * shape.per_block * shape.words
    start = shape.base(k)
    return torch.arange(start, start + n, dtype=torch.int32, device=device).view(-1, shape.words)


def slot_words(shape: Shape, k: int, first: int, count: int, s: int, device: str) -> torch.Tensor:
    """Slot ``s`` of blocks ``first .. first + count - 1`` of set ``k``: (count, words)."""
    i = torch.arange(first, first + count, dtype=torch.int32, device=device)
    j = torch.arange(shape.words, dtype=torch.int32, device=device)
    return shape.base(k) + ((i * shape.per_block + s) * shape.words)[:, None] + j[None, :]


def slot_rows(buffer: torch.Tensor, slot: int) -> torch.Tensor:
    """``buffer`` as rows of ``slot`` bytes (every slot offset here is a multiple of it)."""
    return buffer[: len(buffer) // slot * slot].view(-1, slot)


def check_slots(buffer: torch.Tensor, shape: Shape, offsets: np.ndarray, k: int, what: str) -> None:
    """The slots at ``offsets`` (blocks x slots, bytes into ``buffer``) hold set ``k``."""
    if (offsets % shape.slot).any() or offsets.shape != (shape.blocks, shape.per_block):
        raise AssertionError(f"{what}: slot offsets of shape {offsets.shape} are not whole rows")
    rows = torch.from_numpy(offsets.reshape(-1) // shape.slot).to(buffer.device)
    got = slot_rows(buffer, shape.slot).index_select(0, rows).view(torch.int32)
    want = set_words(shape, k, buffer.device)
    if not torch.equal(got, want):
        bad = int((got != want).any(dim=1).nonzero()[0])
        block, slot = divmod(bad, shape.per_block)
        word = int((got[bad] != want[bad]).nonzero()[0])
        raise AssertionError(
            f"{what}: block {block} slot {slot} word {word} is {int(got[bad, word])}, "
            f"expected {int(want[bad, word])}"
        )


def round_up(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


def ucx_view(buffer: torch.Tensor, start: int, nbytes: int) -> Any:
    """Bytes ``start .. start + nbytes`` of a pool as ucxx takes them (numpy on the host)."""
    view = buffer[start : start + nbytes]
    return view.numpy() if view.device.type == "cpu" else view


def settle_torch(device: str) -> None:
    """One torch thread: its pool's threads spin on after every op (poison, check) and
    would take the cores UCX's copies run on; the store's copier has threads of its own."""
    torch.set_num_threads(1)
    if device != "cpu":
        torch.cuda.set_device(device)


def synchronizer(device: str) -> Any:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ---- the real store: both ends ----------------------------------------------------------


def new_node(device: str, pool_bytes: int) -> StoreNode:
    """A store node with one pool of ``pool_bytes`` (8 MiB slabs) on ``device``."""
    pool_bytes = round_up(pool_bytes, SLAB_BYTES)
    if device == "cpu":
        return make_store(pool_bytes=pool_bytes, slab_bytes=SLAB_BYTES)
    index = BlockIndex({device: SlotPool(pool_bytes, device, SLAB_BYTES)})
    return StoreNode(Registry(), index, {device: copier_for(device)})


def register(
    node: StoreNode, instance: str, shape: Shape, device: str, cache: int, by_name: bool = False
) -> list[Rank]:
    """Register (and so seal) ``shape.tp`` ranks of kv_first uint8 layers l0, l1, ...,
    one slot per layer per rank per block, whose paged caches hold ``cache`` blocks on
    ``device``. The seal numbers layers by sorted name (l0, l1, l10, l11, ..., l2, ...,
    as vLLM's model.layers.N sort); ``by_name`` registers them in that order too."""
    ranks = []
    for r in range(shape.tp):
        rank = make_rank(
            instance, r, shape.tp, shape.per_block // shape.tp, cache, shape.slot, "bench"
        )
        if by_name:
            order = sorted(range(len(rank.tensors)), key=lambda i: rank.reg.layers[i].geometry.name)
            rank.reg.layers = [rank.reg.layers[i] for i in order]
            rank.tensors = [rank.tensors[i] for i in order]
        if device != "cpu":  # the same layers, on the GPU
            rank.tensors = [t.to(device) for t in rank.tensors]
            for layer, t in zip(rank.reg.layers, rank.tensors):
                region = region_from_tensor(t.view(2, cache, 1, 1, -1), "kv_first")
                rank.reg.regions[layer.geometry.name] = region
            rank.reg.device = device
        node.register(rank.reg)
        ranks.append(rank)
    return ranks


def block_offsets(node: StoreNode, namespace: str, hashes: list[int]) -> np.ndarray:
    """Slot offsets (blocks x slots) of sealed ``hashes`` in the node's one pool."""
    blocks = node.index.sealed_prefix(namespace, hashes)
    if len(blocks) != len(hashes):
        raise AssertionError(f"{len(blocks)} of {len(hashes)} blocks are sealed")
    return np.stack([b.offsets for b in blocks])


class StoreServing:
    """The serving node: blocks saved through StoreNode.save, served by a StoreSource."""

    def __init__(self, device: str, pool_bytes: int, by_name: bool):
        self.device, self.by_name = device, by_name
        self.node = new_node(device, pool_bytes)
        self.source = StoreSource(self.node.index)
        self.buffer = self.node.index.pool(device).buffer
        self.ranks: list[Rank] = []  # every registered rank's cache stays alive

    async def prepare(self, shape: Shape) -> tuple[str, list[list[int]]]:
        """Drop the last configuration's blocks; save sets A and B of ``shape``."""
        self.node.index.clear()
        cache = max(1, min(shape.blocks, 64, CACHE_BYTES // (shape.per_block * shape.slot)))
        name = f"serve{len(self.node.registry.instances)}"
        ranks = register(self.node, name, shape, self.device, cache, self.by_name)
        self.ranks += ranks
        seal = self.node.registry.instances[name].seal
        namespace = seal.final_namespace
        sets = [[(k + 1) << 40 | i for i in range(shape.blocks)] for k in (0, 1)]
        for k, hashes in enumerate(sets):
            for first in range(0, shape.blocks, cache):
                count = min(cache, shape.blocks - first)
                refs = [(h, i) for i, h in enumerate(hashes[first : first + count])]
                for rank in ranks:
                    self._fill(rank, seal.slots_of(rank.reg).slots.tolist(), shape, k, first, count)
                    await self.node.save(rank.reg.caller_id, refs)
            offsets = block_offsets(self.node, namespace, hashes)
            check_slots(self.buffer, shape, offsets, k, f"serving pool, set {k} after save")
        self.namespace, self.sets = namespace, sets
        return namespace, sets

    def offsets(self, k: int) -> np.ndarray:
        """Where set ``k``'s slots lie in the serving pool (blocks x slots, bytes)."""
        return block_offsets(self.node, self.namespace, self.sets[k])

    def _fill(
        self, rank: Rank, slots: list[int], shape: Shape, k: int, first: int, count: int
    ) -> None:
        """Put the pattern of blocks first.. of set k into the rank's cache blocks 0..
        (``slots``: the slot of each of its layers, as the seal numbers them); a kv_first
        slot is the layer's K segment, then its V segment."""
        half = shape.words // 2
        for s, t in zip(slots, rank.tensors):
            words = slot_words(shape, k, first, count, s, self.device)
            t32 = t.view(torch.int32)
            t32[0, :count] = words[:, :half]
            t32[1, :count] = words[:, half:]


class StoreFetching:
    """The fetching node: a registered instance of the same layout, a Fetcher whose one
    peer is the serving node, and a pool that holds exactly one set."""

    def __init__(self, device: str, shape: Shape, address: str, one_sided: bool = False):
        """``one_sided``: also a Fetcher that reads one-sided (the pool registered with NIXL)."""
        self.node = new_node(device, shape.nbytes)
        self.ranks = register(self.node, "fetch", shape, device, cache=1)
        self.namespace = self.node.registry.instances["fetch"].seal.final_namespace
        self.buffer = self.node.index.pool(device).buffer

        async def find_peers(namespace: str, hashes: list[int]) -> list[PeerPrefix]:
            """As a router would: the serving node holds every block asked for (so
            the fetch reserves its slots while the peer answers)."""
            return [PeerPrefix("serving", "", address, len(hashes))]

        index = self.node.index
        sink = StoreSink(index, self.node.registry)
        self.fetchers = {False: Fetcher(index, sink, find_peers, timeout_s=60)}
        self.endpoint = None
        if one_sided:
            region = rma.pool_region(device, self.buffer.data_ptr(), self.buffer.nbytes)
            self.endpoint = rma.RmaEndpoint(region)
            reader = RmaReader(self.endpoint)
            self.fetchers[True] = Fetcher(index, sink, find_peers, timeout_s=60, rma=reader)

    async def fetch(self, namespace: str, hashes: list[int], one_sided: bool = False) -> int:
        self.node.fetcher = self.fetchers[one_sided]
        n = (await self.node.prefetch(namespace, hashes)).fetched_blocks
        if one_sided and self.fetchers[True].stats().fetches_failed_rma:
            raise AssertionError("a one-sided read failed (retried two-sided)")
        return n

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def forget(self, shape: Shape) -> None:
        """Drop the fetched blocks when the pool holds both sets (small fetches), so the
        next fetch of a set does fetch (larger ones evict the other set)."""
        if 2 * shape.nbytes <= self.buffer.nbytes:
            self.node.index.clear(self.namespace)

    def offsets(self, namespace: str, hashes: list[int]) -> np.ndarray:
        return block_offsets(self.node, namespace, hashes)

    def evictions(self) -> int:
        return self.node.index.stats().evictions


# ---- --transport-only: stub lease / reserve over plain pools -----------------------------


def encode_hash(slot_bytes: int, slots_per_block: int, index: int, tp: int = 1) -> int:
    """The stub source needs no index: a hash says where its block lives."""
    return (tp << 56) | (slot_bytes << 32) | (slots_per_block << 20) | index


def decode_hash(h: int) -> tuple[int, int, int, int]:
    """(slot bytes, slots per block, block index, tp size)."""
    return (h >> 32) & 0xFFFFFF, (h >> 20) & 0xFFF, h & 0xFFFFF, h >> 56


def tp_offsets(region: int, slot: int, per_block: int, tp: int, index: np.ndarray) -> np.ndarray:
    """Offsets (blocks x slots) where rank r owns the r-th ``region`` bytes of a pool and,
    there, block i's slots of that rank (r, r + tp, ...) follow block i - 1's."""
    s = np.arange(per_block, dtype=np.int64)
    return (s % tp) * region + (index[:, None] * (per_block // tp) + s // tp) * slot


def tp_slots(pool: torch.Tensor, offsets: np.ndarray, slot: int) -> SlotTable:
    base = pool.data_ptr()
    return slot_table(base, 0 if pool.device.type == "cpu" else base, offsets, slot, pool)


def slot_table(base: int, key: int, offsets: np.ndarray, slot: int, owner: Any = None) -> SlotTable:
    """The slots at ``offsets`` (blocks x slots, bytes from ``base``) of memory ``key``."""
    n = offsets.size
    return SlotTable(
        np.uint64(base) + offsets.ravel().astype(np.uint64),
        np.full(n, slot, dtype=np.int64),
        np.full(n, key, dtype=np.int64),
        np.full(len(offsets), offsets.shape[1], dtype=np.int64),
        owner=owner,
    )


@dataclass
class StubLease:
    hashes: list[int]
    slots: SlotTable

    def release(self) -> None:
        pass


class StubSource:
    """Every hash is sealed; its place follows from the hash (tp_offsets over the pool)."""

    def __init__(self, pool: torch.Tensor):
        self.pool = pool

    def lease(self, namespace: str, hashes: list[int]) -> StubLease:
        slot, per_block, _, tp = decode_hash(hashes[0])
        index = np.array([decode_hash(h)[2] for h in hashes], dtype=np.int64)
        region = len(self.pool) // tp
        fits = (index + 1) * (per_block // tp) * slot <= region
        n = len(index) if fits.all() else int(np.argmin(fits))
        offsets = tp_offsets(region, slot, per_block, tp, index[:n])
        return StubLease(hashes[:n], tp_slots(self.pool, offsets, slot))


@dataclass
class StubReservation:
    slots: SlotTable

    def keep(self, num_blocks: int) -> None:
        self.slots = self.slots.prefix(num_blocks)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class StubSink:
    """Reserves from the start of the pool every time, in BlockStore.reserve_detached's
    order: rank 0's slots of every block, then rank 1's, ..."""

    def __init__(self, pool: torch.Tensor):
        self.pool = pool

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> StubReservation:
        return StubReservation(tp_slots(self.pool, self.offsets(hashes), slot_sizes[0][0]))

    def offsets(self, hashes: list[int]) -> np.ndarray:
        slot, per_block, _, tp = decode_hash(hashes[0])
        region = len(hashes) * (per_block // tp) * slot
        index = np.arange(len(hashes), dtype=np.int64)
        return tp_offsets(region, slot, per_block, tp, index)


class StubServing:
    def __init__(self, device: str, pool_bytes: int, by_name: bool):
        self.buffer = torch.zeros(pool_bytes, dtype=torch.uint8, device=device)
        self.source = StubSource(self.buffer)

    async def prepare(self, shape: Shape) -> tuple[str, list[list[int]]]:
        """Write sets A and B where the stub source says they lie."""
        n, region = shape.blocks, len(self.buffer) // shape.tp
        sets = []
        for k in (0, 1):
            index = np.arange(k * n, (k + 1) * n, dtype=np.int64)
            offsets = tp_offsets(region, shape.slot, shape.per_block, shape.tp, index)
            rows = torch.from_numpy(offsets.reshape(-1) // shape.slot).to(self.buffer.device)
            words = set_words(shape, k, self.buffer.device)
            slot_rows(self.buffer, shape.slot)[rows] = words.view(torch.uint8)
            sets.append([encode_hash(shape.slot, shape.per_block, int(i), shape.tp) for i in index])
        return STUB_NS, sets


class StubFetching:
    def __init__(self, device: str, shape: Shape, address: str):
        self.buffer = torch.zeros(shape.nbytes, dtype=torch.uint8, device=device)
        self.sink = StubSink(self.buffer)
        self.namespace = STUB_NS
        self.address = address

    async def fetch(self, namespace: str, hashes: list[int]) -> int:
        from kvstore.transfer import fetch

        return await fetch(self.address, namespace, hashes, self.sink, timeout_s=60)

    def offsets(self, namespace: str, hashes: list[int]) -> np.ndarray:
        return self.sink.offsets(hashes)

    def evictions(self) -> int:
        return 0


# ---- serving process ------------------------------------------------------------------------


class RecordingPeerServer(PeerServer):
    """A PeerServer that keeps the segment views of its last fetch (raw_seg sends the same
    sizes). Keeping a reference costs nothing inside the timed fetch."""

    last_views: list[Any] = []

    async def _send_slots(
        self, conn: Any, views: list[Any], deadline: float, first: int = 0
    ) -> None:
        if first == 0:
            self.last_views = views
        await super()._send_slots(conn, views, deadline, first)


class Progressing:
    """The serving NIXL endpoint progressed every millisecond while it is on: during the
    raw NIXL reads, which hold no lease, so the PeerServer (which progresses it while
    it holds a one-sided lease) does not; as bench/rma.py's serving side does."""

    def __init__(self, endpoint: rma.RmaEndpoint | None):
        self.endpoint = endpoint
        self.task: asyncio.Task | None = None

    def set(self, on: bool) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        if on and self.endpoint is not None:
            self.task = asyncio.ensure_future(self._run(self.endpoint))

    @staticmethod
    async def _run(endpoint: rma.RmaEndpoint) -> None:
        while True:
            endpoint.progress()
            await asyncio.sleep(1e-3)


def serve_main(ctrl: Any, env: dict, opts: dict) -> None:
    os.environ.update(env)
    code = 1
    try:
        asyncio.run(_serve(ctrl, opts))
        code = 0
    finally:
        os._exit(code)  # skip UCX finalizers, which can stall interpreter exit


async def _serve(ctrl: Any, opts: dict) -> None:
    from kvstore.transfer.ucx import ucxx_module

    ucxx = ucxx_module()
    device = opts["serve_device"]
    settle_torch(device)
    side_class = StoreServing if opts["source"] == "store" else StubServing
    side = side_class(device, opts["serve_bytes"], opts["layers_by_name"])
    endpoint = None
    if opts["rma"]:  # the serving pool registered once, as a store server does
        region = rma.pool_region(device, side.buffer.data_ptr(), side.buffer.nbytes)
        endpoint = rma.RmaEndpoint(region)
    server = RecordingPeerServer(side.source, timeout_s=60, rma=endpoint)
    await server.start()
    raw_views: list[Any] = []  # raw_seg: the last fetch's message sizes, from the pool start
    progressing = Progressing(endpoint)

    async def raw_handler(ep: Any) -> None:
        request = np.zeros(2, dtype=np.uint64)
        try:
            while True:
                await idle_recv(ep, request, RAW_REQUEST_TAG)
                mode, nbytes = int(request[0]), int(request[1])
                with polled():
                    if mode == RAW_ONE:
                        await ep.send(ucx_view(side.buffer, 0, nbytes), tag=RAW_DATA_TAG)
                    else:
                        sends = [ep.send(v, tag=RAW_DATA_TAG + i) for i, v in enumerate(raw_views)]
                        await asyncio.gather(*sends)
        except Exception:
            ep.abort()

    raw = ucxx.create_listener(raw_handler, port=0)
    card = endpoint.card().encode() if endpoint is not None else None  # nixl_one, nixl_runs
    ctrl.send((server.address, raw.port, sorted(ucxx.get_active_transports()), card))
    loop = asyncio.get_running_loop()
    while True:
        command, arg = await loop.run_in_executor(None, ctrl.recv)
        if command == "stop":
            break
        try:
            reply = await answer(command, arg, side, server, raw_views, progressing)
            ctrl.send((True, reply))
        except Exception:
            ctrl.send((False, traceback.format_exc()))
    raw.close()
    await server.stop()


async def answer(
    command: str,
    arg: Any,
    side: Any,
    server: RecordingPeerServer,
    raw_views: list[Any],
    progressing: Progressing,
) -> Any:
    """The serving process's reply to one command of the fetching process."""
    if command == "prepare":
        return await side.prepare(Shape(**arg))
    if command == "held":  # the pool's first ``arg`` bytes: what raw_one and raw_seg send
        return side.buffer[:arg].cpu().numpy()
    if command == "offsets":  # where set ``arg`` lies here (raw NIXL reads of it)
        return side.offsets(arg)
    if command == "progress":  # on (arg True) around every raw NIXL read
        progressing.set(arg)
        return None
    # "segments": sizes of the last fetch's messages; raw_seg will send them
    sizes = [int(v.nbytes) for v in server.last_views]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    raw_views[:] = [ucx_view(side.buffer, a, n) for a, n in zip(starts, sizes)]
    return sizes


# ---- fetching process -----------------------------------------------------------------------


@dataclass
class Row:
    transport: str
    mem: str
    source: str
    slot_bytes: int
    slots_per_block: int
    tp_size: int
    num_blocks: int
    total_bytes: int
    repeats: int
    gbps: float
    baseline_gbps: float
    ratio: float
    ratio_p10_p50_p90: list[float]
    segments_gbps: float
    ceiling_gbps: float
    ratio_ceiling: float
    ratio_ceiling_min_max: list[float]
    ratio_ceiling_iqr: list[float]
    fetch_ms_min_med_max: list[float]
    messages: int
    evictions: int
    layers_by_name: bool
    device_copy_gbps: float | None = None
    ratio_device_copy: float | None = None
    verified: bool = False
    verified_fetches: int = 0
    verified_raw: int = 0
    rma: dict | None = None  # one-sided fetches of the same sets (one_sided_fields)


def fetch_main(
    result: Any, ctrl: Any, env: dict, opts: dict, measure: Callable | None = None
) -> None:
    """The fetching process: ``measure(ctrl, opts)`` (this bench's, unless another
    bench's) run on a loop of its own; (ok, its result or a traceback) to ``result``."""
    os.environ.update(env)
    try:
        out = (True, asyncio.run((measure or _measure)(ctrl, opts)))
    except BaseException:
        out = (False, traceback.format_exc())
    try:
        ctrl.send(("stop", None))
    except OSError:
        pass  # the serving process is gone already
    result.send(out)
    result.close()
    os._exit(0)  # skip UCX finalizers, which can stall interpreter exit


class NixlRead(NamedTuple):
    """One raw NIXL READ of a set: its runs, and where the set's slots land in the
    fetching pool (blocks x slots, bytes) for the byte check."""

    runs: rma.SlotRuns
    landing: np.ndarray


def same_runs(remote_base: int, remote: np.ndarray, local: SlotTable, slot: int) -> rma.SlotRuns:
    """The runs a one-sided fetch of these slots reads (onesided.runs_for): the serving
    side's slot addresses as its grant carries them, its lanes as its offer chooses them."""
    served = slot_table(remote_base, 0, remote, slot)
    return runs_for(local, Grant(0, 60.0, served.ptr), choose_lanes(served))


def one_run_read(remote_base: int, remote: np.ndarray, local_base: int, shape: Shape) -> NixlRead:
    """The set's bytes as ONE run, when its slots tile one stretch of the serving pool
    (they do: a set is saved in one go); slot i lands where it lay in that stretch."""
    first = int(remote.min())
    if int(remote.max()) + shape.slot - first != shape.nbytes:
        raise AssertionError(f"the set spans {int(remote.max()) + shape.slot - first} bytes")
    return NixlRead(one_run(remote_base + first, local_base, shape.nbytes), remote - first)


def ask(ctrl: Any, command: str, arg: Any = None) -> Any:
    ctrl.send((command, arg))
    ok, reply = ctrl.recv()
    if not ok:
        raise RuntimeError(f"serving process, {command}:\n{reply}")
    return reply


class Bench:
    """The fetching process's side of one sweep: the timed ops of one configuration."""

    def __init__(self, ctrl: Any, raw_ep: Any, opts: dict, card: rma.PeerCard | None = None):
        """``card``: the serving pool's NIXL card (the raw NIXL ops read with it)."""
        self.ctrl, self.raw_ep, self.opts, self.card = ctrl, raw_ep, opts, card
        self.device = opts["fetch_device"]
        self.sync = synchronizer(self.device)
        self.request = np.zeros(2, dtype=np.uint64)

    async def run(self, shape: Shape, repeats: int, seed: int) -> dict:
        """Prepare ``shape`` on both nodes, warm up, time ``repeats`` interleaved repeats."""
        namespace, self.sets = ask(self.ctrl, "prepare", asdict(shape))
        one_sided = self.opts["rma"]
        self.new_side(shape, one_sided)
        if self.side.namespace != namespace:
            raise AssertionError(f"namespaces differ: {self.side.namespace} vs {namespace}")
        self.shape, self.namespace, self.verified, self.messages = shape, namespace, 0, []
        self.held = self.serving_bytes(shape.nbytes)
        self.raw_verified = 0
        await self.warm_up(one_sided)
        evictions = self.side.evictions()
        ops = {
            "fetch": lambda r: self.fetch(),
            "raw_one": lambda r: self.raw_one(),
            "raw_seg": lambda r: self.raw_seg(),
        }
        if one_sided:
            ops["fetch_rma"] = lambda r: self.fetch(one_sided=True)
            ops["nixl_one"] = lambda r: self.nixl("nixl_one", r)
            ops["nixl_runs"] = lambda r: self.nixl("nixl_runs", r)
        if self.device != "cpu":
            ops["device_copy"] = lambda r: self.device_copy()
        times: dict[str, list[float]] = {name: [] for name in ops}
        rng = np.random.default_rng(seed)
        for r in range(repeats):
            for name in rng.permutation(list(ops)):
                self.poison()
                times[name].append(await ops[name](r))
        return {
            "times": times,
            "messages": int(statistics.median(self.messages[2:] or self.messages)),
            "evictions": self.side.evictions() - evictions,
            "verified_fetches": self.verified,
            "verified_raw": self.raw_verified,
            "nixl_runs": len(self.nixl_reads["nixl_runs", 0].runs.nbytes) if one_sided else 0,
            "nixl_verified": self.nixl_verified,
        }

    def serving_bytes(self, nbytes: int) -> torch.Tensor:
        """A copy, on this device, of what the serving pool holds in its first ``nbytes``
        (what raw_one and raw_seg send; nothing writes that pool after its saves)."""
        held = torch.from_numpy(ask(self.ctrl, "held", nbytes)).to(self.device)
        if len(held) != nbytes or bool((held == POISON).all()):
            raise AssertionError("the serving pool's bytes would not tell a raw op from none")
        return held

    def check_raw(self, what: str) -> None:
        """Untimed: the fetching pool's first total_bytes hold the serving pool's."""
        got = self.side.buffer[: self.shape.nbytes]
        if not torch.equal(got, self.held):
            bad = int((got != self.held).nonzero()[0])
            raise AssertionError(
                f"{what}: byte {bad} is {int(got[bad])}, the serving pool holds "
                f"{int(self.held[bad])}"
            )
        self.raw_verified += 1

    def new_side(self, shape: Shape, one_sided: bool) -> None:
        """A fresh fetching side for ``shape`` (the last one's NIXL endpoint closed)."""
        if getattr(self, "side", None) is not None and hasattr(self.side, "close"):
            self.side.close()
        if one_sided:
            self.side = StoreFetching(self.device, shape, self.opts["address"], one_sided=True)
        elif self.opts["source"] == "store":
            self.side = StoreFetching(self.device, shape, self.opts["address"])
        else:
            self.side = StubFetching(self.device, shape, self.opts["address"])

    async def warm_up(self, one_sided: bool) -> None:
        """Fetch A, fetch B (and one-sided), then every raw op once; from here on the
        fetching pool is full."""
        self.turn = 0  # the set the next fetch asks for: A, B, A, ...
        self.landing: dict[int, np.ndarray] = {}  # set -> its slots after its fetch_rma
        self.nixl_verified = 0
        for _ in (0, 1):
            self.poison()
            await self.fetch()
        if one_sided:
            for _ in (0, 1):
                self.poison()
                await self.fetch(one_sided=True)
            self.plan_nixl()
            for name in NIXL_OPS:
                await self.nixl(name, 0)
        for raw in (self.raw_one, self.raw_seg):
            self.poison()
            await raw()

    def plan_nixl(self) -> None:
        """The raw NIXL ceiling's reads of sets A and B: the same agent and registered
        pool as fetch_rma, each set's slots where its warm-up one-sided fetch put them."""
        if self.card is None:
            raise AssertionError("one-sided rows but the serving process sent no NIXL card")
        endpoint = self.side.endpoint
        self.peer = endpoint.connect(self.card)  # the card the Fetcher loaded too
        remote_base, local_base = self.card.region.addr, endpoint.region.addr
        self.nixl_reads: dict[tuple[str, int], NixlRead] = {}
        for k in (0, 1):
            remote = ask(self.ctrl, "offsets", k)
            local = tp_slots(self.side.buffer, self.landing[k], self.shape.slot)
            runs = same_runs(remote_base, remote, local, self.shape.slot)
            self.nixl_reads["nixl_runs", k] = NixlRead(runs, self.landing[k])
            self.nixl_reads["nixl_one", k] = one_run_read(
                remote_base, remote, local_base, self.shape
            )

    async def nixl(self, name: str, r: int) -> float:
        """Timed: one raw NIXL READ of set r % 2 (ONE run, or the runs its fetch reads),
        a blocking wait. Then, untimed: every byte read compared with the pattern."""
        k = r % 2
        read = self.nixl_reads[name, k]
        self.side.buffer.fill_(POISON)  # the landing slots may lie past the first nbytes
        self.sync()
        ask(self.ctrl, "progress", True)  # the serving side progresses, as in a lease
        elapsed = timed_read(self.side.endpoint, self.peer, read.runs)
        ask(self.ctrl, "progress", False)
        check_slots(self.side.buffer, self.shape, read.landing, k, f"{name} of set {k}")
        self.nixl_verified += 1
        return elapsed

    def poison(self) -> None:
        self.side.buffer[: self.shape.nbytes].fill_(POISON)
        self.sync()

    async def fetch(self, one_sided: bool = False) -> float:
        """Timed: fetch the next set (two-sided, or one-sided). Then, untimed: compare
        every byte, learn the messages (of a two-sided fetch)."""
        k, self.turn = self.turn, 1 - self.turn
        hashes = self.sets[k]
        if hasattr(self.side, "forget"):
            self.side.forget(self.shape)
        start = time.perf_counter()
        if one_sided:
            n = await self.side.fetch(self.namespace, hashes, one_sided=True)
        else:
            n = await self.side.fetch(self.namespace, hashes)
        self.sync()
        elapsed = time.perf_counter() - start
        if n != len(hashes):
            raise AssertionError(f"fetched {n} of {len(hashes)} blocks")
        offsets = self.side.offsets(self.namespace, hashes)
        check_slots(self.side.buffer, self.shape, offsets, k, f"fetched set {k}")
        self.verified += 1
        if one_sided:
            self.landing[k] = offsets
        else:
            self.messages.append(len(ask(self.ctrl, "segments")))
        return elapsed

    async def raw_one(self) -> float:
        nbytes = self.shape.nbytes
        self.request[:] = (RAW_ONE, nbytes)
        start = time.perf_counter()
        with polled():
            recv = asyncio.ensure_future(
                self.raw_ep.recv(ucx_view(self.side.buffer, 0, nbytes), tag=RAW_DATA_TAG)
            )
            await asyncio.sleep(0)  # the receive is posted before the request goes, as in a fetch
            await self.raw_ep.send(self.request, tag=RAW_REQUEST_TAG)
            await recv
        self.sync()
        elapsed = time.perf_counter() - start
        self.check_raw("raw_one")
        return elapsed

    async def raw_seg(self) -> float:
        """The last fetch's message sizes, back to back from the start of the pool."""
        sizes = ask(self.ctrl, "segments")
        if sum(sizes) != self.shape.nbytes:
            raise AssertionError(f"the last fetch sent {sum(sizes)} of {self.shape.nbytes} bytes")
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        views = [ucx_view(self.side.buffer, a, n) for a, n in zip(starts, sizes)]
        self.request[:] = (RAW_SEG, sum(sizes))
        start = time.perf_counter()
        with polled():
            recvs = [
                asyncio.ensure_future(self.raw_ep.recv(v, tag=RAW_DATA_TAG + i))
                for i, v in enumerate(views)
            ]
            await asyncio.sleep(0)
            await self.raw_ep.send(self.request, tag=RAW_REQUEST_TAG)
            await asyncio.gather(*recvs)
        self.sync()
        elapsed = time.perf_counter() - start
        self.check_raw("raw_seg")
        return elapsed

    async def device_copy(self) -> float:
        """The GPU's own ceiling for these bytes: one device-to-device copy of the
        serving pool's bytes (held on this device) into the fetching pool's poisoned start."""
        nbytes = self.shape.nbytes
        self.sync()
        start = time.perf_counter()
        self.side.buffer[:nbytes].copy_(self.held)
        self.sync()
        elapsed = time.perf_counter() - start
        self.check_raw("device_copy")
        return elapsed


def ratios(times: dict[str, list[float]]) -> dict[str, np.ndarray]:
    fetch = np.asarray(times["fetch"])
    one, seg = np.asarray(times["raw_one"]), np.asarray(times["raw_seg"])
    ceiling = np.minimum(one, seg)
    return {"fetch": fetch, "one": one, "seg": seg, "ceiling": ceiling, "r": ceiling / fetch}


def spread(r: np.ndarray) -> dict:
    q = np.quantile(r, [0.25, 0.5, 0.75])
    return {
        "ratio_ceiling": round(float(q[1]), 3),
        "ratio_ceiling_min_max": [round(float(r.min()), 3), round(float(r.max()), 3)],
        "ratio_ceiling_iqr": [round(float(q[0]), 3), round(float(q[2]), 3)],
    }


def one_sided_fields(shape: Shape, out: dict) -> dict | None:
    """The one-sided fetch against the two-sided one, the raw ucxx ceiling and the raw
    NIXL ceiling, per repeat."""
    times = out["times"]
    if "fetch_rma" not in times:
        return None
    t = ratios(times)
    one_sided = np.asarray(times["fetch_rma"])
    fields = {
        "gbps": round(shape.nbytes / float(np.median(one_sided)) / 1e9, 3),
        "ms_p10_p50_p90": quantiles(one_sided, 1e3),
        "two_sided_ms_p10_p50_p90": quantiles(t["fetch"], 1e3),
        "raw_one_ms_p10_p50_p90": quantiles(t["one"], 1e3),
        "ratio_ceiling_p10_p50_p90": quantiles(t["ceiling"] / one_sided),
        "speedup_vs_two_sided_p10_p50_p90": quantiles(t["fetch"] / one_sided),
    }
    for name in NIXL_OPS:
        x = np.asarray(times[name])
        fields[f"{name}_ms_p10_p50_p90"] = quantiles(x, 1e3)
        fields[f"{name}_gbps"] = round(shape.nbytes / float(np.median(x)) / 1e9, 3)
    fields |= nixl_ceiling(shape, times)
    fields |= {"nixl_runs": out["nixl_runs"], "nixl_verified_reads": out["nixl_verified"]}
    return fields


def nixl_ceiling(shape: Shape, times: dict[str, list[float]]) -> dict:
    """fetch_rma against the per-repeat faster of nixl_one and nixl_runs (the raw NIXL
    ceiling): its GB/s, ceiling time / fetch_rma time, and fetch_rma's time over it."""
    if "fetch_rma" not in times:
        return {}
    one_sided = np.asarray(times["fetch_rma"])
    best = np.minimum(*(np.asarray(times[name]) for name in NIXL_OPS))
    return {
        "nixl_ceiling_gbps": round(shape.nbytes / float(np.median(best)) / 1e9, 3),
        "nixl_ceiling_ms_p10_p50_p90": quantiles(best, 1e3),
        "ratio_nixl_ceiling_p10_p50_p90": quantiles(best / one_sided),
        "over_nixl_ceiling_ms_p10_p50_p90": quantiles(one_sided - best, 1e3),
    }


def make_row(opts: dict, shape: Shape, out: dict) -> Row:
    t, nbytes = ratios(out["times"]), shape.nbytes
    gbps = {k: nbytes / float(np.median(t[k])) / 1e9 for k in ("fetch", "one", "seg", "ceiling")}
    vs_one = np.quantile(t["one"] / t["fetch"], [0.1, 0.5, 0.9])
    fetch_ms = [np.min(t["fetch"]), np.median(t["fetch"]), np.max(t["fetch"])]
    row = Row(
        transport=opts["tls"],
        mem=opts["mem"],
        source=opts["source"],
        slot_bytes=shape.slot,
        slots_per_block=shape.per_block,
        tp_size=shape.tp,
        num_blocks=shape.blocks,
        total_bytes=nbytes,
        repeats=len(t["fetch"]),
        gbps=round(gbps["fetch"], 3),
        baseline_gbps=round(gbps["one"], 3),
        ratio=round(float(np.median(t["one"] / t["fetch"])), 3),
        ratio_p10_p50_p90=[round(float(q), 3) for q in vs_one],
        segments_gbps=round(gbps["seg"], 3),
        ceiling_gbps=round(gbps["ceiling"], 3),
        fetch_ms_min_med_max=[round(1e3 * float(x), 3) for x in fetch_ms],
        messages=out["messages"],
        evictions=out["evictions"],
        layers_by_name=opts["layers_by_name"],
        verified=True,
        verified_fetches=out["verified_fetches"],
        verified_raw=out["verified_raw"],
        **spread(t["r"]),
        rma=one_sided_fields(shape, out),
    )
    if "device_copy" in out["times"]:
        dc = np.asarray(out["times"]["device_copy"])
        row.device_copy_gbps = round(nbytes / float(np.median(dc)) / 1e9, 3)
        row.ratio_device_copy = round(float(np.median(dc / t["fetch"])), 3)
    return row


def make_latency(opts: dict, shape: Shape, out: dict) -> dict:
    t = ratios(out["times"])
    fetch = sorted(t["fetch"].tolist())
    return {
        "transport": opts["tls"],
        "mem": opts["mem"],
        "source": opts["source"],
        "model": "32 layers, TP2, 8 KV heads x 128, fp16",
        "block_tokens": 16,
        "slot_bytes": shape.slot,
        "slots_per_block": shape.per_block,
        "num_blocks": shape.blocks,
        "total_bytes": shape.nbytes,
        "iters": len(fetch),
        "p50_ms": round(1e3 * _quantile(fetch, 0.5), 3),
        "p99_ms": round(1e3 * _quantile(fetch, 0.99), 3),
        "min_ms": round(1e3 * fetch[0], 3),
        "ceiling_p50_ms": round(1e3 * float(np.median(t["ceiling"])), 3),
        **spread(t["r"]),
        "messages": out["messages"],
        "evictions": out["evictions"],
        "layers_by_name": opts["layers_by_name"],
        "verified": True,
        "verified_fetches": out["verified_fetches"],
        "verified_raw": out["verified_raw"],
        "rma": one_sided_fields(shape, out),
    }


async def _measure(ctrl: Any, opts: dict) -> dict:
    from kvstore.transfer import close_endpoints
    from kvstore.transfer.ucx import loop_progress, ucxx_module

    ucxx = ucxx_module()
    settle_torch(opts["fetch_device"])
    opts["address"], raw_port, server_tls, card = ctrl.recv()
    loop_progress()  # kvstore's progress on this loop (the fetches' own), not ucxx's
    raw_ep = await ucxx.create_endpoint("127.0.0.1", raw_port)
    bench = Bench(ctrl, raw_ep, opts, rma.PeerCard.decode(card) if card else None)
    rows = []
    for i, shape in enumerate(Shape(**s) for s in opts["shapes"]):
        row = make_row(opts, shape, await bench.run(shape, opts["repeats"], seed=i))
        rows.append(row)
        print_row(row)
    shape = Shape(**opts["latency_shape"])
    latency = make_latency(opts, shape, await bench.run(shape, opts["latency_iters"], seed=99))
    if latency["rma"]:
        print(f"      one-sided: {latency['rma']}", flush=True)
    print(
        f"  latency {shape.blocks}-block TP2 prefix ({shape.nbytes >> 20} MiB, "
        f"{latency['messages']} msgs): p50 {latency['p50_ms']} ms  p99 {latency['p99_ms']} ms"
        f"  (ceiling p50 {latency['ceiling_p50_ms']} ms, ratio {latency['ratio_ceiling']}"
        f" [{latency['ratio_ceiling_min_max'][0]}-{latency['ratio_ceiling_min_max'][1]}])",
        flush=True,
    )
    floor = []
    for i, shape in enumerate(Shape(**s) for s in opts["floor_shapes"]):
        out = await bench.run(shape, opts["floor_repeats"], seed=200 + i)
        floor.append({"slots": shape.blocks * shape.per_block, **floor_fields(shape, out)})
        print(f"  control floor {floor[-1]}", flush=True)
    if opts["floor_idle"]:  # the 1-slot floor again, the peer holding idle connections
        idle: list[Any] = []
        try:
            await open_idle(opts["address"], opts["floor_idle"], idle)
            shape = Shape(**opts["floor_shapes"][0])
            out = await bench.run(shape, opts["floor_repeats"], seed=300)
        finally:
            for conn in idle:
                conn.abort()
        floor.append({"slots": 1, "idle_connections": len(idle), **floor_fields(shape, out)})
        print(f"  control floor {floor[-1]}", flush=True)
    raw_ep.abort()
    await close_endpoints()
    return {
        "rows": [asdict(r) for r in rows],
        "latency": latency,
        "control_floor": floor,
        "active_transports": sorted(ucxx.get_active_transports()),
        "server_active_transports": server_tls,
    }


async def open_idle(address: str, n: int, conns: list[Any]) -> None:
    """Open ``n`` connections to the peer at ``address`` into ``conns`` (the caller
    aborts them, also after a failure here), each past its first frame (a card
    exchange: the peer then waits up to its idle timeout, 60 s, for the next)."""
    from kvstore.transfer.ucx import connect, frame_sends, recv_frame
    from kvstore.transfer.wire import Kind, encode_card_request

    loop = asyncio.get_running_loop()
    for _ in range(n):
        conns.append(await connect(address, loop.time() + 5))
        asked = frame_sends(conns[-1], Kind.CARD_REQUEST, encode_card_request())
        await recv_frame(conns[-1], [Kind.CARD], loop.time() + 5, after=asked)


def floor_fields(shape: Shape, out: dict) -> dict:
    """Small fetches: wall time p10/p50/p90 (ms) of each op, interleaved."""
    t = out["times"]
    return {
        "slot_bytes": shape.slot,
        "total_bytes": shape.nbytes,
        "repeats": len(t["fetch"]),
        **{f"{op}_ms_p10_p50_p90": quantiles(np.asarray(x), 1e3) for op, x in t.items()},
        **nixl_ceiling(shape, t),
        "verified_fetches": out["verified_fetches"],
        "verified_raw": out["verified_raw"],
        **({"nixl_verified_reads": out["nixl_verified"]} if "fetch_rma" in t else {}),
    }


def print_row(row: Row) -> None:
    lo, hi = row.ratio_ceiling_min_max
    extra = f"  memcpy {row.device_copy_gbps}" if row.device_copy_gbps else ""
    print(
        f"  {row.transport:>8} {row.mem} {row.source} slot {row.slot_bytes >> 10:>4} KiB"
        f" x {row.num_blocks * row.slots_per_block:>5} ({row.messages:>3} msgs):"
        f" fetch {row.gbps:6.2f}  raw 1 msg {row.baseline_gbps:6.2f}"
        f"  raw same msgs {row.segments_gbps:6.2f} GB/s{extra};"
        f" fetch/ceiling {row.ratio_ceiling:.2f} [{lo:.2f}-{hi:.2f}],"
        f" fetch/1 msg {row.ratio:.2f}",
        flush=True,
    )
    if row.rma:
        print(f"      one-sided: {row.rma}", flush=True)


def _quantile(sorted_samples: list[float], q: float) -> float:
    i = min(len(sorted_samples) - 1, round(q * (len(sorted_samples) - 1)))
    return sorted_samples[i]


# ---- driver ---------------------------------------------------------------------------------


def shapes(args: argparse.Namespace) -> tuple[list[Shape], Shape]:
    total = args.total_mib << 20
    rows = [Shape(s, SLOTS_PER_BLOCK, 1, total // (s * SLOTS_PER_BLOCK)) for s in args.slot_sizes]
    latency = Shape(LATENCY_SLOT, LATENCY_LAYERS * LATENCY_TP, LATENCY_TP, LATENCY_BLOCKS)
    return rows, latency


def run_sweep(tls: str, args: argparse.Namespace) -> dict:
    env = ucx_env(tls)
    rows, latency = shapes(args)
    serve_device = "cpu" if args.mem == "host" else "cuda:0"
    fetch_device = "cpu" if args.mem == "host" else f"cuda:{min(1, _gpu_count() - 1)}"
    opts = {
        "mem": args.mem,
        "source": args.source,
        "layers_by_name": args.layers_by_name,
        "tls": tls,
        "repeats": args.repeats,
        "latency_iters": args.latency_iters,
        "shapes": [asdict(s) for s in rows],
        "latency_shape": asdict(latency),
        "floor_shapes": [asdict(Shape(FLOOR_SLOT, 1, 1, 1)), asdict(Shape(FLOOR_SLOT, 16, 1, 128))],
        "floor_repeats": args.floor_repeats or (15 if args.quick else 40),
        "floor_idle": args.floor_idle,
        "rma": one_sided_on(args),
        "fetch_device": fetch_device,
        "serve_device": serve_device,
        "serve_bytes": 2 * max(s.nbytes for s in [*rows, latency]),  # sets A and B
    }
    out = run_pair(env, opts, opts)
    out["env"] = env
    return out


def run_pair(
    env: dict,
    serve_opts: dict,
    opts: dict,
    measure: Callable | None = None,
    timeout_s: float | None = None,
) -> dict:
    """A serving process (``serve_opts``) and a fetching one running ``measure``
    (this bench's unless given) with ``opts``, both under ``env``; the fetching
    process's result (RuntimeError with its traceback if it failed)."""
    ctx = mp.get_context("spawn")
    serve_ctrl, fetch_ctrl = ctx.Pipe()
    result, result_child = ctx.Pipe(duplex=False)
    server = ctx.Process(target=serve_main, args=(serve_ctrl, env, serve_opts), daemon=True)
    fetcher = ctx.Process(
        target=fetch_main, args=(result_child, fetch_ctrl, env, opts, measure), daemon=True
    )
    server.start()
    fetcher.start()
    for end in (serve_ctrl, fetch_ctrl, result_child):
        end.close()  # the children hold theirs: a dead child is EOF here and there
    try:
        if timeout_s is not None and not result.poll(timeout_s):
            raise TimeoutError(f"no result within {timeout_s} s")
        ok, out = result.recv()
        if not ok:
            raise RuntimeError(f"fetching process failed:\n{out}")
        fetcher.join(10)
        server.join(10)
    finally:
        for p in (server, fetcher):
            if p.is_alive():
                p.kill()
    return out


def one_sided_on(args: argparse.Namespace) -> bool:
    """One-sided rows: pools of real store nodes (host or GPU), NIXL installed, not --no-rma."""
    return not args.no_rma and args.source == "store" and rma.available().ok


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def write_results(sweeps: list[dict], args: argparse.Namespace) -> None:
    path = args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    mine = (args.mem, args.source)

    def kept(items: list[dict]) -> list[dict]:
        """Entries of another (mem, source); ones from before the field were stubs."""
        out = [{"source": "stub", **x} for x in items]
        return [x for x in out if (x.get("mem"), x["source"]) != mine]

    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    host = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": now,
    }
    doc = {
        "benchmark": "peer fetch (store node to store node, kvstore.transfer) vs raw ucxx, "
        "two processes on loopback",
        "note": NOTE,
        "generated": now,
        "quick": args.quick,
        "ucx": [
            {
                "transport": s["rows"][0]["transport"] if s["rows"] else "",
                "mem": args.mem,
                "source": args.source,
                "quick": args.quick,
                "env": s["env"],
                "active_transports": s["active_transports"],
                "server_active_transports": s["server_active_transports"],
                "host": host,
            }
            for s in sweeps
        ]
        + kept(old.get("ucx", [])),
        "rows": [r for s in sweeps for r in s["rows"]] + kept(old.get("rows", [])),
        "latency": [s["latency"] for s in sweeps] + kept(old.get("latency", [])),
        "control_floor": [
            {"mem": args.mem, "source": args.source, **f}
            for s in sweeps
            for f in s.get("control_floor", [])
        ]
        + kept(old.get("control_floor", [])),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc["rows"], doc["latency"], path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


def plot_one_sided(ax: Any, ax_ratio: Any, x: list[int], rma_rows: list[dict], label: str) -> None:
    """fetch_rma and its raw NIXL ceiling (rows that carry both), and their ratio
    (p50, p10-p90 bars)."""
    if not rma_rows or not all("nixl_ceiling_gbps" in r for r in rma_rows):
        return
    color = ax.plot(x, [r["gbps"] for r in rma_rows], "D-", label=f"fetch_rma ({label})")
    color = color[0].get_color()
    ceiling = [r["nixl_ceiling_gbps"] for r in rma_rows]
    ax.plot(x, ceiling, "*:", color=color, label="raw NIXL ceiling")
    q = [r["ratio_nixl_ceiling_p10_p50_p90"] for r in rma_rows]
    err = [[m - lo for lo, m, _ in q], [hi - m for _, m, hi in q]]
    ax_ratio.errorbar(
        x,
        [m for _, m, _ in q],
        yerr=err,
        fmt="D-",
        color=color,
        capsize=3,
        label=f"fetch_rma / raw NIXL ({label})",
    )


def plot(rows: list[dict], latency: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(13, 4.8))
    series = sorted({(r["source"], r["mem"], r["transport"]) for r in rows})
    for source, mem, transport in series:
        mine = sorted(
            (
                r
                for r in rows
                if (r["source"], r["mem"], r["transport"]) == (source, mem, transport)
            ),
            key=lambda r: r["slot_bytes"],
        )
        x = [r["slot_bytes"] >> 10 for r in mine]
        label = f"{source}, {mem}, UCX_TLS={transport}"
        color = ax.plot(x, [r["gbps"] for r in mine], "o-", label=f"fetch ({label})")[0].get_color()
        ax.plot(x, [r["baseline_gbps"] for r in mine], "s--", color=color, label="raw, 1 message")
        if all("ceiling_gbps" in r for r in mine):
            ax.plot(x, [r["ceiling_gbps"] for r in mine], "^:", color=color, label="raw ceiling")
        if mine and mine[0].get("device_copy_gbps"):
            ax.plot(x, [r["device_copy_gbps"] for r in mine], "v-.", color=color, label="memcpy")
        plot_one_sided(ax, ax_ratio, x, [r.get("rma") or {} for r in mine], label)
        if all("ratio_ceiling" in r for r in mine):
            mid = [r["ratio_ceiling"] for r in mine]
            err = [
                [m - r["ratio_ceiling_iqr"][0] for m, r in zip(mid, mine)],
                [r["ratio_ceiling_iqr"][1] - m for m, r in zip(mid, mine)],
            ]
            ax_ratio.errorbar(x, mid, yerr=err, fmt="o-", color=color, capsize=3, label=label)
        else:  # rows from before the ceiling existed: their ratio is to one message
            ax_ratio.plot(
                x, [r["ratio"] for r in mine], "x--", color=color, label=f"{label} (vs 1 msg)"
            )
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("slot size (KiB)")
        a.grid(True, alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title("pull throughput, two processes on loopback")
    ax.legend(fontsize=6)
    ax_ratio.axhline(0.7, color="grey", linestyle=":", label="0.7 target")
    ax_ratio.set_ylabel("fetch / its raw ceiling (p50; IQR, or p10-p90 for rma)")
    ax_ratio.set_ylim(0, 1.3)
    lat = "\n".join(
        f"{x['source']}/{x['mem']}/{x['transport']}: p50 {x['p50_ms']} ms, p99 {x['p99_ms']} ms"
        for x in latency
    )
    ax_ratio.set_title(
        f"fetch: ratio to raw ucxx, fetch_rma: to raw NIXL; 64 MiB TP2 prefix:\n{lat}",
        fontsize=7,
    )
    ax_ratio.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Method, ops and JSON fields: see the module docstring (bench/transfer.py).",
    )
    p.add_argument(
        "--quick", action="store_true", help="64 MiB per fetch, 7 repeats, 20 latency samples"
    )
    p.add_argument("--mem", choices=("host", "cuda"), default="host", help="where both pools live")
    p.add_argument(
        "--transport-only",
        dest="source",
        action="store_const",
        const="stub",
        default="store",
        help="stub lease/reserve over plain pools instead of two store nodes "
        "(the transfer engine alone: no index, pins, eviction or commit)",
    )
    p.add_argument(
        "--layers-by-name",
        action="store_true",
        help="serving ranks register layers in name order (l0, l1, l10, ..., l2, ...), as "
        "zero-padded names would be; default: numeric order, as vLLM registers model.layers.N",
    )
    p.add_argument(
        "--tls",
        action="append",
        help="UCX_TLS value per sweep (repeatable); 'default' leaves UCX to choose",
    )
    p.add_argument(
        "--total-mib", type=int, help="bytes per throughput fetch (default 256; quick 64)"
    )
    p.add_argument("--repeats", type=int, help="interleaved repeats per row (default 15; quick 7)")
    p.add_argument(
        "--latency-iters", type=int, help="latency samples, interleaved (default 100; quick 20)"
    )
    p.add_argument(
        "--no-rma",
        action="store_true",
        help="no one-sided (NIXL) fetches; by default host-memory store rows time them too",
    )
    p.add_argument(
        "--floor-repeats",
        type=int,
        help="control-floor samples, interleaved (default 40; quick 15)",
    )
    p.add_argument(
        "--floor-idle",
        type=int,
        default=IDLE_CONNECTIONS,
        help=f"the 1-slot floor again with this many idle connections at the peer (each "
        f"a wait it looks at; default {IDLE_CONNECTIONS}, under its cap of 256; 0: skip)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "transfer.json",
        help="JSON to merge into (rows of another mem or source are kept); PNG beside it",
    )
    args = p.parse_args()
    args.tls = args.tls or [os.environ.get("UCX_TLS", "default")]
    args.total_mib = args.total_mib or (64 if args.quick else 256)
    args.repeats = args.repeats or (7 if args.quick else 15)
    args.latency_iters = args.latency_iters or (20 if args.quick else 100)
    args.slot_sizes = list(SLOT_SIZES)
    if args.mem == "cuda" and not _gpu_count():
        p.error("--mem cuda: no CUDA device is visible")
    rows, _ = shapes(args)
    if min(s.blocks for s in rows) < 1 or (args.total_mib << 20) % SLAB_BYTES:
        p.error(f"--total-mib must be a multiple of {SLAB_BYTES >> 20}")
    if max(s.blocks for s in rows) > MAX_BLOCKS_PER_REQUEST:  # also keeps pattern words < 2**31
        p.error(f"--total-mib: at most {MAX_BLOCKS_PER_REQUEST} blocks in one fetch")
    room = PortLimits().max_connections - 4  # the fetches' own pooled connections
    if not 0 <= args.floor_idle <= room:
        p.error(f"--floor-idle {args.floor_idle}: need 0..{room} (the peer's connection cap)")
    return args


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    sweeps = []
    for tls in args.tls:
        print(
            f"UCX_TLS={tls} mem={args.mem} source={args.source}: {args.total_mib} MiB per "
            f"fetch, {args.repeats} interleaved repeats",
            flush=True,
        )
        sweeps.append(run_sweep(tls, args))
    write_results(sweeps, args)
    print(f"done in {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
