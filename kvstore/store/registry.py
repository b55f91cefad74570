"""Instances, rank registrations and the seal (DESIGN.md section 1).

Plain Python, no network: the gRPC handler validates nothing itself, it
hands a :class:`Registration` to :meth:`Registry.register`, which either
refuses it (``KVError`` naming field, layer and rank; nothing changes) or
records it and, when all ``world_size`` ranks are in, seals the instance.

Decisions happen in one synchronous call, so on the asyncio server no other
registration can interleave between the check and the insert.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstore.store.memory import MappedRegion
from kvstore.wire.errors import KVError, exists, invalid, not_found, precondition
from kvstore.wire.fingerprint import LayerGeometry, fingerprint
from kvstore.wire.kv_layout import KV_LAYOUTS
from kvstore.wire.limits import (
    MAX_BLOCK_SIZE,
    MAX_BYTES_PER_BLOCK,
    MAX_LAYERS,
    MAX_NAME_LEN,
    MAX_NUM_BLOCKS,
    MAX_TP_SIZE,
    MAX_WORLD_SIZE,
)
from kvstore.wire.names import final_namespace, is_client_namespace

if TYPE_CHECKING:
    from kvstore.copy import LayerRegion

log = logging.getLogger(__name__)

INSTANCE_ID_RE = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_NAME_LEN}}}")
LAYOUT_KINDS = {"kv_first": 2, "blocks_first": 1, "mla": 1}  # kind -> segments


@dataclass
class LayerReg:
    """One layer as one rank registered it."""

    geometry: LayerGeometry
    layout_kind: str
    num_blocks: int
    block_stride: int
    segment_stride: int
    replicated: bool = False
    memory: object = None  # a memory handle, mapped by the Mapper

    @property
    def segment_bytes(self) -> int:
        return self.geometry.bytes_per_block // self.geometry.segments

    def extent(self) -> int:
        """Bytes from the layer's base that its blocks reach."""
        g = self.geometry
        return (
            (g.segments - 1) * self.segment_stride
            + (self.num_blocks - 1) * self.block_stride
            + self.segment_bytes
        )


@dataclass
class Registration:
    """One rank's RegisterLayers request, decoded from the wire."""

    instance_id: str
    client_namespace: str
    rank: int
    tp_rank: int
    tp_size: int
    world_size: int
    block_size: int
    hash_format: str
    layers: list[LayerReg]
    session: str = field(default_factory=lambda: secrets.token_hex(16))
    regions: dict[str, LayerRegion] = field(default_factory=dict)  # set on map
    device: str = "cpu"
    mapped: list[MappedRegion] = field(default_factory=list)

    _holds: int = 0
    retired: bool = False

    def where(self) -> str:
        return f"instance {self.instance_id!r} rank {self.rank} (tp_rank {self.tp_rank})"

    def hold(self) -> None:
        """A copy is about to touch this rank's memory: keep it mapped."""
        self._holds += 1

    def unhold(self) -> None:
        self._holds -= 1
        self._maybe_unmap()

    def retire(self) -> None:
        """The rank left: unmap its memory once no copy is using it."""
        self.retired = True
        self._maybe_unmap()

    def _maybe_unmap(self) -> None:
        if self.retired and self._holds == 0:
            for region in self.mapped:
                region.close()
            self.mapped.clear()


@dataclass(frozen=True)
class Seal:
    """What every rank learns once the instance is complete."""

    fingerprint: str
    final_namespace: str
    layer_ids: dict[str, int]
    layers: tuple[LayerGeometry, ...]  # by layer id
    tp_size: int

    @property
    def slots_per_block(self) -> int:
        return len(self.layers) * self.tp_size

    def slot_index(self, layer_id: int, tp_rank: int) -> int:
        return layer_id * self.tp_size + tp_rank

    @functools.cached_property
    def slot_bytes(self) -> np.ndarray:
        """Bytes of each slot, by slot index (all ranks of a layer agree); read-only."""
        sizes = np.repeat([g.bytes_per_block for g in self.layers], self.tp_size)
        sizes.flags.writeable = False
        return sizes


@dataclass
class Instance:
    instance_id: str
    ranks: dict[int, Registration] = field(default_factory=dict)
    seal: Seal | None = None

    @property
    def first(self) -> Registration:
        return next(iter(self.ranks.values()))


Mapper = Callable[[Registration], None]
Listener = Callable[[Instance], None]


