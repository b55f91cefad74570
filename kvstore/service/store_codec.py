"""Protobuf messages <-> core dataclasses. No logic beyond field mapping."""

from __future__ import annotations

from kvstore._proto import store_pb2 as pb
from kvstore.store.memory import CudaIpcRef, HostShmRef
from kvstore.store.registry import Instance, LayerReg, Registration
from kvstore.wire.errors import invalid
from kvstore.wire.fingerprint import LayerGeometry

KIND_NAMES = {pb.KV_FIRST: "kv_first", pb.BLOCKS_FIRST: "blocks_first", pb.MLA: "mla"}
KIND_VALUES = {v: k for k, v in KIND_NAMES.items()}


def decode_registration(req: pb.RegisterLayersRequest) -> Registration:
    return Registration(
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
        layout_kind=KIND_NAMES.get(spec.layout_kind, f"unspecified({spec.layout_kind})"),
        num_blocks=spec.num_blocks,
        block_stride=spec.block_stride,
        segment_stride=spec.segment_stride,
        replicated=spec.replicated,
        memory=decode_memory(index, spec),
    )


def decode_memory(index: int, spec: pb.LayerSpec) -> HostShmRef | CudaIpcRef:
    kind = spec.memory.WhichOneof("kind")
    if kind == "host":
        m = spec.memory.host
        return HostShmRef(name=m.name, size=m.size, offset=m.offset)
    if kind == "cuda":
        m = spec.memory.cuda
        return CudaIpcRef(
            handle=bytes(m.handle), device_uuid=m.device_uuid, size=m.size, offset=m.offset
        )
    raise invalid(
        f"layers[{index}].memory ({spec.name[:64]!r}) has no handle: "
        "set host (shared memory) or cuda (IPC handle)"
    )


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


def refs(blocks) -> list[tuple[int, int]]:
    return [(b.block_hash, b.block_id) for b in blocks]
