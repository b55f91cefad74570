"""Attach a registration to the worker's memory: map handles, build copy regions.

Runs inside :meth:`Registry.register` after validation and before anything
is recorded, so a handle that cannot be mapped, or a layer that does not fit
in its mapping, refuses the registration and leaves nothing mapped.
"""

from __future__ import annotations

from kvstore.copy import LayerRegion
from kvstore.store.memory import MappedRegion
from kvstore.store.registry import Registration
from kvstore.wire.errors import KVError, invalid


def attach(reg: Registration) -> None:
    """Fill ``reg.regions``, ``reg.mapped`` and ``reg.device`` or raise KVError."""
    opened: dict[tuple, MappedRegion] = {}
    try:
        for layer in reg.layers:
            name = layer.geometry.name
            where = f"layer {name!r} of {reg.where()} memory"
            ref = layer.memory
            if ref is None:
                raise invalid(f"{where} is missing")
            region = opened.get(ref.key())
            if region is None:
                region = opened[ref.key()] = ref.open(where)
            if ref.offset + layer.extent() > region.size:
                raise invalid(
                    f"{where}: offset {ref.offset} + {layer.extent()} bytes of blocks "
                    f"exceed the {region.size}-byte mapping"
                )
            reg.regions[name] = LayerRegion(
                base=region.base + ref.offset,
                num_blocks=layer.num_blocks,
                segments=layer.geometry.segments,
                segment_bytes=layer.segment_bytes,
                block_stride=layer.block_stride,
                segment_stride=layer.segment_stride,
            )
        devices = {r.device for r in opened.values()}
        if len(devices) != 1:
            raise invalid(f"layers of {reg.where()} live on several devices: {sorted(devices)}")
        reg.device = devices.pop()
        reg.mapped = list(opened.values())
    except KVError:
        for region in opened.values():
            region.close()
        reg.regions.clear()
        raise
