"""The worker half of the vLLM connector: register this rank's KV cache, move its bytes.

One per vLLM worker (tensor/pipeline-parallel rank). It registers the rank's
layers with the store as ``paged`` layers (vLLM's standardised
``[blocks, heads, tokens, K+V]`` views, at any offset in vLLM's one buffer),
waits for the seal, and then runs one Load before the forward and one Save
after it per step, with the (hash, block id) pairs the scheduler planned.

On the CPU, :class:`SharedMemoryKVPool` makes vLLM allocate its KV cache in
POSIX shared memory, so the store server maps vLLM's own memory (no staging
copy), exactly as it maps CUDA memory by IPC on a GPU.

The store is a cache: when it cannot be reached the rank serves without it
(loads fail and are recomputed by vLLM, saves are skipped), logs it once, and
re-registers in the background until the store is back. A store that stops
answering (a Load or Save waits out its whole deadline) is not called again
for ``retry_s``: a hung store costs one deadline, not one every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode

from kvstore.client.kept_rank import KeptRank
from kvstore.client.shared_memory import ShmTensor, shm_empty
from kvstore.client.store_client import (
    KVLayer,
    RankSession,
    RankSpec,
    StoreClient,
    distinct_chunks,
    request_chunks,
)
from kvstore.copy import region_from_tensor
from kvstore.integrations.vllm.scheduler import BlockPair
from kvstore.wire.errors import Code, KVError, unavailable
from kvstore.wire.kv_layout import LayoutKind, paged_layout

log = logging.getLogger(__name__)

MIN_POOL_BYTES = 1 << 20  # smaller int8 zeros are not vLLM's KV buffer
# vLLM's layouts with L and B outermost (its is_block_compact): a layer's block is one
# contiguous run of bytes, which is what the store copies
BLOCK_COMPACT_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


class SharedMemoryKVPool(TorchFunctionMode):
    """Serve vLLM's KV-cache allocation, ``torch.zeros(n, dtype=int8)`` on the CPU,
    from fresh POSIX shared memory; every other call passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[ShmTensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        del types  # torch's signature; the mode handles every type alike
        kwargs = kwargs or {}
        if func is torch.zeros and self._is_kv_buffer(args, kwargs):
            shm = shm_empty((args[0],), torch.int8)
            self.buffers.append(shm)
            log.info("KV cache of %.1f MiB placed in shared memory %s", args[0] / 2**20, shm.name)
            return shm.tensor
        return func(*args, **kwargs)

    @staticmethod
    def _is_kv_buffer(args: tuple, kwargs: dict) -> bool:
        return (
            len(args) == 1
            and isinstance(args[0], int)
            and args[0] >= MIN_POOL_BYTES
            and kwargs.get("dtype") is torch.int8
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        )

    def owner_of(self, t: torch.Tensor) -> ShmTensor:
        """The shared-memory buffer holding all of ``t``; ValueError when none does."""
        for shm in self.buffers:
            offset = shm.offset_of(t)
            end = offset + (t.shape[0] - 1) * t.stride(0) * t.element_size() + t[0].nbytes
            if offset >= 0 and end <= shm.size:
                return shm
        raise ValueError(
            "a KV-cache layer is not inside the shared memory kvstore allocated: vLLM did "
            "not allocate its KV cache through the connector's get_mem_pool_context()"
        )

    def close(self) -> None:
        for shm in self.buffers:
            shm.close()
        self.buffers.clear()


def paged_layers(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    vllm_layout: str,
    pool: SharedMemoryKVPool | None,
    cache_dtype: str = "auto",
) -> list[KVLayer]:
    """One ``paged`` KVLayer per distinct layer view.

    ``cache_dtype``: vLLM's ``--kv-cache-dtype``. Other than "auto" (the
    model's dtype, which the tensors carry) it names the layers' dtype: vLLM
    keeps every fp8 variant in uint8 tensors, and fp8_e4m3 KV loaded as
    fp8_e5m2 would be garbage.

    vLLM registers kernel-granular views when its kernel block is smaller than
    its scheduler block: ``ratio`` consecutive kernel blocks make one block,
    folded into the view so one store block is one scheduler block. Layers that
    share another layer's memory (cross-layer KV sharing) are registered once.
    """
    layers, seen = [], set()
    for name, view in sorted(kv_caches.items()):
        key = (view.data_ptr(), tuple(view.shape))
        if key in seen:
            continue
        seen.add(key)
        kernel_block = view.shape[2]
        if block_size % kernel_block or view.shape[0] % (block_size // kernel_block):
            raise ValueError(
                f"layer {name}: kernel block {kernel_block} does not divide the "
                f"block size {block_size} and the {view.shape[0]} blocks"
            )
        ratio = block_size // kernel_block
        t = view.unflatten(0, (view.shape[0] // ratio, ratio)) if ratio > 1 else view
        _check_block_is_one_run(name, t, vllm_layout, ratio)
        shm = pool.owner_of(view) if pool is not None and not view.is_cuda else None
        kv_dtype = "" if cache_dtype == "auto" else cache_dtype
        layout = paged_layout(vllm_layout, ratio)
        layers.append(KVLayer(name, t, LayoutKind.PAGED, layout, shm, kv_dtype=kv_dtype))
    return layers


def _check_block_is_one_run(name: str, t: torch.Tensor, vllm_layout: str, ratio: int) -> None:
    """ValueError, naming the layout, for a layer whose block is not one run of bytes.

    The store copies each layer's block as one contiguous run. vLLM has layouts
    that split it (LHBNC puts the heads outside the blocks, BHLNC the other
    layers between a block's heads) and ``paged_layout`` takes their names, so
    only the client's geometry check (this same one, when the registration is
    sent) refused them: after register_kv_caches had returned, in the
    background, again every ``retry_s``, while the rank served as if the store
    were down. Checked here, the engine fails at start, saying why and what to
    choose. A layout that happens to be one run (LHBNC with one KV head a rank,
    BHLNC with one layer) is let through: its bytes are LBHNC's.
    """
    try:
        region_from_tensor(t, LayoutKind.PAGED.value)
    except ValueError as err:
        raise ValueError(
            f"layer {name}: vLLM's KV cache layout {vllm_layout} (kernel blocks per block: "
            f"{ratio}) does not keep a layer's block in one contiguous run of bytes, which "
            f"is what kvstore stores ({err}). KVStoreConnector supports the layouts "
            f"{', '.join(BLOCK_COMPACT_LAYOUTS)}: set VLLM_KV_CACHE_LAYOUT to one of them "
            "that the attention backend supports, or run without the connector"
        ) from err


class WorkerSide:
    """One rank's registration, its loads and saves, and its reconnection."""

    def __init__(
        self,
        client: StoreClient,
        identity: RankSpec,
        *,
        seal_timeout: float = 120.0,
        retry_s: float = 5.0,
        rpc_timeout: float = 60.0,
        plans_in_flight: int = 1,
    ):
        self.client = client
        self.identity = identity
        self.seal_timeout = seal_timeout
        self.retry_s = retry_s
        self.rpc_timeout = rpc_timeout
        self._layers: list[KVLayer] = []
        self._rank: KeptRank | None = None
        self.load_errors: set[int] = set()
        self.skipped = 0  # loads and saves not sent: the store had stopped answering
        # plans vLLM builds before it hears how a step went: 1, or its batch queue's
        # depth (2 with async scheduling, the pipeline's with pipeline parallelism)
        self.plans_in_flight = plans_in_flight
        self._skip_until = 0  # plans numbered below it save nothing (a load failed)
        self._quiet_until = 0.0  # time.monotonic() before which the store is not called

    def register(self, layers: list[KVLayer]) -> None:
        """Register and wait for the seal; a store that is down is retried in the background."""
        self._layers = layers
        self._rank = KeptRank(
            self.client,
            self.identity,
            layers,
            seal_timeout=self.seal_timeout,
            retry_s=self.retry_s,
            engine="vLLM",
        )
        self._rank.start()

    def wait_ready(self, timeout: float) -> bool:
        """True once the rank is registered and sealed, waiting at most ``timeout`` s;
        raises the KVError of the store's refusal of the registration
        (KeptRank.wait_ready: retried all the same)."""
        return self._rank is not None and self._rank.wait_ready(timeout)

    def _live_session(self) -> RankSession | None:
        return self._rank.live() if self._rank is not None else None

    def load(self, pairs: list[BlockPair], step: int = 0) -> None:
        """Load the step's blocks before the forward (called every step, first);
        failures are reported, never raised. ``step``: the plan's number."""
        if not pairs:
            return
        session = self._live_session()
        began = time.monotonic()
        try:
            if session is None:
                raise unavailable("not registered with the store")
            if self._quiet():
                self.skipped += 1
                self.load_errors.update(p.block_id for p in pairs)
                self._load_failed(step)
                return
            for chunk in distinct_chunks([tuple(p) for p in pairs]):
                began = time.monotonic()  # each call has its own deadline
                session.load(chunk, timeout=self.rpc_timeout)
        except KVError as err:
            log.warning(
                "kvstore: load of %d blocks failed (%s); vLLM recomputes them", len(pairs), err
            )
            self.load_errors.update(p.block_id for p in pairs)
            self._load_failed(step)
            self._failed(err, began)

    def _load_failed(self, step: int) -> None:
        self._skip_until = max(self._skip_until, step + self.plans_in_flight)

    def save(self, pairs: list[BlockPair], step: int = 0) -> None:
        """Save the step's newly full blocks after the forward (best effort).

        Not in the step whose Load failed here, nor in the plans vLLM built
        before it heard of that (``plans_in_flight`` plans from it, numbered by
        ``step``): the blocks the Load was to fill hold stale KV (vLLM recomputes
        them), and so may blocks computed on top of them. The scheduler plans
        those saves again once it hears (SchedulerSide.load_failed). The other
        ranks cannot know and save theirs: ``step`` keeps the store from ever
        sealing those slots beside a later step's."""
        if not pairs:
            return
        if step < self._skip_until:
            log.warning(
                "kvstore: save of %d blocks skipped: a load failed here in a step planned "
                "before this one was, so their KV may rest on blocks vLLM has yet to "
                "recompute",
                len(pairs),
            )
            return
        session = self._live_session()
        if session is None:
            return
        if self._quiet():
            self.skipped += 1
            return
        if any(layer.tensor.is_cuda for layer in self._layers):
            torch.cuda.current_stream().synchronize()  # the forward's kernels wrote them
        began = time.monotonic()
        try:
            for chunk in request_chunks([tuple(p) for p in pairs]):
                began = time.monotonic()  # each call has its own deadline
                session.save(chunk, timeout=self.rpc_timeout, step=step)
        except KVError as err:
            log.warning(
                "kvstore: save of %d blocks failed (%s); they stay uncached", len(pairs), err
            )
            self._failed(err, began)

    def _quiet(self) -> bool:
        """The store stopped answering a moment ago: no call until ``retry_s`` passed."""
        return time.monotonic() < self._quiet_until

    def _failed(self, err: KVError, began: float) -> None:
        """A call that waited out its whole deadline: the store holds the connection
        and answers nothing. Not an answer of the store's (a peer it fetched from
        timed out, a copy that could not end in time: quick, and this step's only),
        nor a store that is gone (the session ends; calls then cost nothing)."""
        waited = time.monotonic() - began
        if err.code is not Code.DEADLINE_EXCEEDED or waited < 0.9 * self.rpc_timeout:
            return
        self._quiet_until = time.monotonic() + self.retry_s
        log.warning(
            "kvstore: the store did not answer within %.1f s; this rank loads and saves "
            "nothing for %.1f s (vLLM recomputes what it would have loaded)",
            self.rpc_timeout,
            self.retry_s,
        )

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self, pools: Iterable[SharedMemoryKVPool] = ()) -> None:
        if self._rank is not None:
            self._rank.close()
        for pool in pools:
            pool.close()