class Registry:
    """All instances of one store server."""

    def __init__(self, mapper: Mapper | None = None):
        self.instances: dict[str, Instance] = {}
        self.sessions: dict[str, Registration] = {}
        self._mapper = mapper
        self._listeners: list[Listener] = []

    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # ------------------------------------------------------------ register

    def register(self, reg: Registration) -> Instance:
        """Validate, map memory, record; seal when complete. Atomic."""
        check_fields(reg)
        inst = self.instances.get(reg.instance_id)
        if inst is not None:
            check_against(inst, reg)
        check_seal_would_succeed(inst, reg)
        if self._mapper is not None:
            self._mapper(reg)  # raises KVError; nothing recorded yet
        if inst is None:
            inst = self.instances[reg.instance_id] = Instance(reg.instance_id)
        inst.ranks[reg.rank] = reg
        self.sessions[reg.session] = reg
        log.info(
            "registered %s: %d layers, %d/%d ranks in",
            reg.where(),
            len(reg.layers),
            len(inst.ranks),
            reg.world_size,
        )
        if len(inst.ranks) == reg.world_size:
            inst.seal = make_seal(inst)
            log.info(
                "sealed instance %r as namespace %s (%d layers x tp %d)",
                inst.instance_id,
                inst.seal.final_namespace,
                len(inst.seal.layers),
                inst.seal.tp_size,
            )
        self._notify(inst)
        return inst

    def unregister(self, session: str) -> None:
        """Remove a rank (its session ended); the instance unseals."""
        reg = self.sessions.pop(session, None)
        if reg is None:
            return
        inst = self.instances[reg.instance_id]
        del inst.ranks[reg.rank]
        reg.retire()  # a copy still running keeps the mapping until it ends
        if inst.seal is not None:
            log.warning(
                "%s left; instance unsealed (%d/%d ranks remain)",
                reg.where(),
                len(inst.ranks),
                reg.world_size,
            )
        inst.seal = None
        if not inst.ranks:
            del self.instances[reg.instance_id]
        self._notify(inst)

    def _notify(self, inst: Instance) -> None:
        for listener in self._listeners:
            listener(inst)

    # ------------------------------------------------------------- look-ups

    def caller(self, instance_id: str, rank: int, session: str) -> tuple[Instance, Registration]:
        """The sealed instance and registration a Save/Load comes from."""
        inst = self.instances.get(instance_id)
        if inst is None:
            raise not_found(f"instance_id {instance_id!r} is not registered")
        reg = self.sessions.get(session)
        if reg is None or reg.instance_id != instance_id:
            raise invalid(f"session does not belong to instance_id {instance_id!r}")
        if reg.rank != rank:
            raise invalid(f"rank {rank} is not the caller's: the session is rank {reg.rank}")
        if inst.seal is None:
            raise precondition(
                f"instance {instance_id!r} is not sealed: "
                f"{len(inst.ranks)}/{reg.world_size} ranks registered"
            )
        return inst, reg


# ---------------------------------------------------------------- validation


def check_fields(reg: Registration) -> None:
    """Checks that need nothing but the request itself."""
    if not INSTANCE_ID_RE.fullmatch(reg.instance_id):
        raise invalid(f"instance_id {reg.instance_id[:64]!r} must match {INSTANCE_ID_RE.pattern}")
    if not is_client_namespace(reg.client_namespace):
        raise invalid(
            f"client_namespace {reg.client_namespace[:160]!r} must match "
            "[A-Za-z0-9_-]{1,128} (no dot: the dot separates the fingerprint)"
        )
    _bounded("tp_size", reg.tp_size, 1, MAX_TP_SIZE)
    _bounded("world_size", reg.world_size, 1, MAX_WORLD_SIZE)
    if reg.tp_rank >= reg.tp_size:
        raise invalid(f"tp_rank {reg.tp_rank} is outside [0, tp_size={reg.tp_size})")
    if reg.world_size % reg.tp_size:
        raise invalid(f"world_size {reg.world_size} is not a multiple of tp_size {reg.tp_size}")
    if reg.rank >= reg.world_size:
        raise invalid(f"rank {reg.rank} is outside [0, world_size={reg.world_size})")
    _bounded("block_size", reg.block_size, 1, MAX_BLOCK_SIZE)
    if not 0 < len(reg.hash_format) <= MAX_NAME_LEN:
        raise invalid(f"hash_format must be 1..{MAX_NAME_LEN} characters")
    if not reg.layers:
        raise invalid(f"layers is empty for {reg.where()}")
    if len(reg.layers) > MAX_LAYERS:
        raise invalid(f"layers has {len(reg.layers)} entries, more than {MAX_LAYERS}")
    names = set()
    for layer in reg.layers:
        check_layer(layer, reg)
        if layer.geometry.name in names:
            raise invalid(f"layer {layer.geometry.name!r} appears twice for {reg.where()}")
        names.add(layer.geometry.name)


