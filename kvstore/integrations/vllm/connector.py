"""``KVStoreConnector``: kvstore as vLLM's external prefix cache (vLLM v1 KV connector API).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"address": "127.0.0.1:50051"}}'

vLLM builds one connector per process: the scheduler's (metadata only,
:mod:`kvstore.integrations.vllm.scheduler`) and one per worker rank (bytes,
:mod:`kvstore.integrations.vllm.worker`). This class only translates vLLM's
calls to those two halves. Loads are synchronous (before the forward), every
layer in one Load; saves happen after the forward, one Save per step. Not
supported: the hybrid KV cache manager (HMA), layer-wise loading, context
parallelism (decode or prefill; refused at start), KV-cache layouts that split
a layer's block (LHBNC, BHLNC; refused in register_kv_caches, at start).

``kv_connector_extra_config`` keys (all optional; any other key, or a value of
the wrong kind, is a ValueError naming it at start):
    address          store server, host:port (127.0.0.1:50051)
    namespace        the client namespace; default: model name + checkpoint digest
    model_digest     the digest part of the default namespace
    lease_ms         how long a matched prefix stays pinned for its request (60000)
    prefetch         ask peer stores for a missing prefix before scheduling (false)
    seal_timeout_s   how long a rank waits for every rank to register (120)
    retry_s          how often an unreachable store is retried (5)
    timeout_s        scheduler-side RPC deadline (2)
    io_timeout_s     a worker's Load or Save deadline (60); a store past it is
                     left alone for retry_s (the rank recomputes meanwhile)
    recompute_failed_loads   set vLLM's kv_load_failure_policy to "recompute"
                     (true): a block the store cannot load is recomputed; vLLM's
                     default, "fail", fails the request
    tls_ca, tls_cert, tls_key   PEM files for mutual TLS to the store server (all
                     three or none; the certificate's CN is this engine's tenant)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.client.store_client import RankSpec, StoreClient
from kvstore.integrations.checkpoint import variant_of
from kvstore.integrations.extra import DEFAULT_ADDRESS, count, read_extra
from kvstore.integrations.vllm.identity import client_namespace, hash_format, none_hash_seed
from kvstore.integrations.vllm.scheduler import SchedulerSide, StepPlan
from kvstore.integrations.vllm.worker import SharedMemoryKVPool, WorkerSide, paged_layers
from kvstore.wire.limits import MAX_LEASE_MS
from kvstore.wire.tls import TlsFiles

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

OWNER = "KVStoreConnector"  # what the engine's log shows refusing a key
# kvstore's keys of the extra config, by kind, with their defaults
_TEXT = {
    "address": DEFAULT_ADDRESS,
    "namespace": "",
    "model_digest": "",
    "tls_ca": "",
    "tls_cert": "",
    "tls_key": "",
}
_SECONDS = {"seal_timeout_s": 120.0, "retry_s": 5.0, "timeout_s": 2.0, "io_timeout_s": 60.0}
_FLAGS = {"prefetch": False, "recompute_failed_loads": True}
_COUNTS = {"lease_ms": 60_000}


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass(frozen=True)
class Settings:
    """The connector's configuration, from vLLM's config and the extra config."""

    address: str
    instance_id: str
    client_namespace: str
    block_size: int
    hash_algo: str
    lease_ms: int
    prefetch: bool
    seal_timeout_s: float
    retry_s: float
    timeout_s: float
    io_timeout_s: float = 60.0
    recompute_failed_loads: bool = True
    tls: TlsFiles | None = None

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> Settings:
        """ValueError, naming the setting, for what the connector does not support."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # a misspelt key or a value of the wrong kind is refused, not run on a default
        given = read_extra(OWNER, extra, _TEXT, _SECONDS, _FLAGS, _COUNTS)
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        for option in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, option, 1) > 1:  # scheduler blocks are block_size x cp
                raise ValueError(
                    f"KVStoreConnector does not support context parallelism: {option} is "
                    f"{getattr(parallel, option)} (its block hashes cover several cache "
                    "blocks); run without it or without the connector"
                )
        instance = f"vllm-{vllm_config.kv_transfer_config.engine_id}"
        if parallel.data_parallel_size > 1:
            instance += f"-dp{parallel.data_parallel_rank}"
        return cls(
            address=given["address"],
            instance_id=instance,
            client_namespace=client_namespace(
                model.served_model_name or model.model,
                model.model,
                revision=model.revision,
                quantization=model.quantization,
                override=given["namespace"],
                model_digest=given["model_digest"],
                variant=variant_of(
                    vllm_config.load_config.load_format, model.hf_overrides, model.dtype
                ),
            ),
            block_size=vllm_config.cache_config.block_size,
            hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
            lease_ms=count(OWNER, "lease_ms", given["lease_ms"], most=MAX_LEASE_MS),
            prefetch=given["prefetch"],
            seal_timeout_s=given["seal_timeout_s"],
            retry_s=given["retry_s"],
            timeout_s=given["timeout_s"],
            io_timeout_s=given["io_timeout_s"],
            recompute_failed_loads=given["recompute_failed_loads"],
            tls=TlsFiles.of(given["tls_ca"], given["tls_cert"], given["tls_key"]),
        )


