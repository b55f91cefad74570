"""Protobuf messages <-> the store core's records. No logic beyond field mapping."""

from __future__ import annotations

from typing import TYPE_CHECKING

from google.protobuf.unknown_fields import UnknownFieldSet

from kvstore._proto import store_pb2 as pb
from kvstore.store.fetch import FetchResult
from kvstore.store.local_user import CallerUser
from kvstore.store.memory import CudaIpcRef, HostFdRef, HostShmRef
from kvstore.store.node import LoadResult, NodeStats, QueryResult, SaveResult, check_count
from kvstore.store.registry import CallerId, Instance, LayerReg, Registration
from kvstore.store.validation import check_layer_count
from kvstore.wire.errors import invalid
from kvstore.wire.fingerprint import LayerGeometry
from kvstore.wire.kv_layout import LayoutKind
from kvstore.wire.principal import LOCAL, Principal

if TYPE_CHECKING:  # the servicer imports this module
    from kvstore.service.store_service import FanoutStats

# ---------------------------------------------------------------- requests


def decode_registration(
    req: pb.RegisterLayersRequest, principal: Principal = LOCAL, user: CallerUser | None = None
) -> Registration:
    """The registration ``principal`` sent, from a process of ``user`` (default: this
    process's); its layers counted before any is decoded."""
    check_layer_count(len(req.layers))
    return Registration(
        principal=principal,
        user=user or CallerUser.this_process(),
        instance_id=req.instance_id,
        client_namespace=req.client_namespace,
        rank=req.rank,
        tp_rank=req.tp_rank,
        tp_size=req.tp_size,
        world_size=req.world_size,
        block_size=req.block_size,
        hash_format=req.hash_format,
        layers=[decode_layer(i, layer) for i, layer in enumerate(req.layers)],
    )


def decode_layer(index: int, spec: pb.LayerSpec) -> LayerReg:
    return LayerReg(
        geometry=LayerGeometry(
            name=spec.name,
            dtype=spec.dtype,
            bytes_per_block=spec.bytes_per_block,
            segments=spec.segments,
            kv_layout=spec.kv_layout,
        ),
        layout_kind=LayoutKind.from_proto(spec.layout_kind),
        num_blocks=spec.num_blocks,
        block_stride=spec.block_stride,
        segment_stride=spec.segment_stride,
        replicated=spec.replicated,
        memory=decode_memory(index, spec),
    )


def decode_memory(index: int, spec: pb.LayerSpec) -> HostShmRef | HostFdRef | CudaIpcRef:
    kind = spec.memory.WhichOneof("kind")
    if kind == "host":
        m = spec.memory.host
        return HostShmRef(name=m.name, size=m.size, offset=m.offset)
    if kind == "host_fd":
        m = spec.memory.host_fd
        return HostFdRef(pid=m.pid, fd=m.fd, size=m.size, offset=m.offset)
    if kind == "cuda":
        m = spec.memory.cuda
        return CudaIpcRef(
            handle=bytes(m.handle), device_uuid=m.device_uuid, size=m.size, offset=m.offset
        )
    raise invalid(
        f"layers[{index}].memory ({spec.name[:64]!r}) has no handle: "
        "set host (shared memory), host_fd (a shared-memory descriptor) or cuda (IPC handle)"
    )


def caller_id(req: pb.SaveRequest | pb.LoadRequest) -> CallerId:
    return CallerId(req.instance_id, req.rank, req.session)


RETIRED_BLOCKS_FIELD = 4  # SaveRequest/LoadRequest.blocks, reserved in store.proto


def _has_field(msg: pb.SaveRequest | pb.LoadRequest, number: int) -> bool:
    """Whether ``msg`` arrived with field ``number``, which this schema does not know."""
    return any(f.field_number == number for f in UnknownFieldSet(msg))