def check_layer(layer: LayerReg, reg: Registration) -> None:
    g = layer.geometry
    at = f"layer {g.name[:64]!r} of {reg.where()}"
    if not 0 < len(g.name) <= MAX_NAME_LEN:
        raise invalid(f"layers.name must be 1..{MAX_NAME_LEN} characters ({reg.where()})")
    if not 0 < len(g.dtype) <= 64:
        raise invalid(f"dtype must be 1..64 characters ({at})")
    if layer.layout_kind not in LAYOUT_KINDS:
        raise invalid(
            f"layout_kind {layer.layout_kind!r} must be one of {sorted(LAYOUT_KINDS)} ({at})"
        )
    if g.segments != LAYOUT_KINDS[layer.layout_kind]:
        raise invalid(
            f"segments {g.segments} does not match layout_kind "
            f"{layer.layout_kind!r} ({LAYOUT_KINDS[layer.layout_kind]} expected) ({at})"
        )
    if g.kv_layout not in KV_LAYOUTS:
        raise invalid(f"kv_layout {g.kv_layout!r} must be one of {KV_LAYOUTS} ({at})")
    if (layer.layout_kind == "mla") != (g.kv_layout == "MLA"):
        raise invalid(
            f"kv_layout {g.kv_layout!r} and layout_kind {layer.layout_kind!r} disagree ({at})"
        )
    _bounded(f"bytes_per_block ({at})", g.bytes_per_block, 1, MAX_BYTES_PER_BLOCK)
    if g.bytes_per_block % g.segments:
        raise invalid(f"bytes_per_block {g.bytes_per_block} is not divisible by segments ({at})")
    _bounded(f"num_blocks ({at})", layer.num_blocks, 1, MAX_NUM_BLOCKS)
    if layer.block_stride < layer.segment_bytes and layer.num_blocks > 1:
        raise invalid(
            f"block_stride {layer.block_stride} is smaller than a block's "
            f"{layer.segment_bytes} bytes per segment ({at})"
        )
    if g.segments == 2 and layer.segment_stride < layer.segment_bytes:
        raise invalid(f"segment_stride {layer.segment_stride} overlaps segment 0 ({at})")


def _bounded(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise invalid(f"{name} {value} is outside [{lo}, {hi}]")


def check_against(inst: Instance, reg: Registration) -> None:
    """Checks against the ranks already in the instance."""
    first = inst.first
    for name in ("client_namespace", "world_size", "tp_size", "block_size", "hash_format"):
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


def _check_cells(other: Registration, reg: Registration) -> None:
    theirs = {layer.geometry.name: layer for layer in other.layers}
    for layer in reg.layers:
        peer = theirs.get(layer.geometry.name)
        if peer is None:
            continue
        name = layer.geometry.name
        if other.tp_rank == reg.tp_rank and not (layer.replicated and peer.replicated):
            raise exists(
                f"layer {name!r} tp_rank {reg.tp_rank} already has an owner: rank "
                f"{other.rank}; rank {reg.rank} cannot own it too"
            )
        for fld in ("dtype", "bytes_per_block", "segments", "kv_layout"):
            mine, ref = getattr(layer.geometry, fld), getattr(peer.geometry, fld)
            if mine != ref:
                raise invalid(
                    f"layer {name!r} field {fld}: rank {reg.rank} says {mine!r} but "
                    f"rank {other.rank} registered {ref!r}"
                )


def check_seal_would_succeed(inst: Instance | None, reg: Registration) -> None:
    """Refuse the last rank if its arrival would leave a cell without owner."""
    ranks = [*(inst.ranks.values() if inst else ()), reg]
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


def make_seal(inst: Instance) -> Seal:
    first = inst.first
    by_name: dict[str, LayerGeometry] = {}
    for r in inst.ranks.values():
        for layer in r.layers:
            by_name.setdefault(layer.geometry.name, layer.geometry)
    layers = tuple(by_name[n] for n in sorted(by_name))
    fp = fingerprint(first.block_size, first.hash_format, first.tp_size, list(layers))
    return Seal(
        fingerprint=fp,
        final_namespace=final_namespace(first.client_namespace, fp),
        layer_ids={g.name: i for i, g in enumerate(layers)},
        layers=layers,
        tp_size=first.tp_size,
    )


__all__ = ["Registry", "Registration", "LayerReg", "Instance", "Seal", "KVError"]