def plans_in_flight(vllm_config: Any) -> int:
    """Plans vLLM's engine builds before it processes a step's output: its batch
    queue's depth (``VllmConfig.max_concurrent_batches``: 2 with async
    scheduling, the pipeline's depth with pipeline parallelism), else 1. A
    version without the property gets the pipeline's depth plus one, and one
    more with async scheduling (more skips a few saves, never fewer)."""
    depth = getattr(vllm_config, "max_concurrent_batches", None)
    if isinstance(depth, int) and depth >= 1:
        return depth
    pp = vllm_config.parallel_config.pipeline_parallel_size
    return pp + 1 + bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))


def _log_through_vllm() -> None:
    """Send kvstore's log lines through vLLM's handlers, so they land in the engine's log."""
    ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore behind vLLM: a shared, cross-engine, cross-node prefix cache."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self.settings = s = Settings.from_vllm(vllm_config)
        self.client = StoreClient(s.address, timeout=s.timeout_s, tls=s.tls)
        self._requests: dict[str, Any] = {}
        self._pool: SharedMemoryKVPool | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.client,
                s.instance_id,
                s.block_size,
                expected_hash_format=self._scheduler_hash_format,
                lease_ms=s.lease_ms,
                prefetch=s.prefetch,
                retry_s=s.retry_s,
            )
            self._adopt_recompute_policy()
        log.info(
            "kvstore connector (%s) for %s at %s, namespace %s",
            role.name,
            s.instance_id,
            s.address,
            s.client_namespace,
        )

    def _adopt_recompute_policy(self) -> None:
        """A cache's failed load is a miss: vLLM's default policy ("fail") fails
        the request instead. vLLM reads the policy after making this connector,
        so it is set here unless ``recompute_failed_loads`` is false."""
        kv = self._kv_transfer_config
        if kv.kv_load_failure_policy == "recompute":
            return
        if not self.settings.recompute_failed_loads:
            log.warning(
                "kvstore: kv_load_failure_policy is %r (recompute_failed_loads=false): a "
                "store that dies mid-load fails the request instead of recomputing it",
                kv.kv_load_failure_policy,
            )
            return
        log.info(
            "kvstore: kv_load_failure_policy %r -> 'recompute': a block the store cannot "
            "load is recomputed, never a failed request (recompute_failed_loads=false keeps it)",
            kv.kv_load_failure_policy,
        )
        kv.kv_load_failure_policy = "recompute"

    def _scheduler_hash_format(self) -> str:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed

        return hash_format(self.settings.hash_algo, get_none_hash_seed())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ------------------------------------------------------------ worker

    def get_mem_pool_context(self):
        if self._kv_transfer_config.kv_buffer_device != "cpu":
            return None  # on a GPU the store maps vLLM's allocation by CUDA IPC
        self._pool = SharedMemoryKVPool()
        return self._pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        s, cache = self.settings, self._vllm_config.cache_config
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        pp = get_pp_group()
        identity = RankSpec(
            instance_id=s.instance_id,
            client_namespace=s.client_namespace,
            hash_format=hash_format(s.hash_algo, none_hash_seed(s.hash_algo, s.instance_id)),
            block_size=s.block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            rank=pp.rank_in_group * tp_size + tp_rank,
            world_size=pp.world_size * tp_size,
        )
        layout = cache.get_resolved_kv_cache_layout().name
        layers = paged_layers(kv_caches, s.block_size, layout, self._pool, cache.cache_dtype)
        self._worker = WorkerSide(
            self.client,
            identity,
            seal_timeout=s.seal_timeout_s,
            retry_s=s.retry_s,
            rpc_timeout=s.io_timeout_s,
            plans_in_flight=plans_in_flight(self._vllm_config),
        )
        self._worker.register(layers)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        del forward_context, kwargs  # the plan says what to load; one Load for every layer
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVStoreConnectorMetadata):
            self._worker.load(meta.plan.loads, meta.plan.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv loads every layer before the forward."""
        del layer_name

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        """Nothing per layer: wait_for_save saves every layer once the forward is done
        (so CUDA graph replay, which skips per-layer hooks, cannot skip a save)."""
        del layer_name, kv_layer, attn_metadata, kwargs

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVStoreConnectorMetadata):
            self._worker.save(meta.plan.saves, meta.plan.step)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close([self._pool] if self._pool is not None else [])
        self.client.close()

    # --------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self._requests[request.request_id] = request
        tokens = self._scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVStoreConnectorMetadata(
            self._scheduler.build_plan(scheduler_output, self._requests)
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step: blocks whose load failed are planned to
        be saved again (SchedulerSide.load_failed)."""
        if self._scheduler is not None and connector_output.invalid_block_ids:
            self._scheduler.load_failed(set(connector_output.invalid_block_ids))

    def request_finished(self, request: Any, block_ids: list[int]):  # noqa: ARG002
        self._requests.pop(request.request_id, None)
        self._scheduler.finished(request.request_id)
        return False, None
