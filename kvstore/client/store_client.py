"""Client library for connectors: register a rank, wait for the seal, save/load.

A worker (one tensor-parallel rank) describes each KV-cache layer as a
:class:`KVLayer` (its tensor plus the layout of that tensor) and registers
them all with :meth:`StoreClient.register`. The returned :class:`RankSession`
keeps the registration alive: its RegisterLayers call stays open until
:meth:`RankSession.close` (or the process dies), which is how the server
knows the rank is gone (docs/design.md §1, sessions).

Host KV caches must live in POSIX shared memory (:func:`kv_cache_shm`) so the
server can map them; CUDA tensors are shared by IPC handle
(``kvstore.client.shared_memory``). Every refusal surfaces as a
:class:`KVError` whose code is the gRPC status of the same name.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.shared_memory import ShmTensor, cuda_ipc_export, device_uuid_of, shm_empty
from kvstore.client.tls import RECONNECT_OPTIONS, open_channel
from kvstore.copy import region_from_tensor
from kvstore.wire.errors import Code, KVError
from kvstore.wire.hashing import HASH_FORMAT
from kvstore.wire.kv_layout import LayoutKind
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST
from kvstore.wire.tls import TlsFiles

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 << 20),
    *RECONNECT_OPTIONS,
]


@dataclass
class KVLayer:
    """One layer of this rank's paged KV cache.

    ``kind``: a :class:`LayoutKind` or its value: "kv_first"
    ``[2, num_blocks, ...]``, "blocks_first" ``[num_blocks, 2, ...]`` or "mla"
    ``[num_blocks, block_size, dim]`` (docs/design.md §3); stored as the enum.
    ``kv_layout``: byte order inside a block, "NHD", "HND" or "MLA".
    ``shm``: the shared-memory object holding a host tensor.
    ``kv_dtype``: the KV's own format where the tensor holds it as raw bytes
    (engines keep fp8 KV of any variant in uint8): part of the layout
    fingerprint, so fp8_e4m3 and fp8_e5m2 caches never share blocks; default
    the tensor's dtype.
    """

    name: str
    tensor: torch.Tensor
    kind: LayoutKind | str = LayoutKind.KV_FIRST
    kv_layout: str = "NHD"
    shm: ShmTensor | None = None
    replicated: bool = False
    kv_dtype: str = ""

    def __post_init__(self) -> None:
        self.kind = LayoutKind(self.kind)

    def spec(self) -> pb.LayerSpec:
        """The LayerSpec of this layer in a RegisterLayers request (docs/design.md §1)."""
        region = region_from_tensor(self.tensor, self.kind.value)
        return pb.LayerSpec(
            name=self.name,
            dtype=self.kv_dtype or str(self.tensor.dtype).removeprefix("torch."),
            bytes_per_block=region.segments * region.segment_bytes,
            segments=region.segments,
            kv_layout=self.kv_layout,
            layout_kind=self.kind.proto,
            num_blocks=region.num_blocks,
            block_stride=region.block_stride,
            segment_stride=region.segment_stride,
            replicated=self.replicated,
            memory=self._cuda_memory() if self.tensor.is_cuda else self._host_memory(),
        )

    def _cuda_memory(self) -> pb.MemoryHandle:
        ptr, index = self.tensor.data_ptr(), self.tensor.device.index
        handle, base, size = cuda_ipc_export(ptr, index)
        return pb.MemoryHandle(
            cuda=pb.CudaIpc(
                handle=handle, device_uuid=device_uuid_of(index), size=size, offset=ptr - base
            )
        )

    def _host_memory(self) -> pb.MemoryHandle:
        if self.shm is None:
            raise ValueError(
                f"layer {self.name!r}: a host KV tensor must live in shared "
                "memory; allocate it with kvstore.client.kv_cache_shm"
            )
        return pb.MemoryHandle(
            host=pb.HostShm(
                name=self.shm.name, size=self.shm.size, offset=self.shm.offset_of(self.tensor)
            )
        )


def kv_cache_shm(
    kind: LayoutKind | str,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    kv_layout: str = "NHD",
) -> ShmTensor:
    """A zeroed host KV cache of one layer in shared memory, in vLLM's shapes."""
    shape = LayoutKind(kind).shape(num_blocks, block_size, heads, head_dim, kv_layout)
    return shm_empty(shape, dtype)


# The store answers a registration once it has checked and mapped the layers:
# well under a second as a rule, and a hung server must not hang the engine.
ACCEPT_TIMEOUT_S = 60.0
# How long a Load waits past its timeout for a copy the store began in time: far
# beyond any copy's length at the pace the store assumes when it begins one.
LATE_COPY_S = 30.0
MAX_START_WITHIN_MS = (1 << 32) - 1  # the field's range: a longer timeout is "this long"


@dataclass
class SealInfo:
    """What a rank learns when its instance seals (docs/design.md §1, the seal)."""

    fingerprint: str
    final_namespace: str
    layer_ids: dict[str, int]


