"""End-to-end Save / Load through a real store server process (a section of bench/copy_engine.py).

One rank (TP 1) of a 32-layer model with 8 KV heads x 128, 16 tokens a block,
fp16 (64 KiB per layer per block) registers KV caches in shared memory (or
on the GPU) with a `kvstore serve` subprocess whose pool holds three requests:
from the fourth Save on, every Save of 256 new blocks evicts 256 old ones, as
a cache in steady state does. Per repeat, in a fresh random order: a Save of
new blocks, a Load of the previous repeat's blocks into other block ids, a
Save whose one block is already sealed (the fixed cost of a call), the copier
alone moving the same bytes in this process the way the server copies them
(by blocks through the registration's RegionTable on the host and with
``--gpu-copy blocks``, else by planned pieces), and the ceiling (the faster of
a contiguous torch copy and the copier's own routine on one piece of the same
bytes).

Every Save stores bytes of its own: before it (untimed) the Save blocks of every
layer get repeat r's pattern (Pattern: int32 words distinct across layers, K/V,
blocks and 16 consecutive repeats). Before every Load (untimed) its destination
blocks are poisoned (int32 -1, never a pattern word); after it (untimed) every
loaded byte is compared with the pattern of the repeat whose keys it loaded. After
the repeats the last Save's keys are loaded and checked the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.copy import Pieces, RegionTable, copier_for, plan, region_from_tensor
from kvstore.demo import free_port, start_server

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SAVE_BLOCKS = 256


def make_layers(device: str, cache_blocks: int) -> list[KVLayer]:
    layers = []
    for i in range(LAYERS):
        name = f"model.layers.{i:02d}.self_attn"
        if device == "cpu":
            shm = kv_cache_shm("kv_first", cache_blocks, BLOCK, HEADS, HEAD_DIM, torch.float16)
            shm.tensor.view(torch.uint8).random_(0, 255)
            layers.append(KVLayer(name, shm.tensor, "kv_first", "NHD", shm))
        else:
            t = torch.randn(
                2, cache_blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.float16, device=device
            )
            layers.append(KVLayer(name, t, "kv_first", "NHD"))
    return layers


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(
    ops: dict, repeats: int, seed: int = 0, before: dict | None = None, after: dict | None = None
) -> dict[str, list[float]]:
    """Seconds per repeat of each op ``fn(r)``, ops in a fresh random order each repeat;
    ``before[name](r)`` and ``after[name](r)``, where given, run untimed around op name."""
    before, after = before or {}, after or {}
    rng = np.random.default_rng(seed)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(repeats):
        for name in rng.permutation(list(ops)):
            if name in before:
                before[name](r)
            _sync()
            t0 = time.perf_counter()
            ops[name](r)
            _sync()
            samples[name].append(time.perf_counter() - t0)
            if name in after:
                after[name](r)
    return samples


class Pattern:
    """Repeat r's bytes in the Save blocks 0..255: int32 word j of the K (kv 0) or V
    (kv 1) half of block b of layer l is ``(r + 3) % 16 << 27 | l << 22 | kv << 21 |
    b << 13 | j`` (32 layers, 256 blocks, 8,192 words a half: distinct within 16
    consecutive repeats, never negative). Loads land in blocks 256..511."""

    def __init__(self, layers: list[KVLayer], device: str):
        self.layers = layers
        words = BLOCK * HEADS * HEAD_DIM // 2
        n = 2 * SAVE_BLOCKS * words
        self.ramp = torch.arange(n, dtype=torch.int32, device=device).view(2, SAVE_BLOCKS, -1)
        self.verified = 0

    @staticmethod
    def words(layer: KVLayer) -> torch.Tensor:
        """The layer's cache as (K/V, blocks, int32 words)."""
        return layer.tensor.view(torch.int32).view(2, layer.tensor.shape[1], -1)

    def offset(self, r: int, i: int) -> int:
        return ((r + 3) % 16) << 27 | i << 22

    def write(self, r: int) -> None:
        """Repeat r's pattern into the Save blocks of every layer."""
        for i, layer in enumerate(self.layers):
            torch.add(self.ramp, self.offset(r, i), out=self.words(layer)[:, :SAVE_BLOCKS])
        _sync()

    def poison(self) -> None:
        """The Load blocks hold no pattern word."""
        for layer in self.layers:
            self.words(layer)[:, SAVE_BLOCKS : 2 * SAVE_BLOCKS].fill_(-1)
        _sync()

    def check(self, r: int) -> None:
        """The Load blocks hold repeat r's pattern: every byte of every layer."""
        for i, layer in enumerate(self.layers):
            got = self.words(layer)[:, SAVE_BLOCKS : 2 * SAVE_BLOCKS]
            if not torch.equal(got, self.ramp + self.offset(r, i)):
                raise AssertionError(f"{layer.name}: loaded bytes differ from repeat {r}'s Save")
        self.verified += 1


