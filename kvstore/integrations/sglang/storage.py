"""``KVStoreHiCacheStorage``: kvstore as SGLang's HiCache L3 storage backend.

Load it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "allocator": "shm", "interface_v1": 1,
        "address": "127.0.0.1:50051"}'

SGLang builds one backend per rank (scheduler process) and hands it the
rank's host (L2) pool with ``register_mem_pool_host``. The pool lives in
shared memory (``"allocator": "shm"``: a memfd), so the store server maps
SGLang's own pages and copies them straight into and out of its slots:
``batch_set_v1`` is one Save of (page key, host page) pairs, ``batch_get_v1``
one Load, ``batch_exists`` one Query of the longest stored prefix. The
copying interface SGLang uses without ``interface_v1`` (``get``/``set``/
``batch_get``/``batch_set``) works too, by borrowing free pages of the host
pool, but this backend turns ``interface_v1`` on itself.

Keys, namespace and ranks: :mod:`kvstore.integrations.sglang.identity`;
the pool's layouts: :mod:`kvstore.integrations.sglang.layers`; the store
being down never fails a request: :mod:`kvstore.integrations.sglang.link`.

Extra config keys read here (all optional but ``allocator``):
    address          store server, host:port (127.0.0.1:50051)
    namespace        the client namespace; default ``<model>-<digest>-<layout>``
    model_digest     the checkpoint's part of that digest; default: a digest of
                     the checkpoint at SGLang's --model-path (revision and
                     quantisation included), where its runtime context tells it
    instance_id      this engine's id in the store; default from the parent pid
    seal_timeout_s   how long registration waits for every rank (60)
    kv_cache_dtype   SGLang's --kv-cache-dtype; needed for fp8 KV when SGLang's
                     runtime context does not tell it (fp8 pools are uint8)
    retry_s          how often an unreachable store is retried (5)
    timeout_s        deadline of a prefix query (5)
    io_timeout_s     deadline of a Save or Load, and of a peer prefetch (60)
    prefetch         pull the rest of a prefix the node's store lacks from a peer
                     store (one the router, or the store's --peer, names) when
                     SGLang asks which pages are stored (false)
    tls_ca, tls_cert, tls_key   PEM files for mutual TLS to the store server (all
                     three or none; the certificate's CN is this engine's tenant)
A key neither kvstore nor SGLang reads, or a value of the wrong kind, fails the
backend's construction with a ValueError naming it (:mod:`.settings`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.client.store_client import StoreClient
from kvstore.integrations.checkpoint import checkpoint_digest, variant_of
from kvstore.integrations.sglang.identity import (
    RankIdentity,
    client_namespace,
    instance_id,
    page_key,
    rank_identity,
)
from kvstore.integrations.sglang.layers import UnsupportedPool, kv_format, pool_layers
from kvstore.integrations.sglang.link import RankLink
from kvstore.integrations.sglang.settings import read_settings
from kvstore.wire.tls import TlsFiles

log = logging.getLogger(__name__)


def _replica() -> int | None:
    """SGLang's data-parallel replica of this process (None without a DP controller)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        value = get_parallel().dp_rank
    except Exception:  # noqa: BLE001 -- not published outside an SGLang server process
        return None
    return int(value) if value is not None else None


def _unsupported(cfg: HiCacheStorageConfig) -> str | None:
    if cfg.attn_cp_size > 1:
        return f"attention context parallelism (attn_cp_size={cfg.attn_cp_size})"
    if cfg.dcp_size > 1:
        return f"decode context parallelism (dcp_size={cfg.dcp_size})"
    if cfg.should_split_heads or cfg.tp_lcm_size:
        return "heterogeneous TP (tp_lcm_size)"
    return None


