"""What a registration must satisfy to be recorded (docs/design.md §1).

Every check raises ``KVError`` naming the field, the layer and the rank at
fault, and runs before anything is touched, so a refused request changes
nothing. Bounds come from :mod:`kvstore.wire.limits`, name rules from
:mod:`kvstore.wire.names`, layout kinds from :mod:`kvstore.wire.kv_layout`.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import TYPE_CHECKING

from kvstore.copy.geometry import LayerRegion
from kvstore.copy.table import layer_apart
from kvstore.wire.errors import exists, invalid, precondition
from kvstore.wire.kv_layout import KINDS, VLLM_LAYOUTS, LayoutKind
from kvstore.wire.limits import (
    MAX_BLOCK_SIZE,
    MAX_BYTES_PER_BLOCK,
    MAX_LAYERS,
    MAX_MAPPING_BYTES,
    MAX_NAME_LEN,
    MAX_NUM_BLOCKS,
    MAX_TP_SIZE,
    MAX_WORLD_SIZE,
)
from kvstore.wire.names import is_client_namespace

if TYPE_CHECKING:
    from kvstore.store.registry import Instance, LayerReg, Registration

INSTANCE_ID_RE = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_NAME_LEN}}}")

# (field, lowest, highest) of a registration, checked in this order
_BOUNDS = (
    ("tp_size", 1, MAX_TP_SIZE),
    ("world_size", 1, MAX_WORLD_SIZE),
    ("block_size", 1, MAX_BLOCK_SIZE),
)
_LAYOUTS_OF = {
    LayoutKind.KV_FIRST: "'NHD' or 'HND'",
    LayoutKind.BLOCKS_FIRST: "'NHD' or 'HND'",
    LayoutKind.MLA: "'MLA'",
    LayoutKind.PAGED: f"'<layout>/<block ratio>' with a layout in {VLLM_LAYOUTS}",
}
# fields every rank of an instance must send alike
_INSTANCE_FIELDS = ("client_namespace", "world_size", "tp_size", "block_size", "hash_format")
# geometry fields every rank registering a layer must send alike
_GEOMETRY_FIELDS = ("dtype", "bytes_per_block", "segments", "kv_layout")


def check_fields(reg: Registration) -> None:
    """Checks that need nothing but the request itself."""
    _check_names(reg)
    for name, lo, hi in _BOUNDS:
        _bounded(name, getattr(reg, name), lo, hi)
    if reg.tp_rank >= reg.tp_size:
        raise invalid(f"tp_rank {reg.tp_rank} is outside [0, tp_size={reg.tp_size})")
    if reg.world_size % reg.tp_size:
        raise invalid(f"world_size {reg.world_size} is not a multiple of tp_size {reg.tp_size}")
    if reg.rank >= reg.world_size:
        raise invalid(f"rank {reg.rank} is outside [0, world_size={reg.world_size})")
    _check_layers(reg)


def check_instance_id(instance_id: str) -> None:
    if not INSTANCE_ID_RE.fullmatch(instance_id):
        raise invalid(f"instance_id {instance_id[:64]!r} must match {INSTANCE_ID_RE.pattern}")


def _check_names(reg: Registration) -> None:
    check_instance_id(reg.instance_id)
    if not is_client_namespace(reg.client_namespace):
        raise invalid(
            f"client_namespace {reg.client_namespace[:160]!r} must match "
            "[A-Za-z0-9_-]{1,128} (no dot: the dot separates the fingerprint)"
        )
    if not 0 < len(reg.hash_format) <= MAX_NAME_LEN:
        raise invalid(f"hash_format must be 1..{MAX_NAME_LEN} characters")


def check_layer_count(count: int) -> None:
    """At most MAX_LAYERS layers a rank (checked before its layers are decoded too)."""
    if count > MAX_LAYERS:
        raise invalid(f"layers has {count} entries, more than {MAX_LAYERS}")


def _check_layers(reg: Registration) -> None:
    if not reg.layers:
        raise invalid(f"layers is empty for {reg.where()}")
    check_layer_count(len(reg.layers))
    names = set()
    for layer in reg.layers:
        check_layer(layer, reg)
        if layer.geometry.name in names:
            raise invalid(f"layer {layer.geometry.name!r} appears twice for {reg.where()}")
        names.add(layer.geometry.name)


def check_layer(layer: LayerReg, reg: Registration) -> None:
    g = layer.geometry
    if not 0 < len(g.name) <= MAX_NAME_LEN:
        raise invalid(f"layers.name must be 1..{MAX_NAME_LEN} characters ({reg.where()})")
    at = f"layer {g.name[:64]!r} of {reg.where()}"
    if not 0 < len(g.dtype) <= 64:
        raise invalid(f"dtype must be 1..64 characters ({at})")
    _check_kind(layer, at)
    _check_extent(layer, at)


def _check_kind(layer: LayerReg, at: str) -> None:
    """The layout kind is known and agrees with segments and kv_layout."""
    g, kind = layer.geometry, layer.layout_kind
    if kind is None:
        raise invalid(f"layout_kind is unset or unknown; it must be one of {KINDS} ({at})")
    if g.segments != kind.segments:
        raise invalid(
            f"segments {g.segments} does not match layout_kind "
            f"{kind.value!r} ({kind.segments} expected) ({at})"
        )
    if not kind.accepts(g.kv_layout):
        raise invalid(
            f"kv_layout {g.kv_layout[:64]!r} does not fit layout_kind {kind.value!r}: "
            f"{_LAYOUTS_OF[kind]} ({at})"
        )


def _check_extent(layer: LayerReg, at: str) -> None:
    """Block bytes, block count and strides are in bounds and do not overlap."""
    g = layer.geometry
    _bounded(f"bytes_per_block ({at})", g.bytes_per_block, 1, MAX_BYTES_PER_BLOCK)
    if g.bytes_per_block % g.segments:
        raise invalid(f"bytes_per_block {g.bytes_per_block} is not divisible by segments ({at})")
    _bounded(f"num_blocks ({at})", layer.num_blocks, 1, MAX_NUM_BLOCKS)
    if layer.block_stride < layer.segment_bytes and layer.num_blocks > 1:
        raise invalid(
            f"block_stride {layer.block_stride} is smaller than a block's "
            f"{layer.segment_bytes} bytes per segment ({at})"
        )
    bounded = [("block_stride", layer.block_stride), ("segment_stride", layer.segment_stride)]
    if layer.memory is not None:
        bounded += [("memory.size", layer.memory.size), ("memory.offset", layer.memory.offset)]
    for name, value in bounded:  # a stride enters every address, even with one block
        if value > MAX_MAPPING_BYTES:
            raise invalid(
                f"{name} {value} is beyond {MAX_MAPPING_BYTES}, the largest mapping ({at})"
            )
    if min(layer.block_stride, layer.segment_stride) < 0:
        raise invalid(
            f"block_stride {layer.block_stride} and segment_stride {layer.segment_stride} "
            f"must not be negative ({at})"
        )
    if g.segments == 2 and layer.segment_stride < layer.segment_bytes:
        raise invalid(f"segment_stride {layer.segment_stride} overlaps segment 0 ({at})")
    if g.segments == 1 and layer.segment_stride:
        raise invalid(
            f"segment_stride {layer.segment_stride} must be 0: layout_kind "
            f"{layer.layout_kind.value!r} has one segment ({at})"
        )
    shape = (layer.segment_bytes, layer.block_stride, layer.segment_stride)
    if g.segments == 2 and not layer_apart(LayerRegion(0, layer.num_blocks, 2, *shape)):
        raise invalid(
            f"segment_stride {layer.segment_stride} and block_stride {layer.block_stride} "
            f"put a block's segment 1 onto another block's segment 0 ({at})"
        )


def _bounded(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise invalid(f"{name} {value} is outside [{lo}, {hi}]")


def check_against(inst: Instance, reg: Registration) -> None:
    """Checks against the ranks already in the instance."""
    first = inst.first
    for name in _INSTANCE_FIELDS:
        mine, theirs = getattr(reg, name), getattr(first, name)
        if mine != theirs:
            raise invalid(
                f"{name} {mine!r} of {reg.where()} disagrees with {theirs!r} "
                f"registered by rank {first.rank}"
            )
    if reg.rank in inst.ranks:
        raise exists(f"rank {reg.rank} of instance {reg.instance_id!r} is already registered")
    for other in inst.ranks.values():
        _check_cells(other, reg)
    layers = {layer.geometry.name for r in inst.ranks.values() for layer in r.layers}
    layers.update(layer.geometry.name for layer in reg.layers)
    if len(layers) > MAX_LAYERS:
        raise invalid(
            f"layers: {reg.where()} would make its instance span "
            f"{len(layers)} layers, at most {MAX_LAYERS} (every rank's together)"
        )


def check_device(
    inst: Instance | None, reg: Registration, pools: Collection[str] | None = None
) -> None:
    """A tp_rank's slots live in one device's pool (Block.devices holds one device
    a tp_rank): ranks sharing a tp_rank (pipeline stages) share its device, and
    that device has a pool here (``pools``: their devices; None, unchecked)."""
    if pools is not None and reg.device not in pools:
        raise precondition(
            f"device {reg.device!r} of {reg.where()}: this store keeps blocks on "
            f"{sorted(pools)} only (its --device); register KV-cache memory there, or "
            "start the store with a pool on that device"
        )
    for other in inst.ranks.values() if inst is not None else ():
        if other.tp_rank == reg.tp_rank and other.device != reg.device:
            raise invalid(
                f"device {reg.device!r} of {reg.where()}: rank {other.rank} registered "
                f"tp_rank {reg.tp_rank} on {other.device!r}; ranks of one tp_rank must "
                "register memory on one device"
            )


def _check_cells(other: Registration, reg: Registration) -> None:
    """One owner per (layer, tp_rank) unless both replicate it; one geometry per layer."""
    theirs = {layer.geometry.name: layer for layer in other.layers}
    for layer in reg.layers:
        name = layer.geometry.name
        peer = theirs.get(name)
        if peer is None:
            continue
        if other.tp_rank == reg.tp_rank and not (layer.replicated and peer.replicated):
            raise exists(
                f"layer {name!r} tp_rank {reg.tp_rank} already has an owner: rank "
                f"{other.rank}; rank {reg.rank} cannot own it too"
            )
        for fld in _GEOMETRY_FIELDS:
            mine, ref = getattr(layer.geometry, fld), getattr(peer.geometry, fld)
            if mine != ref:
                raise invalid(
                    f"layer {name!r} field {fld}: rank {reg.rank} says {mine!r} but "
                    f"rank {other.rank} registered {ref!r}"
                )


def check_seal_would_succeed(registered: list[Registration], reg: Registration) -> None:
    """Refuse the last rank if its arrival would leave a cell without owner."""
    ranks = [*registered, reg]
    if len(ranks) < reg.world_size:
        return
    owners: dict[str, set[int]] = {}
    for r in ranks:
        for layer in r.layers:
            owners.setdefault(layer.geometry.name, set()).add(r.tp_rank)
    for name in sorted(owners):
        missing = sorted(set(range(reg.tp_size)) - owners[name])
        if missing:
            raise precondition(
                f"sealing would fail: layer {name!r} has no owner for tp_rank "
                f"{missing[0]} (rank {reg.rank} completes world_size "
                f"{reg.world_size})"
            )
