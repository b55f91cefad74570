"""End-to-end Save / Load through a real store server process (a section of bench/copy_engine.py).

One rank (TP 1) of a 32-layer model with 8 KV heads x 128, 16 tokens a block,
fp16 (64 KiB per layer per block) registers KV caches in shared memory (or
on the GPU) with a `kvstore serve` subprocess, then times Save and Load of
256 blocks x 32 layers. Two baselines from the same run on the same device:
a contiguous torch copy of the same bytes, and the copier alone moving the
same pieces in this process; their difference to the RPC is the gRPC and
server overhead. Also the round trip of a Save whose one block is already
sealed (no bytes move): the fixed cost of one call.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.copy import copier_for, plan, region_from_tensor
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


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn(0)
    times = []
    for r in range(1, repeats + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(r)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_e2e(args) -> tuple[list[dict], dict]:
    device = "cpu" if args.device == "cpu" else args.device
    repeats = 3 if args.quick else 7
    cache_blocks = 2 * SAVE_BLOCKS
    slot = 2 * BLOCK * HEADS * HEAD_DIM * 2
    nbytes = SAVE_BLOCKS * LAYERS * slot
    port = free_port()
    proc = start_server(port, device.split(":")[0], (repeats + 2) * nbytes + (64 << 20))
    address = f"127.0.0.1:{port}"
    layers = make_layers(device, cache_blocks)
    client = StoreClient(address, timeout=120)
    sess = None
    try:
        sess = client.register("bench", "bench", layers, block_size=BLOCK)
        ns = sess.wait_sealed(30).final_namespace
        ids = list(range(SAVE_BLOCKS))

        def save(r):
            sess.save([((r + 1) << 32 | b, b) for b in ids], timeout=300)

        def load(r):
            sess.load([((r % repeats + 1) << 32 | b, SAVE_BLOCKS + b) for b in ids], timeout=300)

        t_save = timed(save, repeats)
        t_load = timed(load, repeats)
        assert client.query(ns, [1 << 32]).prefix_blocks == 1
        t_call = timed(lambda r: sess.save([(1 << 32, 0)]), 20)
        t_copy = copy_only(layers, device, nbytes, repeats)
        t_base = contiguous(device, nbytes, repeats)
    finally:
        if sess is not None:
            sess.close()
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        for layer in layers:
            if layer.shm is not None:
                layer.shm.close()
    base_gbps = nbytes / t_base / 1e9
    rows = []
    for op, t in (("save", t_save), ("load", t_load)):
        gbps = nbytes / t / 1e9
        rows.append(
            {
                "section": "e2e",
                "device": device,
                "layout": "kv_first",
                "slot_bytes": slot,
                "num_blocks": SAVE_BLOCKS,
                "num_layers": LAYERS,
                "total_bytes": nbytes,
                "op": f"rpc_{op}",
                "gbps": round(gbps, 3),
                "baseline_gbps": round(base_gbps, 3),
                "ratio": round(gbps / base_gbps, 3),
                "ms": round(t * 1e3, 2),
                "copier_only_ms": round(t_copy * 1e3, 2),
                "overhead_ms": round((t - t_copy) * 1e3, 2),
            }
        )
    meta = {
        "save_call_ms_no_bytes": round(t_call * 1e3, 3),
        "repeats": repeats,
        "what": "one Save / Load RPC of 256 blocks x 32 layers (TP1, 64 KiB slots) "
        "vs the copier alone and a contiguous copy of the same bytes",
    }
    print(
        f"e2e: Save {t_save * 1e3:.1f} ms, Load {t_load * 1e3:.1f} ms, copier alone "
        f"{t_copy * 1e3:.1f} ms, contiguous {t_base * 1e3:.1f} ms, empty Save call "
        f"{t_call * 1e3:.2f} ms for {nbytes >> 20} MiB"
    )
    return rows, meta


def copy_only(layers: list[KVLayer], device: str, nbytes: int, repeats: int) -> float:
    """The same pieces moved by the copier in this process, into a scratch pool."""
    pool = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pool.zero_()
    regions = [region_from_tensor(layer.tensor, "kv_first") for layer in layers]
    slot = regions[0].slot_bytes
    addrs = pool.data_ptr() + np.arange(LAYERS * SAVE_BLOCKS, dtype=np.uint64).reshape(
        LAYERS, SAVE_BLOCKS
    ) * np.uint64(slot)
    pieces = plan(regions, np.arange(SAVE_BLOCKS), addrs)
    copier = copier_for(device)
    return timed(lambda r: copier.save(pieces), repeats)


def contiguous(device: str, nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return timed(lambda r: dst.copy_(src), repeats)
