"""Client library for connectors: register a rank, wait for the seal, save/load.

A worker (one tensor-parallel rank) describes each KV-cache layer as a
:class:`KVLayer` (its tensor plus the layout of that tensor) and registers
them all with :meth:`StoreClient.register`. The returned :class:`RankSession`
keeps the registration alive: its RegisterLayers call stays open until
:meth:`RankSession.close` (or the process dies), which is how the server
knows the rank is gone.

Host KV caches must live in POSIX shared memory (:func:`kv_cache_shm`) so the
server can map them; CUDA tensors are shared by IPC handle. Nothing is
pickled: handles are names and opaque bytes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import grpc
import torch

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.copy import region_from_tensor
from kvstore.store.memory import ShmTensor, cuda_ipc_export, device_uuid_of, shm_empty
from kvstore.wire.errors import Code, KVError
from kvstore.wire.hashing import HASH_FORMAT

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 << 20),
]
KINDS = {"kv_first": pb.KV_FIRST, "blocks_first": pb.BLOCKS_FIRST, "mla": pb.MLA}


@dataclass
class KVLayer:
    """One layer of this rank's paged KV cache.

    ``kind``: "kv_first" ``[2, num_blocks, ...]``, "blocks_first"
    ``[num_blocks, 2, ...]`` or "mla" ``[num_blocks, block_size, dim]``.
    ``kv_layout``: byte order inside a block, "NHD", "HND" or "MLA".
    ``shm``: the shared-memory object holding a host tensor.
    """

    name: str
    tensor: torch.Tensor
    kind: str = "kv_first"
    kv_layout: str = "NHD"
    shm: ShmTensor | None = None
    replicated: bool = False

    def spec(self) -> pb.LayerSpec:
        region = region_from_tensor(self.tensor, self.kind)
        return pb.LayerSpec(
            name=self.name,
            dtype=str(self.tensor.dtype).removeprefix("torch."),
            bytes_per_block=region.segments * region.segment_bytes,
            segments=region.segments,
            kv_layout=self.kv_layout,
            layout_kind=KINDS[self.kind],
            num_blocks=region.num_blocks,
            block_stride=region.block_stride,
            segment_stride=region.segment_stride,
            replicated=self.replicated,
            memory=self._memory(),
        )

    def _memory(self) -> pb.MemoryHandle:
        t = self.tensor
        if t.is_cuda:
            ptr = t.data_ptr()
            handle, base, size = cuda_ipc_export(ptr, t.device.index)
            return pb.MemoryHandle(
                cuda=pb.CudaIpc(
                    handle=handle,
                    device_uuid=device_uuid_of(t.device.index),
                    size=size,
                    offset=ptr - base,
                )
            )
        if self.shm is None:
            raise ValueError(
                f"layer {self.name!r}: a host KV tensor must live in shared "
                "memory; allocate it with kvstore.client.store_client.kv_cache_shm"
            )
        base = torch.frombuffer(self.shm.shm.buf, dtype=torch.uint8).data_ptr()
        return pb.MemoryHandle(
            host=pb.HostShm(name=self.shm.name, size=self.shm.shm.size, offset=t.data_ptr() - base)
        )


def kv_cache_shm(
    kind: str,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    kv_layout: str = "NHD",
) -> ShmTensor:
    """A zeroed host KV cache of one layer in shared memory, in vLLM's shapes."""
    inner = (block_size, heads, head_dim) if kv_layout == "NHD" else (heads, block_size, head_dim)
    shape = {
        "kv_first": (2, num_blocks, *inner),
        "blocks_first": (num_blocks, 2, *inner),
        "mla": (num_blocks, block_size, head_dim),
    }[kind]
    return shm_empty(shape, dtype)


@dataclass
class SealInfo:
    fingerprint: str
    final_namespace: str
    layer_ids: dict[str, int]


@dataclass
class RankSession:
    """A live registration: the open RegisterLayers call and its latest state."""

    instance_id: str
    rank: int
    stub: pb_grpc.KVStoreStub
    call: object
    session: str = ""
    state: int = 0
    ranks_registered: int = 0
    seal: SealInfo | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _error: KVError | None = None
    _thread: threading.Thread | None = None

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
            err = KVError(
                Code.from_name(exc.code().name), exc.details() or "registration stream failed"
            )
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
    def final_namespace(self) -> str:
        return self.wait_sealed(0).final_namespace

    def save(self, blocks: list[tuple[int, int]], timeout: float = 60.0) -> pb.SaveResponse:
        return _call(
            self.stub.Save,
            pb.SaveRequest(
                instance_id=self.instance_id,
                rank=self.rank,
                session=self.session,
                blocks=[pb.BlockRef(block_hash=h, block_id=i) for h, i in blocks],
            ),
            timeout,
        )

    def load(self, blocks: list[tuple[int, int]], timeout: float = 60.0) -> pb.LoadResponse:
        return _call(
            self.stub.Load,
            pb.LoadRequest(
                instance_id=self.instance_id,
                rank=self.rank,
                session=self.session,
                blocks=[pb.BlockRef(block_hash=h, block_id=i) for h, i in blocks],
            ),
            timeout,
        )

    def close(self) -> None:
        """End the registration; the server removes it and unseals the instance."""
        self.call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)


class StoreClient:
    """A connection to one store server."""

    def __init__(self, address: str, timeout: float = 10.0):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
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
    ) -> RankSession:
        """Register this rank's layers; returns once the server accepted them."""
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
        return self.register_raw(request)

    def register_raw(self, request: pb.RegisterLayersRequest) -> RankSession:
        """Register from a prepared request (tests use it to send bad input)."""
        call = self.stub.RegisterLayers(request)
        sess = RankSession(request.instance_id, request.rank, self.stub, call)
        try:
            sess._apply(next(call))
        except grpc.RpcError as exc:
            raise KVError(Code.from_name(exc.code().name), exc.details()) from None
        sess._thread = threading.Thread(
            target=sess._follow, daemon=True, name=f"kvstore-session-{request.rank}"
        )
        sess._thread.start()
        return sess

    def query(
        self, namespace: str, hashes: list[int], lease: bool = False, lease_ms: int = 0
    ) -> pb.QueryResponse:
        return _call(
            self.stub.Query,
            pb.QueryRequest(
                namespace=namespace, block_hashes=hashes, lease=lease, lease_ms=lease_ms
            ),
            self.timeout,
        )

    def release(self, lease_id: str) -> int:
        return _call(
            self.stub.Release, pb.ReleaseRequest(lease_id=lease_id), self.timeout
        ).released_blocks

    def clear(self, namespace: str = "") -> int:
        """Drop unpinned sealed blocks of ``namespace`` (all when empty)."""
        return _call(
            self.stub.Clear, pb.ClearRequest(namespace=namespace), self.timeout
        ).cleared_blocks

    def stats(self) -> pb.StatsResponse:
        return _call(self.stub.Stats, pb.StatsRequest(), self.timeout)

    def close(self) -> None:
        self.channel.close()


def _call(method, request, timeout: float):
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise KVError(Code.from_name(exc.code().name), exc.details() or str(exc.code())) from None