@dataclass
class RankSession:
    """A live registration: the open RegisterLayers call and its latest state."""

    instance_id: str
    rank: int
    stub: pb_grpc.KVStoreStub
    call: grpc.Call
    session: str = ""
    state: int = 0
    ranks_registered: int = 0
    seal: SealInfo | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _error: KVError | None = None
    _thread: threading.Thread | None = None

    def start(self, timeout: float = ACCEPT_TIMEOUT_S) -> None:
        """Wait for the server's first answer, then follow the stream in a thread.

        Raises :class:`KVError` when the registration is refused, the stream
        ends unanswered, or no answer comes within ``timeout`` (a server whose
        port is up but whose service hangs: gRPC's keepalive would not tell).
        """
        timer = threading.Timer(timeout, self.call.cancel)
        timer.daemon = True
        timer.start()
        try:
            self._apply(next(self.call))
        except StopIteration:
            raise KVError(Code.UNAVAILABLE, "registration stream ended unanswered") from None
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED and not timer.is_alive():
                raise KVError(
                    Code.DEADLINE_EXCEEDED,
                    f"instance {self.instance_id!r} rank {self.rank}: the store did not "
                    f"answer the registration within {timeout:g}s",
                ) from None
            raise kv_error(exc, "registration refused") from None
        finally:
            timer.cancel()
        self._thread = threading.Thread(
            target=self._follow, daemon=True, name=f"kvstore-session-{self.rank}"
        )
        self._thread.start()

    def _apply(self, update: pb.RegistrationUpdate) -> None:
        with self._cond:
            self.session = update.session
            self.state = update.state
            self.ranks_registered = update.ranks_registered
            self.seal = (
                SealInfo(update.fingerprint, update.final_namespace, dict(update.layer_ids))
                if update.state == pb.RegistrationUpdate.SEALED
                else None
            )
            self._cond.notify_all()

    def _follow(self) -> None:
        try:
            for update in self.call:
                self._apply(update)
            err = KVError(Code.UNAVAILABLE, "registration stream ended")
        except grpc.RpcError as exc:
            err = kv_error(exc, "registration stream failed")
        with self._cond:
            self._error = err
            self.seal = None
            self._cond.notify_all()

    def wait_sealed(self, timeout: float = 30.0) -> SealInfo:
        """Block until every rank is in; raise KVError(DEADLINE_EXCEEDED) otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.seal or self._error, timeout):
                raise KVError(
                    Code.DEADLINE_EXCEEDED,
                    f"instance {self.instance_id!r} not sealed after {timeout}s: "
                    f"{self.ranks_registered} ranks registered",
                )
            if self.seal is None:
                raise self._error
            return self.seal

    @property
    def error(self) -> KVError | None:
        """Why the registration ended (the stream failed or closed), or None while it lives."""
        with self._cond:
            return self._error

    @property
    def final_namespace(self) -> str:
        return self.wait_sealed(0).final_namespace

    def save(
        self, blocks: list[tuple[int, int]], timeout: float = 60.0, step: int = 0
    ) -> pb.SaveResponse:
        """Copy (block_hash, block_id) pairs of this rank into the store (docs/design.md
        §2); ``step``: the engine step that computed them (a block seals once every
        rank wrote it in one step; 0 for every save: no steps)."""
        request = pb.SaveRequest(
            instance_id=self.instance_id,
            rank=self.rank,
            session=self.session,
            block_hashes=[h for h, _ in blocks],
            block_ids=[i for _, i in blocks],
            step=step,
        )
        return call(self.stub.Save, request, timeout)

    def load(self, blocks: list[tuple[int, int]], timeout: float = 60.0) -> pb.LoadResponse:
        """Copy stored blocks into this rank's (block_hash, block_id) pairs (docs/design.md §2).

        The store begins no copy that might not end within ``timeout``; a copy it
        began is waited for past it (up to ``LATE_COPY_S`` more), since its bytes
        land in these blocks whether or not anyone waits: a caller told the load
        failed reuses them. Only a store silent past that too leaves the blocks
        maybe still being written (DEADLINE_EXCEEDED, saying so)."""
        request = pb.LoadRequest(
            instance_id=self.instance_id,
            rank=self.rank,
            session=self.session,
            block_hashes=[h for h, _ in blocks],
            block_ids=[i for _, i in blocks],
            start_within_ms=min(MAX_START_WITHIN_MS, max(1, round(timeout * 1000))),
        )
        began = time.monotonic()
        try:
            return call(self.stub.Load, request, timeout + LATE_COPY_S)
        except KVError as exc:
            silent = time.monotonic() - began >= timeout + LATE_COPY_S  # not the store's refusal
            if exc.code is not Code.DEADLINE_EXCEEDED or not silent:
                raise
            raise KVError(
                Code.DEADLINE_EXCEEDED,
                f"Load: the store did not answer within {timeout:g} s and {LATE_COPY_S:g} s "
                "more for a copy it may have begun: it may still write these blocks' memory",
            ) from None

    def close(self) -> None:
        """End the registration; the server removes it and unseals the instance."""
        self.call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass(frozen=True)
class RankSpec:
    """Who a rank is in the store: what RegisterLayers says besides the layers."""

    instance_id: str
    client_namespace: str
    hash_format: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rank: int = 0
    world_size: int = 1


class StoreClient:
    """A connection to one store server; ``tls``: mutual TLS (plaintext when None)."""

    def __init__(self, address: str, timeout: float = 10.0, tls: TlsFiles | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = pb_grpc.KVStoreStub(self.channel)

    def register(
        self,
        instance_id: str,
        client_namespace: str,
        layers: list[KVLayer],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        block_size: int = 16,
        hash_format: str = HASH_FORMAT,
        accept_timeout: float = ACCEPT_TIMEOUT_S,
    ) -> RankSession:
        """Register this rank's layers; returns once the server accepted them
        (KVError DEADLINE_EXCEEDED when it does not answer within ``accept_timeout``)."""
        request = pb.RegisterLayersRequest(
            instance_id=instance_id,
            client_namespace=client_namespace,
            rank=tp_rank if rank is None else rank,
            tp_rank=tp_rank,
            tp_size=tp_size,
            world_size=tp_size if world_size is None else world_size,
            block_size=block_size,
            hash_format=hash_format,
            layers=[layer.spec() for layer in layers],
        )
        session = RankSession(
            request.instance_id, request.rank, self.stub, self.stub.RegisterLayers(request)
        )
        session.start(accept_timeout)
        return session

    def register_rank(self, spec: RankSpec, layers: list[KVLayer]) -> RankSession:
        """:meth:`register` with the rank described by ``spec``."""
        return self.register(
            spec.instance_id,
            spec.client_namespace,
            layers,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            rank=spec.rank,
            world_size=spec.world_size,
            block_size=spec.block_size,
            hash_format=spec.hash_format,
        )

    def query(
        self, namespace: str, hashes: list[int], lease: bool = False, lease_ms: int = 0
    ) -> pb.QueryResponse:
        request = pb.QueryRequest(
            namespace=namespace, block_hashes=hashes, lease=lease, lease_ms=lease_ms
        )
        return call(self.stub.Query, request, self.timeout)

    def prefetch(self, namespace: str, hashes: list[int], timeout: float = 60.0):
        """Pull the missing part of the longest prefix of ``hashes`` from a peer store."""
        request = pb.PrefetchRequest(namespace=namespace, block_hashes=hashes)
        return call(self.stub.Prefetch, request, timeout)

    def instance(self, instance_id: str, wait: float = 0.0) -> pb.InstanceInfo:
        """An instance's state and, once sealed, its final namespace.

        ``wait``: seconds to wait for the seal (at most 60); the answer may still
        be unsealed. Raises KVError(NOT_FOUND) when no rank is registered.
        """
        request = pb.GetInstanceRequest(instance_id=instance_id, wait_ms=int(wait * 1000))
        return call(self.stub.GetInstance, request, self.timeout + wait)

    def release(self, lease_id: str) -> int:
        request = pb.ReleaseRequest(lease_id=lease_id)
        return call(self.stub.Release, request, self.timeout).released_blocks

    def clear(self, namespace: str = "") -> int:
        """Drop unpinned sealed blocks of ``namespace`` (all when empty)."""
        request = pb.ClearRequest(namespace=namespace)
        return call(self.stub.Clear, request, self.timeout).cleared_blocks

    def stats(self) -> pb.StatsResponse:
        return call(self.stub.Stats, pb.StatsRequest(), self.timeout)

    def close(self) -> None:
        self.channel.close()


def call(method, request, timeout: float):
    """One unary call of ``method`` (a stub method); a refusal raises :class:`KVError`."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise kv_error(exc, exc.code().name) from None


def kv_error(exc: grpc.RpcError, fallback: str) -> KVError:
    """The KVError a gRPC status stands for: the code of the same name, the server's message."""
    return KVError(Code.from_name(exc.code().name), exc.details() or fallback)


def request_chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``pairs`` cut into Saves or Loads the store accepts (MAX_BLOCKS_PER_REQUEST each)."""
    return [
        pairs[i : i + MAX_BLOCKS_PER_REQUEST] for i in range(0, len(pairs), MAX_BLOCKS_PER_REQUEST)
    ]


def distinct_chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``pairs`` cut as :func:`request_chunks` does, with no hash twice in one
    request: a hash wanted into several block ids (two requests sharing a prefix
    in one engine step) goes again in a later round. In order within a round."""
    rounds: list[list[tuple[int, int]]] = []
    seen: dict[int, int] = {}  # hash -> rounds it is in
    for pair in pairs:
        n = seen.get(pair[0], 0)
        seen[pair[0]] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(pair)
    return [chunk for r in rounds for chunk in request_chunks(r)]
