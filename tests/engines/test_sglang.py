"""kvstore as SGLang's HiCache storage backend, through SGLang's own classes.

SGLang's server needs CUDA, so no engine runs here; what does run is what an
SGLang scheduler process does with a storage backend: SGLang's real
``HiCacheStorageConfig``, its ``StorageBackendFactory.create_backend("dynamic",
...)`` path, and a host pool built on SGLang's real ``HostKVCache`` base class
with its real shared-memory allocator (``"allocator": "shm"``:
``ShmHostTensorAllocator``, memfd). The pool's tensor shapes and page copies
follow SGLang 0.5.23's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``
(``mem_cache/pool_host/mha.py``, ``mla.py``), whose modules cannot be imported
here (their package imports torchvision, which ``.venv-engines`` drops). Page
keys are SGLang's real ``get_hash_str`` chains. Each rank is its own process;
the store is a real ``kvstore serve`` process.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

import pytest
import torch

from kvstore.testing.engines import StoreProcess
from tests.engines.conftest import BAD_EXTRA_CONFIG

PAGE = 4  # tokens per page
HEADS, HEAD_DIM, LAYERS, MLA_DIM = 4, 8, 3, 24  # HEADS in total: each TP rank holds HEADS / tp
CAPACITY = 16 * PAGE  # device tokens; the host pool gets ratio 2 of it plus SGLang's extra page
MHA = [
    ("mha", layout) for layout in ("layer_first", "page_first", "page_first_direct", "page_head")
]
MLA = [("mla", layout) for layout in ("layer_first", "page_first", "page_first_direct")]


# ------------------------------------------------------------- in the rank processes


def _host_kv_cache():
    """SGLang's real HostKVCache base class and allocators, without the package
    ``__init__`` of ``pool_host`` (it imports the model configs, which need torchvision)."""
    name = "sglang.srt.mem_cache.pool_host"
    if name not in sys.modules:
        import sglang.srt.mem_cache as mem_cache

        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [
            os.path.join(next(iter(mem_cache.__path__)), "pool_host")
        ]
        sys.modules[name] = importlib.util.module_from_spec(spec)
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    return HostKVCache


class MHAPoolBody:
    """MHATokenToKVPoolHost's buffer and flat pages (head_dim == v_head_dim)."""

    def __init__(self, layout: str, heads: int, allocator: str):
        self.head_num, self.head_dim, self.dtype = heads, HEAD_DIM, torch.float16
        self.layer_num = self.target_layer_num = LAYERS
        super().__init__(
            dtype=self.dtype,
            device_capacity_tokens=CAPACITY,
            size_per_token=self.get_size_per_token(),
            start_layer=0,
            end_layer=LAYERS - 1,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=PAGE,
            layout=layout,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator,
        )

    def get_size_per_token(self):
        return 2 * self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize

    def init_kv_buffer(self):
        from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

        L, H, D, n, ps = self.layer_num, self.head_num, self.head_dim, self.size, PAGE
        dims = {
            "layer_first": (2, L, n, H, D),
            "page_first": (2, n, L, H, D),
            "page_first_direct": (2, self.page_num, L, ps, H, D),
            "page_head": (2, self.page_num, H, ps, L, D),
        }[self.layout]
        return ALLOC_MEMORY_FUNCS["cpu"](
            dims, dtype=self.dtype, device="cpu", pin_memory=False, allocator=self.allocator
        )

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real : real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))

    def load_to_device_per_layer(self, *args, **kwargs):
        raise NotImplementedError("no device here")

    def backup_from_device_all_layer(self, *args, **kwargs):
        raise NotImplementedError("no device here")