def _key(r: int, b: int) -> int:
    return (r + 3) << 32 | b  # repeat r's block b (r = -3 .. -1 fill the pool first)


def bench_e2e(args) -> tuple[list[dict], dict]:
    device = "cpu" if args.device == "cpu" else args.device
    repeats = 5 if args.quick else 11
    slot = 2 * BLOCK * HEADS * HEAD_DIM * 2
    nbytes = SAVE_BLOCKS * LAYERS * slot
    port = free_port()
    # three requests: every Save evicts the oldest (two would let an interleaved Load of
    # the older one make it newer than the last Save, which LRU then rightly evicts)
    gpu_copy = () if device == "cpu" else ("--gpu-copy", args.gpu_copy)
    by_blocks = device == "cpu" or args.gpu_copy == "blocks"  # how the server copies
    proc = start_server(port, device.split(":")[0], 3 * nbytes, *gpu_copy)
    layers = make_layers(device, 2 * SAVE_BLOCKS)
    client = StoreClient(f"127.0.0.1:{port}", timeout=120)
    sess = None
    pattern = Pattern(layers, device)
    try:
        sess = client.register("bench", "bench", layers, block_size=BLOCK)
        sess.wait_sealed(30)
        ids = list(range(SAVE_BLOCKS))
        for r in (-3, -2, -1):
            pattern.write(r)
            sess.save([(_key(r, b), b) for b in ids], timeout=300)
        local = _local_copies(layers, device, nbytes)
        ops = {
            "save": lambda r: sess.save([(_key(r, b), b) for b in ids], timeout=300),
            "load": lambda r: sess.load(
                [(_key(r - 1, b), SAVE_BLOCKS + b) for b in ids], timeout=300
            ),
            "empty_save": lambda r: sess.save([(_key(r - 1, 0), 0)]),
            "copier_only": lambda r: local.save(by_blocks),
            "one_range": lambda r: local.copier.save(local.one),
            "torch_copy": lambda r: local.dst.copy_(local.src),
        }
        before = {"save": pattern.write, "load": lambda r: pattern.poison()}
        after = {"load": lambda r: pattern.check(r - 1)}  # Load r loads Save r - 1's keys
        t = interleaved(ops, repeats, before=before, after=after)
        evictions = client.stats().evictions
        pattern.poison()  # the last Save's keys, untimed
        sess.load([(_key(repeats - 1, b), SAVE_BLOCKS + b) for b in ids], timeout=300)
        pattern.check(repeats - 1)
    finally:
        if sess is not None:
            sess.close()
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        for layer in layers:
            if layer.shm is not None:
                layer.shm.close()
    rows = _rows(t, device, slot, nbytes)
    for row in rows:  # how the server copied: always by blocks on the host
        row["gpu_copy"] = args.gpu_copy if device != "cpu" else "blocks"
    return rows, _meta(t, repeats, evictions) | {"verified_loads": pattern.verified}


