"""Attach a registration to the worker's memory: map handles, build copy regions.

Runs inside :meth:`Registry.register` after validation and before anything
is recorded, so a handle that cannot be mapped, or a layer that does not fit
in its mapping, refuses the registration and leaves nothing mapped
(docs/design.md §1: every handle is mapped before the rank is recorded; a
rank's layers share one device and fit their mappings). Layers that share an
allocation share one mapping.
"""

from __future__ import annotations

from kvstore.copy import LayerRegion
from kvstore.store.memory import MappedRegion
from kvstore.store.registry import LayerReg, Registration
from kvstore.wire.errors import invalid


def attach(reg: Registration) -> None:
    """Fill ``reg.regions``, ``reg.mapped`` and ``reg.device`` or raise KVError."""
    opened: dict[tuple, MappedRegion] = {}
    reach: dict[tuple, int] = {}  # handle -> the bytes its layers use, from its start
    for layer in reg.layers:
        if layer.memory is not None:
            key, end = layer.memory.key(), layer.memory.offset + layer.extent()
            reach[key] = max(reach.get(key, 0), end)
    try:
        for layer in reg.layers:
            where = f"layer {layer.geometry.name!r} of {reg.where()} memory"
            ref = layer.memory
            if ref is None:
                raise invalid(f"{where} is missing")
            mapped = opened.get(ref.key())
            if mapped is None:
                mapped = opened[ref.key()] = ref.open(where, reach[ref.key()], reg.user)
            reg.regions[layer.geometry.name] = _layer_region(layer, mapped, where)
        devices = {r.device for r in opened.values()}
        if len(devices) != 1:
            raise invalid(f"layers of {reg.where()} live on several devices: {sorted(devices)}")
        reg.device = devices.pop()
        reg.mapped = list(opened.values())
    except BaseException:  # whatever failed, nothing stays mapped (CUDA IPC has no finalizer)
        for mapped in opened.values():
            mapped.close()
        reg.regions.clear()
        raise


def _layer_region(layer: LayerReg, mapped: MappedRegion, where: str) -> LayerRegion:
    """Where ``layer``'s blocks lie inside ``mapped``; refused when they overrun it."""
    offset = layer.memory.offset
    if offset + layer.extent() > mapped.size:
        raise invalid(
            f"{where}: offset {offset} + {layer.extent()} bytes of blocks "
            f"exceed the {mapped.size}-byte mapping"
        )
    return LayerRegion(
        base=mapped.base + offset,
        num_blocks=layer.num_blocks,
        segments=layer.geometry.segments,
        segment_bytes=layer.segment_bytes,
        block_stride=layer.block_stride,
        segment_stride=layer.segment_stride,
    )
