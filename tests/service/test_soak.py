"""A short soak: valid Save / Query / Load / Clear from two instances at once
into a pool too small for what they save, every loaded byte checked.

Two single-rank instances of one layout (so one final namespace) each run two
threads; a thread owns 16 block ids of its instance's shared-memory cache (8
to save from, 8 to load into). A block's bytes are a function of its hash, so
whoever saved it, a load must give back exactly those bytes.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread

SOAK_SECONDS = 15.0
THREADS_PER_INSTANCE = 2
NUM_BLOCKS = 16 * THREADS_PER_INSTANCE  # 16 block ids per thread
BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 4, 32, 2  # 16 KiB a block
POOL_BYTES = 1 << 20  # 64 blocks: the threads save from 400 hashes
HASHES = [0x5000 + i for i in range(400)]


def block_bytes(tensor: torch.Tensor, block_id: int) -> np.ndarray:
    return tensor[:, block_id].contiguous().view(torch.uint8).numpy()


def content(block_hash: int, layer: int, tensor: torch.Tensor) -> torch.Tensor:
    """The bytes block ``block_hash`` has in ``layer``, shaped as one block of ``tensor``."""
    shape = tensor[:, 0].shape
    size = block_bytes(tensor, 0).size
    raw = np.random.default_rng(block_hash * LAYERS + layer).integers(0, 256, size, np.uint8)
    return torch.from_numpy(raw).view(tensor.dtype).reshape(shape)


class Soaker:
    """One thread's loop over its instance's session and its own block ids."""

    def __init__(self, client, session, shms, first_block: int, ns: str, seed: int):
        self.client, self.session, self.shms, self.ns = client, session, shms, ns
        self.save_ids = list(range(first_block, first_block + 8))
        self.load_ids = list(range(first_block + 8, first_block + 16))
        self.rng = random.Random(seed)
        self.ops = {"save": 0, "load": 0, "clear": 0, "exhausted": 0}
        self.verified_bytes = 0
        self.recent: list[int] = []  # the last batch this thread saved, likely still held

    def save(self) -> None:
        hashes = self.rng.sample(HASHES, self.rng.randint(1, 8))
        for layer, shm in enumerate(self.shms):
            for h, b in zip(hashes, self.save_ids):
                shm.tensor[:, b] = content(h, layer, shm.tensor)
        try:
            self.session.save(list(zip(hashes, self.save_ids)))
            self.ops["save"] += 1
            self.recent = hashes
        except KVError as err:  # every slot held by loads and leases: allowed, nothing kept
            assert err.code == Code.RESOURCE_EXHAUSTED, err
            self.ops["exhausted"] += 1

    def query_load(self) -> None:
        hashes = self.recent if self.rng.random() < 0.7 else self.rng.sample(HASHES, 8)
        hit = self.client.query(self.ns, hashes, lease=True)
        if not hit.prefix_blocks:
            return
        try:  # leased: nothing of the prefix can be evicted or cleared before the load
            got = hashes[: hit.prefix_blocks]
            self.session.load(list(zip(got, self.load_ids)))
        finally:
            assert self.client.release(hit.lease_id) == hit.prefix_blocks
        for layer, shm in enumerate(self.shms):
            for h, b in zip(got, self.load_ids):
                want = content(h, layer, shm.tensor).view(torch.uint8).numpy().ravel()
                assert np.array_equal(block_bytes(shm.tensor, b).ravel(), want), (h, layer)
                self.verified_bytes += want.size
        self.ops["load"] += 1

    def run(self, deadline: float, errors: list) -> None:
        try:
            while time.monotonic() < deadline:
                roll = self.rng.random()
                if roll < 0.01:
                    self.client.clear(self.ns)
                    self.ops["clear"] += 1
                elif roll < 0.55:
                    self.save()
                else:
                    self.query_load()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)


def make_instance(client: StoreClient, name: str):
    shms = [
        kv_cache_shm("kv_first", NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)
    ]
    layers = [KVLayer(f"layer.{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(shms)]
    session = client.register(name, "soak", layers, block_size=BLOCK_SIZE)
    return session, shms


@pytest.mark.slow
def test_soak_two_instances_with_eviction_every_byte_checked():
    server = ServerThread(pool_size=POOL_BYTES, device="cpu", slab_bytes=256 << 10)
    client = StoreClient(server.address)
    instances = [make_instance(client, f"soak{i}") for i in range(2)]
    try:
        ns = {s.wait_sealed(10).final_namespace for s, _ in instances}
        assert len(ns) == 1
        soakers = [
            Soaker(StoreClient(server.address), sess, shms, 16 * t, next(iter(ns)), 7 * i + t)
            for i, (sess, shms) in enumerate(instances)
            for t in range(THREADS_PER_INSTANCE)
        ]
        errors: list = []
        deadline = time.monotonic() + SOAK_SECONDS
        threads = [threading.Thread(target=s.run, args=(deadline, errors)) for s in soakers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 60)
        assert not errors, errors
        stats = client.stats()
        loads = sum(s.ops["load"] for s in soakers)
        assert loads > 20 and sum(s.verified_bytes for s in soakers) > 0
        assert stats.evictions > 0, "the pool never filled: the soak tested no eviction"
        assert stats.leases == 0 and stats.inflight_blocks == 0  # nothing leaked
        assert stats.used_bytes <= stats.pool_bytes
        assert client.clear() == stats.sealed_blocks and client.stats().used_bytes == 0
        for s in soakers:
            s.client.close()
    finally:
        for sess, shms in instances:
            sess.close()
            for s in shms:
                s.close()
        client.close()
        server.stop()