def _rows(t: dict[str, list[float]], device: str, slot: int, nbytes: int) -> list[dict]:
    ceiling = [min(a, b) for a, b in zip(t["torch_copy"], t["one_range"], strict=True)]
    med = {k: statistics.median(v) for k, v in t.items()}
    rows = []
    for op in ("save", "load"):
        ratios = [c / x for c, x in zip(ceiling, t[op], strict=True)]
        rows.append({
            "section": "e2e", "device": device, "layout": "kv_first", "slot_bytes": slot,
            "num_blocks": SAVE_BLOCKS, "num_layers": LAYERS, "total_bytes": nbytes,
            "op": f"rpc_{op}", "gbps": round(nbytes / med[op] / 1e9, 3),
            "ceiling_gbps": round(nbytes / statistics.median(ceiling) / 1e9, 3),
            "ratio": round(statistics.median(ratios), 3),
            "ms_p10_p50_p90": [round(float(x) * 1e3, 2) for x in np.quantile(t[op], [.1, .5, .9])],
            "ms": round(med[op] * 1e3, 2), "copier_only_ms": round(med["copier_only"] * 1e3, 2),
            "overhead_ms_median_of_pairs": round(statistics.median(
                [a - b for a, b in zip(t[op], t["copier_only"], strict=True)]) * 1e3, 2),
            "verified": True, "evicting": op == "save",
        })  # fmt: skip
    return rows


def _meta(t: dict[str, list[float]], repeats: int, evictions: int) -> dict:
    med = {k: round(statistics.median(v) * 1e3, 3) for k, v in t.items()}
    print(
        f"e2e: Save {med['save']:.1f} ms (evicting), Load {med['load']:.1f} ms, copier alone "
        f"{med['copier_only']:.1f} ms, ceiling torch {med['torch_copy']:.1f} / one range "
        f"{med['one_range']:.1f} ms, empty Save call {med['empty_save']:.2f} ms; "
        f"{evictions} evictions; every Load's bytes verified"
    )
    return {
        "median_ms": med, "repeats": repeats, "evictions": evictions,
        "what": "one Save (into a full pool: evicts 256 blocks) / Load RPC of 256 blocks x 32 "
        "layers (TP1, 64 KiB slots), interleaved with the copier alone and the ceiling; "
        "every Save stores its repeat's own pattern (written untimed), every Load's bytes "
        "compared with the pattern of the keys it loaded (untimed)",
    }  # fmt: skip


@dataclass
class LocalCopies:
    """The copier, the request into a scratch pool (as planned pieces, and as the
    registration's table with block ids and slot addresses), the same bytes as one piece."""

    copier: Any
    pieces: Pieces
    table: RegionTable
    slots: np.ndarray  # (layers, blocks) slot addresses in the scratch pool
    one: Pieces
    src: torch.Tensor
    dst: torch.Tensor
    pool: torch.Tensor

    def save(self, by_blocks: bool) -> None:
        """The server's copy of the request: by blocks, or by planned pieces."""
        if by_blocks:
            self.copier.save_blocks(self.table, np.arange(SAVE_BLOCKS), self.slots, wait=True)
        else:
            self.copier.save(self.pieces)


def _local_copies(layers: list[KVLayer], device: str, nbytes: int) -> LocalCopies:
    pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    regions = [region_from_tensor(layer.tensor, "kv_first") for layer in layers]
    slot = regions[0].slot_bytes
    addrs = pool.data_ptr() + np.arange(LAYERS * SAVE_BLOCKS, dtype=np.uint64).reshape(
        LAYERS, SAVE_BLOCKS
    ) * np.uint64(slot)
    pieces = plan(regions, np.arange(SAVE_BLOCKS), addrs)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    one = Pieces(
        paged_addr=np.array([src.data_ptr()], dtype=np.uint64),
        slot_addr=np.array([dst.data_ptr()], dtype=np.uint64),
        nbytes=np.array([nbytes], dtype=np.uint64),
    )
    return LocalCopies(copier_for(device), pieces, RegionTable(regions), addrs, one, src, dst, pool)