class MLAPoolBody(MHAPoolBody):
    """MLATokenToKVPoolHost's buffer and flat pages (one replicated latent per token)."""

    def __init__(self, layout: str, heads: int, allocator: str):
        del heads  # MLA is not sharded by head
        self.kv_cache_dim = MLA_DIM
        super().__init__(layout, 1, allocator)

    def get_size_per_token(self):
        return self.kv_cache_dim * self.layer_num * self.dtype.itemsize

    def init_kv_buffer(self):
        from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

        L, D, n = self.layer_num, self.kv_cache_dim, self.size
        dims = {
            "layer_first": (L, n, 1, D),
            "page_first": (n, L, 1, D),
            "page_first_direct": (self.page_num, L, PAGE, 1, D),
        }[self.layout]
        return ALLOC_MEMORY_FUNCS["cpu"](
            dims, dtype=self.dtype, device="cpu", pin_memory=False, allocator=self.allocator
        )

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[real : real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        shape = (self.layer_num, self.page_size, 1, self.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()


def _pool_classes():
    """SGLang-shaped MHA and MLA host pools on SGLang's real HostKVCache."""
    host_kv_cache = _host_kv_cache()
    mha = type("MHAPool", (MHAPoolBody, host_kv_cache), {})
    mla = type("MLAPool", (MLAPoolBody, host_kv_cache), {})
    return mha, mla


class SGLangRank:
    """One SGLang scheduler process's storage side: per (kind, layout) a host pool and the
    backend SGLang's factory builds for it, attached as ``HiCacheController`` does."""

    def __init__(
        self,
        address,
        model,
        tp_rank,
        tp_size,
        pools,
        instance=None,
        retry_s=5.0,
        timeout_s=5.0,
        prefetch=False,
        dp_rank=0,
    ):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        mha_pool, mla_pool = _pool_classes()
        self.tp_rank, self.ranks = tp_rank, {}
        for kind, layout in pools:
            extra = {
                "backend_name": "kvstore",
                "module_path": "kvstore.integrations.sglang",
                "class_name": "KVStoreHiCacheStorage",
                "allocator": "shm",
                "address": address,
                "retry_s": retry_s,
                "timeout_s": timeout_s,
                "prefetch": prefetch,
                "seal_timeout_s": 30,
            }
            if instance is not None:
                extra["instance_id"] = f"{instance}-{kind}-{layout}"
            cls = mla_pool if kind == "mla" else mha_pool
            pool = cls(layout, HEADS // tp_size, "shm")
            config = HiCacheStorageConfig(
                tp_rank=tp_rank,
                tp_size=tp_size,
                pp_rank=0,
                pp_size=1,
                attn_cp_rank=0,
                attn_cp_size=1,
                is_mla_model=kind == "mla",
                enable_storage_metrics=False,
                is_page_first_layout=layout == "page_first",
                model_name=model,
                extra_config=extra,
                dp_rank=dp_rank,
            )
            backend = StorageBackendFactory.create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            self.ranks[f"{kind}/{layout}"] = (pool, backend, config)

    def ready(self, timeout: float) -> bool:
        return all(b.wait_ready(timeout) for _, b, _ in self.ranks.values())

    def info(self, key: str) -> dict:
        pool, backend, config = self.ranks[key]
        link = backend.link
        return {
            "interface_v1": config.extra_config.get("interface_v1"),
            "fd_in_allocator": link.layers[0].host_fd.fd in pool.allocator.fds,
            "pid_is_mine": link.layers[0].host_fd.pid == os.getpid(),
            "layers": [layer.name for layer in link.layers],
            "instance_id": backend.instance_id,
            "namespace": link.final_namespace,
        }

    def _indices(self, pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])

    def fill(self, key: str, pages: list[int], seed: int) -> None:
        """Random bytes in whole host pages, determined by (seed, page, tp rank)."""
        pool = self.ranks[key][0]
        for i, p in enumerate(pages):
            g = torch.Generator().manual_seed(seed * 1000 + i * 10 + self.tp_rank)
            flat = pool.get_dummy_flat_data_page().view(torch.int16)
            flat.copy_(torch.randint(-(2**15), 2**15, flat.shape, dtype=torch.int16, generator=g))
            pool.set_from_flat_data_page(p * PAGE, flat.view(torch.float16))

    def digest(self, key: str, pages: list[int]) -> list[str]:
        pool = self.ranks[key][0]
        return [
            hashlib.sha256(
                pool.get_data_page(p * PAGE).view(torch.uint8).numpy().tobytes()
            ).hexdigest()[:16]
            for p in pages
        ]

    def clear(self, key: str, pages: list[int]) -> None:
        pool = self.ranks[key][0]
        for p in pages:
            pool.get_data_page(p * PAGE, flat=False).zero_()

    def set(self, key: str, keys: list[str], pages: list[int]) -> list[bool]:
        return self.ranks[key][1].batch_set_v1(keys, self._indices(pages))

    def get(self, key: str, keys: list[str], pages: list[int]) -> list[bool]:
        return self.ranks[key][1].batch_get_v1(keys, self._indices(pages))

    def exists(self, key: str, keys: list[str]) -> int:
        return self.ranks[key][1].batch_exists(keys)

    def skipped(self, key: str) -> int:
        """Calls that skipped an unreachable store instead of waiting on it."""
        return self.ranks[key][1].link.skipped

    def prefetches_skipped(self, key: str) -> int:
        return self.ranks[key][1].link.prefetches_skipped

    def copy_get(self, key: str, keys: list[str]) -> list[str | None]:
        """SGLang's copying path: batch_get into flat dummy pages; digests of what came back."""
        pool, backend, _ = self.ranks[key]
        pages = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        return [
            None
            if page is None
            else hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for page in pages
        ]

    def copy_set(self, key: str, keys: list[str], pages: list[int]) -> bool:
        """SGLang's copying path: batch_set of flat data pages (copies of host pages)."""
        pool, backend, _ = self.ranks[key]
        return backend.batch_set(keys, [pool.get_data_page(p * PAGE).clone() for p in pages])

    def side_pool_error(self, key: str) -> str:
        """register_mem_host_pool_v2 of a hybrid group's side pool on a live backend."""
        pool, backend, _ = self.ranks[key]
        try:
            backend.register_mem_host_pool_v2(pool, "swa")
        except ValueError as err:
            return str(err)
        return "registered"

    def unshared_pool_error(self) -> str:
        """register_mem_pool_host of a pool from SGLang's default (non-shm) allocator."""
        pool = _pool_classes()[0]("page_first", HEADS, "default")
        backend = _backend_from({}, pool, allocator=None)
        try:
            backend.register_mem_pool_host(pool)
        except ValueError as err:
            return str(err)
        finally:
            backend.close()
        return "registered"

    def close(self) -> None:
        for _, backend, _ in self.ranks.values():
            backend.close()


def _serve(conn, args, kwargs) -> None:
    try:
        rank = SGLangRank(*args, **kwargs)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, call_args, call_kwargs = conn.recv()
        try:
            conn.send(("ok", getattr(rank, op)(*call_args, **call_kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
        if op == "close":
            return


# --------------------------------------------------------------------- the parent


class Rank:
    """Parent-side handle of one SGLang rank process; start several, then ``started()``."""

    def __init__(self, *args, **kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, args, kwargs), daemon=True)
        self.proc.start()
        self._started = False

    def _reply(self, timeout: float = 180):
        assert self.conn.poll(timeout), "SGLang rank process did not answer"
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def started(self) -> Rank:
        if not self._started:
            self._reply()
            self._started = True
        return self

    def __getattr__(self, op):
        def call(*args, **kwargs):
            self.started()
            self.conn.send((op, args, kwargs))
            return self._reply()

        return call

    def begin_stop(self) -> None:
        """Ask the process to close its backends and exit (without waiting)."""
        if self._started and self.proc.is_alive():
            self.conn.send(("close", (), {}))

    def stop(self) -> None:
        if not self._started:
            self.proc.kill()
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def sglang_keys():
    """SGLang's own page keys (chained SHA-256 hex, native hash) of a few prompts."""
    from tests.engines.conftest import need

    need("sglang")
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = list(range(100, 100 + 6 * PAGE))
    other = list(range(900, 900 + 6 * PAGE))
    return {"p": get_hash_str(tokens, None, page_size=PAGE), "q": get_hash_str(other, None, PAGE)}


@pytest.fixture
def ranks():
    made: list[Rank] = []

    def make(*args, **kwargs) -> Rank:
        made.append(Rank(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.begin_stop()
    for r in made:
        r.stop()


@pytest.fixture(scope="module")
def store(workdir):
    s = StoreProcess(workdir, "sglang")
    yield s
    s.kill()


def test_key_is_the_first_16_hex_digits(sglang_keys):
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    from kvstore.integrations.sglang.identity import page_key

    for key in sglang_keys["p"]:
        assert len(key) == 64
        assert page_key(key) == hash_str_to_int64(key) & (2**64 - 1)
    for bad in ("not-a-hash", sglang_keys["p"][0][:15], f"{sglang_keys['p'][0]}_L0-3"):
        with pytest.raises(ValueError, match="hex digest of at least 16 digits"):
            page_key(bad)


def test_pages_round_trip_between_engines_every_layout(store, ranks, sglang_keys):
    keys, other = sglang_keys["p"][:4], sglang_keys["q"][:4]
    pools = MHA + MLA
    a = ranks(store.address, "org/tiny-model", 0, 1, pools, instance="engine-a")
    b = ranks(store.address, "org/tiny-model", 0, 1, pools, instance="engine-b")
    c = ranks(store.address, "org/other-model", 0, 1, pools, instance="engine-c")
    for r in (a, b, c):
        assert r.started().ready(30)

    src, dst = [1, 2, 3, 4], [7, 3, 9, 2]  # host pages of engine a, and of engine b
    for kind, layout in pools:
        key = f"{kind}/{layout}"
        info = a.info(key)
        assert info["interface_v1"] == 1  # SGLang takes the zero-copy path
        assert info["fd_in_allocator"] and info["pid_is_mine"]  # SGLang's own memfd
        assert all(f"sglang.{kind}.{layout}." in n for n in info["layers"])
        assert info["namespace"] == b.info(key)["namespace"] != c.info(key)["namespace"]

        a.fill(key, src, seed=1)
        want = a.digest(key, src)
        assert len(set(want)) == 4
        assert a.exists(key, keys) == 0
        assert a.set(key, keys, src) == [True] * 4
        a.clear(key, src)
        assert a.digest(key, src) != want

        b.clear(key, dst)
        assert b.exists(key, keys) == 4
        assert b.exists(key, [*keys, other[0]]) == 4
        assert b.exists(key, [keys[0], other[0], *keys[2:]]) == 1  # a prefix, not a count
        assert b.exists(key, [other[0], *keys]) == 0
        assert b.get(key, keys, dst) == [True] * 4
        assert b.digest(key, dst) == want, key  # every byte of every page
        assert b.copy_get(key, keys) == want  # SGLang's copying interface reads the same

        # a missing page in the middle: the pages before it load, none after
        b.clear(key, dst)
        got = b.get(key, [keys[0], keys[1], other[1], keys[3]], dst)
        assert got == [True, True, False, False]
        assert b.digest(key, dst)[:2] == want[:2]
        assert b.digest(key, dst)[2:] != want[2:]

        # another model: no hits, and nothing is written into its pages
        c.fill(key, dst, seed=2)
        before = c.digest(key, dst)
        assert c.exists(key, keys) == 0
        assert c.get(key, keys, dst) == [False] * 4
        assert c.digest(key, dst) == before

    # SGLang's copying interface (batch_set of flat pages) lands on the same keys
    key = "mha/page_first"
    a.fill(key, [5, 6], seed=3)
    want = a.digest(key, [5, 6])
    assert a.copy_set(key, other[:2], [5, 6])
    assert b.exists(key, other) == 2
    assert b.get(key, other[:2], [10, 11]) == [True, True]
    assert b.digest(key, [10, 11]) == want

    stats = store.stats()
    assert stats.bytes_saved > 0 and stats.bytes_loaded > 0 and stats.hits > 0


def test_tp2_ranks_keep_their_own_bytes(store, ranks, sglang_keys):
    keys = sglang_keys["p"][:3]
    pools = [("mha", "page_first"), ("mla", "page_first")]
    d = [ranks(store.address, "m", r, 2, pools) for r in range(2)]  # default instance id
    e = [ranks(store.address, "m", r, 2, pools, instance="engine-e") for r in range(2)]
    for r in (*d, *e):
        assert r.started().ready(30)
    assert d[0].info("mha/page_first")["instance_id"].startswith("sglang-")

    src, dst = [1, 2, 3], [4, 8, 6]
    mha = "mha/page_first"
    for r in d:
        r.fill(mha, src, seed=5)
    want = [r.digest(mha, src) for r in d]
    assert want[0] != want[1]  # each rank holds its own heads

    assert d[0].set(mha, keys, src) == [True] * 3
    assert e[0].exists(mha, keys) == 0  # rank 1's shard is missing: not whole yet
    assert d[1].set(mha, keys, src) == [True] * 3
    for r in range(2):
        assert e[r].exists(mha, keys) == 3
        e[r].clear(mha, dst)
        assert e[r].get(mha, keys, dst) == [True] * 3
        assert e[r].digest(mha, dst) == want[r]

    # MLA is replicated: SGLang's writer (TP rank 0) stores the one copy every rank loads
    mla = "mla/page_first"
    d[0].fill(mla, src, seed=6)
    d[1].fill(mla, src, seed=7)
    want0 = d[0].digest(mla, src)
    assert d[1].set(mla, keys, src) == [True] * 3  # not the writer: nothing is stored
    assert e[1].exists(mla, keys) == 0
    assert d[0].set(mla, keys, src) == [True] * 3
    for r in range(2):
        e[r].clear(mla, dst)
        assert e[r].get(mla, keys, dst) == [True] * 3
        assert e[r].digest(mla, dst) == want0


def test_attention_dp_groups_under_one_configured_instance_id_both_cache(store, ranks, sglang_keys):
    """Before: extra config ``instance_id`` replaced the whole id, dropping the
    attention-DP group (and DP replica) suffix, yet SGLang hands the one string
    to every scheduler process and each group numbers its ranks from 0: group
    1's rank 0 was refused (ALREADY_EXISTS, retried for ever) and that group
    never saved or loaded a page (found by review). Now the override keeps
    the group's suffix: both groups register and share pages."""
    keys = sglang_keys["p"][:2]
    key = "mha/page_first"
    pools = [("mha", "page_first")]
    groups = [ranks(store.address, "m", 0, 1, pools, "adp-engine", dp_rank=g) for g in range(2)]
    assert groups[0].ready(30)
    assert groups[1].ready(15), "attention-DP group 1 never registered"
    assert groups[1].info(key)["instance_id"] == "adp-engine-mha-page_first-adp1"
    groups[0].fill(key, [1, 2], seed=12)
    assert groups[0].set(key, keys, [1, 2]) == [True, True]
    assert groups[1].get(key, keys, [5, 6]) == [True, True]
    assert groups[1].digest(key, [5, 6]) == groups[0].digest(key, [1, 2])


def test_store_down_is_a_miss_then_it_comes_back(workdir, ranks, sglang_keys):
    keys = sglang_keys["q"][:2]
    s = StoreProcess(workdir, "sglang-down")
    s.kill()
    try:
        r = ranks(s.address, "m", 0, 1, [("mha", "page_first")], instance="late", retry_s=0.5)
        key = "mha/page_first"
        r.fill(key, [1, 2], seed=8)
        want = r.digest(key, [1, 2])
        assert r.exists(key, keys) == 0
        assert r.set(key, keys, [1, 2]) == [False, False]
        assert r.get(key, keys, [3, 4]) == [False, False]
        assert "allocator" in r.unshared_pool_error()  # SGLang's default allocator: told to use shm
        assert "hybrid pool group" in r.side_pool_error(key)  # SWA, Mamba, ...: refused

        s.start()
        assert r.ready(30)
        assert r.set(key, keys, [1, 2]) == [True, True]
        assert r.exists(key, keys) == 2
        r.clear(key, [1, 2])
        assert r.get(key, keys, [1, 2]) == [True, True]
        assert r.digest(key, [1, 2]) == want
    finally:
        s.kill()


def test_an_engine_on_another_node_gets_pages_from_a_peer_store(workdir, ranks, sglang_keys):
    """Before: the SGLang backend asked its own node's store only, so pages
    another node's store held were recomputed (the README claimed otherwise;
    found by review). With ``prefetch`` a query whose prefix the node's store
    lacks asks it to pull the rest from a peer store over UCX (here store b
    names store a with --peer); the pages then load byte-exact."""
    keys = sglang_keys["p"][:3]
    key = "mha/page_first"
    a = StoreProcess(workdir, "sglang-a", transfer=True)
    b = StoreProcess(workdir, "sglang-b", "--peer", f"127.0.0.1:{a.ucx_port}", transfer=True)
    try:
        writer = ranks(a.address, "m", 0, 1, [("mha", "page_first")], "node-a")
        plain = ranks(b.address, "m", 0, 1, [("mha", "page_first")], "node-b-plain")
        reader = ranks(b.address, "m", 0, 1, [("mha", "page_first")], "node-b", prefetch=True)
        assert writer.ready(30) and plain.ready(30) and reader.ready(30)
        writer.fill(key, [1, 2, 3], seed=11)
        assert writer.set(key, keys, [1, 2, 3]) == [True, True, True]
        assert plain.exists(key, keys) == 0  # its own store only
        assert reader.exists(key, keys) == 3  # pulled from a
        assert reader.get(key, keys, [4, 5, 6]) == [True, True, True]
        assert reader.digest(key, [4, 5, 6]) == writer.digest(key, [1, 2, 3])
    finally:
        a.kill()
        b.kill()


def test_a_hung_peer_costs_one_prefetch_then_prefetch_rests(workdir, ranks, sglang_keys):
    """Before: with prefetch on and the peer store stopped (SIGSTOP), every query
    that missed waited out the store's fetch timeout (10 s each on SGLang's one
    prefetch thread; found by review). Now a failed prefetch turns prefetch off
    for retry_s: the next misses are answered from the node's store at once."""
    keys = sglang_keys["q"][:2]
    key = "mha/page_first"
    a = StoreProcess(workdir, "sglang-hung-peer", transfer=True)
    peer = ["--peer", f"127.0.0.1:{a.ucx_port}", "--fetch-timeout", "1"]
    b = StoreProcess(workdir, "sglang-asker", *peer, transfer=True)
    try:
        writer = ranks(a.address, "m", 0, 1, [("mha", "page_first")], "hung-a")
        reader = ranks(b.address, "m", 0, 1, [("mha", "page_first")], "ask-b", 60.0, 5.0, True)
        assert writer.ready(30) and reader.ready(30)
        writer.fill(key, [1, 2], seed=4)
        assert writer.set(key, keys, [1, 2]) == [True, True]
        os.kill(a.proc.pid, signal.SIGSTOP)
        assert reader.exists(key, keys) == 0  # the fetch from a fails
        for _ in range(3):
            assert reader.exists(key, keys) == 0
        assert reader.prefetches_skipped(key) == 3
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        a.kill()
        b.kill()


def test_a_store_that_hangs_costs_one_deadline_then_is_skipped(workdir, ranks, sglang_keys):
    """Before: a store that stopped answering (SIGSTOP: a swap storm, a long
    pause) cost every call its whole deadline, a query 5 s, then a Save 60 s
    and a Load more, while SGLang's backup and prefetch threads held their host
    pages (found by review: 57 s). Now one unanswered call marks it unreachable:
    the calls after it skip the store (a failed save, a miss) until retry_s has
    passed and a prefix query finds it answering, then pages round-trip again."""
    keys = sglang_keys["q"][:2]
    s = StoreProcess(workdir, "sglang-frozen")
    key = "mha/page_first"
    try:
        r = ranks(s.address, "m", 0, 1, [("mha", "page_first")], "frozen", 1.0, 1.0)
        assert r.ready(30)
        r.fill(key, [1, 2], seed=3)
        want = r.digest(key, [1, 2])
        os.kill(s.proc.pid, signal.SIGSTOP)
        assert r.exists(key, keys) == 0  # unanswered: DEADLINE_EXCEEDED after timeout_s
        assert r.set(key, keys, [1, 2]) == [False, False]
        assert r.get(key, keys, [3, 4]) == [False, False]
        assert r.skipped(key) == 2  # neither waited on the store
        os.kill(s.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while r.set(key, keys, [1, 2]) != [True, True]:  # the probe finds it, or re-registers
            assert time.monotonic() < deadline, "the store was not used again"
            time.sleep(0.2)
        assert r.exists(key, keys) == 2
        assert r.get(key, keys, [3, 4]) == [True, True]
        assert r.digest(key, [3, 4]) == want
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
        s.kill()


def test_server_arguments_that_change_weights_or_kv_change_the_namespace(tmp_path, monkeypatch):
    """Before: the namespace digested --model-path, --revision and --quantization
    only, so an engine on --load-format dummy (random weights) or with a
    --json-model-override-args RoPE scaling over the production engine's
    checkpoint shared its pages (found by review). Now those and --dtype are
    in the digest, read from SGLang's real ServerArgs as its runtime context
    gives them to a scheduler process."""
    from tests.engines.conftest import need

    need("sglang")
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from kvstore.integrations.sglang.storage import _checkpoint_digest

    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    rope = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'
    engines = {
        "production": {},
        "dummy": {"load_format": "dummy"},
        "rope": {"json_model_override_args": rope},
        "fp16": {"dtype": "float16"},
        "safetensors": {"load_format": "safetensors"},  # the same weights
    }
    digests = {}
    for name, args in engines.items():
        # what the scheduler's context answers (setting it here would build its
        # model-config bags, which import torchvision: .venv-engines drops it)
        server_args = ServerArgs(model_path=str(model), **args)
        monkeypatch.setattr(runtime_context, "get_server_args", lambda a=server_args: a)
        digests[name] = _checkpoint_digest()
    assert len({digests[n] for n in ("production", "dummy", "rope", "fp16")}) == 4
    assert digests["safetensors"] == digests["production"]


def _backend_from(extra: dict, pool=None, allocator: str | None = "shm"):
    """SGLang's dynamic factory building the kvstore backend from ``extra`` over
    ``pool`` (None: no pool yet); ``allocator``: the extra config's (None: SGLang's
    default allocator, whose pools are not shared)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config={
            "backend_name": "kvstore",
            "module_path": "kvstore.integrations.sglang",
            "class_name": "KVStoreHiCacheStorage",
            **({} if allocator is None else {"allocator": allocator}),
            **extra,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, pool)


@pytest.mark.parametrize(
    ("extra", "named"),
    [*BAD_EXTRA_CONFIG, ({"io_timeout_s": -1}, "io_timeout_s must be")],
)
def test_a_bad_extra_config_key_is_refused_at_start_naming_it(extra, named):
    """Before: the backend read its keys with ``extra.get`` and ignored the rest,
    so a misspelt key ran the engine on the default (another store, a minute's
    deadline) without a word, ``"prefetch": "flase"`` turned prefetch on, a zero
    retry_s spun, and a non-number failed naming no key (found by review). Now
    SGLang's factory raises a ValueError naming the key, and SGLang's own keys
    and every kvstore key are accepted."""
    from tests.engines.conftest import need

    need("sglang")
    with pytest.raises(ValueError, match=named):
        _backend_from(extra)
    good = {
        "address": "127.0.0.1:1",
        "interface_v1": 1,
        "prefetch_threshold": 256,
        "hicache_storage_pass_prefix_keys": False,
        "seal_timeout_s": "30",
        "retry_s": 0.5,
        "prefetch": "off",
        "kv_cache_dtype": "fp8_e4m3",
    }
    backend = _backend_from(good)
    try:
        assert backend.settings.address == "127.0.0.1:1"
        assert backend.settings.seal_timeout_s == 30 and backend.settings.retry_s == 0.5
        assert backend.settings.prefetch is False
    finally:
        backend.close()