class KVStoreHiCacheStorage(HiCacheStorage):
    """kvstore behind SGLang's HiCache: a prefix cache shared by every engine on the node."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        del kwargs  # the dynamic factory's extra keyword arguments; none are used
        cfg = storage_config
        if (why := _unsupported(cfg)) is not None:
            raise NotImplementedError(f"kvstore HiCache backend: {why} is not supported")
        if cfg.extra_config is None:
            cfg.extra_config = {}
        extra = cfg.extra_config
        settings = read_settings(extra)  # ValueError naming a misspelt key or a bad value
        if not extra.get("interface_v1"):
            # SGLang reads this from the same dict right after building the backend:
            # it selects batch_get_v1/batch_set_v1 (zero copy) over the copying calls.
            extra["interface_v1"] = 1
            log.info("kvstore: zero-copy HiCache interface on (interface_v1=1)")
        self.config = cfg
        self.settings = settings
        self.address = settings.address
        self.retry_s = settings.retry_s
        self.seal_timeout_s = settings.seal_timeout_s
        self.io_timeout_s = settings.io_timeout_s
        self.prefetch = settings.prefetch
        tls = TlsFiles.of(settings.tls_ca, settings.tls_cert, settings.tls_key)
        self.client = StoreClient(self.address, timeout=settings.timeout_s, tls=tls)
        self.replica = _replica()
        self.instance_id = ""  # known once the pool is
        self.identity: RankIdentity | None = None
        self.link: RankLink | None = None
        self.mem_pool_host = None
        self.page_size = 0
        log.info(
            "kvstore HiCache backend (tp %d/%d, pp %d/%d, %s) at %s",
            cfg.tp_rank,
            cfg.tp_size,
            cfg.pp_rank,
            cfg.pp_size,
            "MLA" if cfg.is_mla_model else "MHA",
            self.address,
        )

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Register this rank's host pool with the store (the pages are shared, not copied).

        Raises ValueError (a ``layers.UnsupportedPool``) when the pool is not in
        shared memory or its layout is not supported: a configuration error
        SGLang reports at start-up. A store that is down is only logged.
        """
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.config
        fp8 = kv_format(
            mem_pool_host,
            lambda: self.settings.kv_cache_dtype or _server_arg("kv_cache_dtype"),
        )
        layers = pool_layers(mem_pool_host, cfg.is_mla_model, fp8)
        self.page_size = int(mem_pool_host.page_size)
        self.instance_id = instance_id(
            f"{'mla' if cfg.is_mla_model else 'mha'}-{mem_pool_host.layout}",
            dp_rank=cfg.dp_rank,
            replica=self.replica,
            override=self.settings.instance_id,
            engine_port=_server_arg("nccl_port"),
        )
        self.identity = rank_identity(
            instance=self.instance_id,
            namespace=client_namespace(
                cfg.model_name,
                mem_pool_host.layout,
                self.settings.namespace,
                self.settings.model_digest or _checkpoint_digest(),
            ),
            page_size=self.page_size,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            is_mla=cfg.is_mla_model,
            writer=cfg.is_storage_writer,
        )
        log.info(
            "kvstore: registering SGLang %s host pool (%d pages of %d tokens, %d layers) as %s",
            mem_pool_host.layout,
            int(mem_pool_host.size) // self.page_size,
            self.page_size,
            len(layers),
            self.identity.client_namespace,
        )
        self.link = RankLink(
            self.client,
            self.identity,
            layers,
            seal_timeout=self.seal_timeout_s,
            retry_s=self.retry_s,
            io_timeout=self.io_timeout_s,
            prefetch=self.prefetch,
        )
        self.link.start()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's hybrid pool groups (SWA, Mamba, DSA side pools, sidecars) register
        here; this backend stores one KV pool per rank, so it refuses them and the
        attach fails at start-up, rather than every request failing later in the
        ``*_v2`` transfers the base class does not implement."""
        raise UnsupportedPool(
            f"SGLang host pool {host_pool_name!r} ({type(host_pool).__name__}) belongs to a "
            "hybrid pool group (SWA, Mamba, DSA or a sidecar), which kvstore does not store; "
            "run this model without a kvstore HiCache backend"
        )

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """True once this rank is registered and sealed (a helper for tests and
        scripts); raises the KVError of the store's refusal of the registration
        (KeptRank.wait_ready: retried all the same)."""
        return self.link is not None and self.link.wait_ready(timeout)

    # -------------------------------------------------- zero-copy interface (v1)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, the store holds (one Query)."""
        del extra_info  # keys chain from the sequence start: the prefix is in the keys
        hashes = self._hashes(keys)
        if self.link is None or hashes is None:
            return 0
        return self.link.query(hashes)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages into the host pool at ``host_indices`` (one Load); a prefix succeeds."""
        del extra_info
        pairs = self._pairs(keys, host_indices)
        if self.link is None or pairs is None:
            return [False] * len(keys)
        loaded = self.link.load(pairs)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Save the host pool's pages at ``host_indices`` under ``keys`` (one Save)."""
        del extra_info
        if self.identity is not None and not self.identity.writer:
            return [True] * len(keys)  # an MLA replica: the writer rank stores the one copy
        pairs = self._pairs(keys, host_indices)
        if self.link is None or pairs is None:
            return [False] * len(keys)
        return [self.link.save(pairs)] * len(keys)

    def _hashes(self, keys: list[str]) -> list[int] | None:
        try:
            return [page_key(k) for k in keys]
        except ValueError as err:
            log.error("kvstore: %s; these pages are not cached", err)
            return None

    def _pairs(self, keys: list[str], host_indices: torch.Tensor) -> list[tuple[int, int]] | None:
        """(key, host page) pairs; None (logged) when the indices do not hold whole pages."""
        hashes, ps = self._hashes(keys), self.page_size
        if hashes is None:
            return None
        if ps == 0 or host_indices is None or host_indices.numel() != len(keys) * ps:
            log.error(
                "kvstore: %d keys need %d host indices, got %s",
                len(keys),
                len(keys) * ps,
                None if host_indices is None else host_indices.numel(),
            )
            return None
        firsts = host_indices.reshape(len(keys), ps)[:, 0].tolist() if keys else []
        if any(i % ps for i in firsts):
            log.error("kvstore: host indices %s do not start pages of %d tokens", firsts, ps)
            return None
        return [(h, int(i) // ps) for h, i in zip(hashes, firsts)]

    # ---------------------------------------- copying interface (SGLang's default)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        del target_sizes
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Each page as SGLang's flat data page (into ``target_locations[i]`` when
        given), or None from the first page the store does not hold."""
        del target_sizes
        pool = self.mem_pool_host
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys or pool is None:
            return out
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        with self._borrowed_pages(len(keys)) as indices:
            if indices is None:
                return out
            hits = self.batch_get_v1(keys, indices)
            for i, hit in enumerate(hits):
                if not hit:
                    break
                page = pool.get_data_page(int(indices[i * self.page_size]), flat=True)
                dst = targets[i]
                if dst is None:
                    out[i] = page.clone()
                else:
                    dst.view(-1).copy_(page.view(-1))
                    out[i] = dst
        return out

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        del target_location, target_sizes
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store SGLang flat data pages ``values`` under ``keys``: copied into borrowed
        pages of the host pool, then one Save."""
        del target_locations, target_sizes
        pool = self.mem_pool_host
        if not keys:
            return True
        if pool is None or values is None or len(values) != len(keys):
            return False
        if self.identity is not None and not self.identity.writer:
            return True
        with self._borrowed_pages(len(keys)) as indices:
            if indices is None:
                return False
            for i, value in enumerate(values):
                pool.set_from_flat_data_page(int(indices[i * self.page_size]), value)
            return all(self.batch_set_v1(keys, indices))

    @contextmanager
    def _borrowed_pages(self, n: int) -> Iterator[torch.Tensor | None]:
        """``n`` free pages of the host pool (token indices), returned afterwards;
        None when the pool has no room or hands out pages that are not whole."""
        pool, ps = self.mem_pool_host, self.page_size
        indices = pool.alloc(n * ps) if ps else None
        if indices is None:
            log.warning("kvstore: no free host pages to stage %d pages", n)
            yield None
            return
        try:
            pages = indices.reshape(n, ps)
            whole = bool((pages[:, 0] % ps == 0).all()) and bool(
                (pages - pages[:, :1] == torch.arange(ps, dtype=pages.dtype)).all()
            )
            yield indices if whole else None
        finally:
            pool.free(indices)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Nothing: the store is shared with other engines (``kvstore clear`` drops blocks)."""
        log.info("kvstore: HiCache clear() leaves the shared store as it is")

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.client.close()


def _checkpoint_digest() -> str | None:
    """The digest of the checkpoint this engine serves, from its server arguments
    (None where they are not known: the namespace then rests on the name alone)."""
    model_path = _server_arg("model_path")
    if not model_path:
        return None
    variant = variant_of(
        _server_arg("load_format"), _server_arg("json_model_override_args"), _server_arg("dtype")
    )
    return checkpoint_digest(
        str(model_path), _server_arg("revision"), _server_arg("quantization"), variant
    )


def _server_arg(name: str) -> Any:
    """SGLang's server argument ``name`` in this scheduler process, where its
    runtime context tells it (None where not: another SGLang, or no context yet)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return getattr(get_server_args(), name, None)
    except (ImportError, AttributeError, RuntimeError, ValueError):  # ValueError: not set yet
        return None