def refs(req: pb.SaveRequest | pb.LoadRequest) -> list[tuple[int, int]]:
    """The request's (block_hash, block_id) pairs: its two arrays side by side."""
    hashes, block_ids = req.block_hashes, req.block_ids
    if not hashes and not block_ids and _has_field(req, RETIRED_BLOCKS_FIELD):
        raise invalid(
            "blocks (field 4, a message a block) is retired: send block_hashes and "
            "block_ids (a client older than this store: upgrade it)"
        )
    if len(hashes) != len(block_ids):
        raise invalid(
            f"block_ids has {len(block_ids)} entries and block_hashes {len(hashes)}: "
            "one block_id a block_hash"
        )
    check_count("block_hashes", len(hashes))  # before a Python object is made of one
    return list(zip(hashes, block_ids, strict=True))


def block_hashes(req: pb.QueryRequest | pb.PrefetchRequest) -> list[int]:
    """The request's hashes as a list, once their count is within the bound."""
    check_count("block_hashes", len(req.block_hashes))
    return list(req.block_hashes)


# --------------------------------------------------------------- responses


def registration_update(inst: Instance, reg: Registration) -> pb.RegistrationUpdate:
    msg = pb.RegistrationUpdate(
        session=reg.session, ranks_registered=len(inst.ranks), world_size=reg.world_size
    )
    if inst.seal is None:
        msg.state = pb.RegistrationUpdate.ACCEPTED
    else:
        msg.state = pb.RegistrationUpdate.SEALED
        msg.fingerprint = inst.seal.fingerprint
        msg.final_namespace = inst.seal.final_namespace
        msg.layer_ids.update(inst.seal.layer_ids)
    return msg


def instance_info(inst: Instance) -> pb.InstanceInfo:
    first = inst.first
    msg = pb.InstanceInfo(
        instance_id=inst.instance_id,
        sealed=inst.seal is not None,
        ranks_registered=len(inst.ranks),
        world_size=first.world_size,
        block_size=first.block_size,
        hash_format=first.hash_format,
    )
    if inst.seal is not None:
        msg.fingerprint = inst.seal.fingerprint
        msg.final_namespace = inst.seal.final_namespace
    return msg


def save_response(r: SaveResult) -> pb.SaveResponse:
    return pb.SaveResponse(written=r.written, skipped=r.skipped, sealed=r.sealed, bytes=r.bytes)


def load_response(r: LoadResult) -> pb.LoadResponse:
    return pb.LoadResponse(loaded=r.loaded, bytes=r.bytes)


def prefetch_response(r: FetchResult) -> pb.PrefetchResponse:
    return pb.PrefetchResponse(
        local_blocks=r.local_blocks, fetched_blocks=r.fetched_blocks, peer=r.peer
    )


def query_response(r: QueryResult) -> pb.QueryResponse:
    return pb.QueryResponse(prefix_blocks=r.prefix_blocks, lease_id=r.lease_id)


def stats_response(s: NodeStats, fanout: FanoutStats, ucx_address: str) -> pb.StatsResponse:
    return pb.StatsResponse(
        device=",".join(s.devices),
        pool_bytes=s.pool.pool_bytes,
        used_bytes=s.pool.used_bytes,
        free_bytes=s.pool.free_bytes,
        sealed_blocks=s.index.sealed_blocks,
        inflight_blocks=s.index.inflight_blocks,
        hits=s.requests.hits,
        misses=s.requests.misses,
        evictions=s.index.evictions,
        bytes_saved=s.requests.bytes_saved,
        bytes_loaded=s.requests.bytes_loaded,
        instances=s.registry.instances,
        sealed_instances=s.registry.sealed_instances,
        leases=s.index.leases,
        ucx_address=ucx_address,
        fetched_blocks=s.fetcher.fetched_blocks,
        served_blocks=s.source.served_blocks,
        events_dropped=fanout.events_dropped,
        event_subscribers_cut=fanout.event_subscribers_cut,
        event_subscribers=fanout.event_subscribers,
    )
