"""Instances, rank registrations and the seal (docs/design.md §1).

Plain Python, no network: the gRPC handler validates nothing itself, it
hands a :class:`Registration` to :meth:`Registry.register`, which either
refuses it (``KVError`` naming field, layer and rank; nothing changes) or
records it and, when all ``world_size`` ranks are in, seals the instance.
The rules a registration must meet live in :mod:`kvstore.store.validation`.

Decisions happen in one synchronous call, so on the asyncio server no other
registration can interleave between the check and the insert.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstore.copy import RegionTable, first_overlap
from kvstore.store.block import SlotSet
from kvstore.store.local_user import CallerUser
from kvstore.store.memory import MappedRegion
from kvstore.store.validation import (
    check_against,
    check_device,
    check_fields,
    check_seal_would_succeed,
)
from kvstore.wire.errors import KVError, exhausted, exists, invalid, not_found, precondition
from kvstore.wire.fingerprint import LayerGeometry, fingerprint
from kvstore.wire.kv_layout import LayoutKind
from kvstore.wire.limits import MAX_MAPPED_BYTES_PER_PRINCIPAL
from kvstore.wire.names import final_namespace
from kvstore.wire.principal import LOCAL, Principal, check_owner
from kvstore.wire.sizes import format_size

if TYPE_CHECKING:
    from kvstore.copy import LayerRegion

log = logging.getLogger(__name__)


@dataclass
class LayerReg:
    """One layer as one rank registered it."""

    geometry: LayerGeometry
    layout_kind: LayoutKind | None  # None: unset or unknown on the wire (refused)
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


@dataclass(frozen=True)
class CallerId:
    """Who a Save or Load says it comes from."""

    instance_id: str
    rank: int
    session: str


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
    principal: Principal = LOCAL  # who sent it (its certificate CN with TLS)
    # the node's user behind it, whose rights its host memory is checked against
    user: CallerUser = field(default_factory=CallerUser.this_process)

    _holds: int = 0
    retired: bool = False

    @property
    def caller_id(self) -> CallerId:
        return CallerId(self.instance_id, self.rank, self.session)

    def where(self) -> str:
        # the id is not checked yet in the first refusals that name it: cut, as every echo
        return f"instance {self.instance_id[:64]!r} rank {self.rank} (tp_rank {self.tp_rank})"

    def layer_regions(self) -> list[LayerRegion]:
        """The mapped region of each layer, in registration order (what a copy plans over)."""
        return [self.regions[layer.geometry.name] for layer in self.layers]

    @functools.cached_property
    def num_blocks(self) -> int:
        """Blocks of its cache that every layer holds: a block id must be below it."""
        return min(layer.num_blocks for layer in self.layers)

    @functools.cached_property
    def copy_table(self) -> RegionTable:
        """The copy descriptors of this rank's layers, built once after they are mapped
        (docs/design.md §3): a request then carries only block ids and slot addresses."""
        return RegionTable(self.layer_regions())

    def hold(self) -> None:
        """A copy is about to touch this rank's memory: keep it mapped."""
        self._holds += 1

    def unhold(self) -> None:
        self._holds -= 1
        self._maybe_unmap()

    def mapped_bytes(self) -> int:
        """Bytes of worker memory this rank's registration maps."""
        return sum(m.size for m in self.mapped)

    def memory_ids(self) -> set[tuple]:
        """What this rank's mappings are (inode or CUDA allocation), whatever named them."""
        return {m.identity for m in self.mapped if m.identity is not None}

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
    # session -> its rank's SlotSet: worked out at its first Save or Load, not per call
    _slot_sets: dict[str, SlotSet] = field(default_factory=dict, compare=False, repr=False)

    @property
    def slots_per_block(self) -> int:
        return len(self.layers) * self.tp_size

    def slot_index(self, layer_id: int, tp_rank: int) -> int:
        return layer_id * self.tp_size + tp_rank

    def slots_of(self, reg: Registration) -> SlotSet:
        """The slots of ``reg``'s layers (in its registration order), once a rank:
        its layers and this seal never change while it is one of its ranks."""
        slots = self._slot_sets.get(reg.session)
        if slots is None:
            ids = [
                self.slot_index(self.layer_ids[la.geometry.name], reg.tp_rank) for la in reg.layers
            ]
            slots = self._slot_sets[reg.session] = SlotSet.of(ids, self.slot_bytes)
        return slots

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

    @property
    def devices(self) -> list[str]:
        """The device of each tp_rank's memory, by tp_rank."""
        devices = ["cpu"] * (self.seal.tp_size if self.seal else self.first.tp_size)
        for reg in self.ranks.values():
            devices[reg.tp_rank] = reg.device
        return devices


@dataclass(frozen=True)
class Caller:
    """A Save or Load caller, resolved: its registration and its instance's seal."""

    seal: Seal
    reg: Registration


@dataclass(frozen=True)
class RegistryStats:
    instances: int = 0
    sealed_instances: int = 0


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

    def register(self, reg: Registration, pools: Collection[str] | None = None) -> Instance:
        """Validate, map memory, record; seal when complete. Atomic. ``pools``: the
        devices blocks can be kept on (a rank's memory elsewhere is refused)."""
        check_fields(reg)
        inst = self.instances.get(reg.instance_id)
        if inst is not None:  # every rank of an instance comes from its first rank's principal
            check_owner(f"instance {reg.instance_id!r}", inst.first.principal.name, reg.principal)
            check_against(inst, reg)
        check_seal_would_succeed(list(inst.ranks.values()) if inst else [], reg)
        if self._mapper is not None:
            self._mapper(reg)  # raises KVError; nothing recorded yet
            try:
                self._check_owner(reg)
                self._check_mapped_quota(reg)
                check_layers_apart(reg)
                check_device(inst, reg, pools)
            except KVError:
                reg.retire()  # unmap what was just mapped
                raise
        else:
            check_device(inst, reg, pools)
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

    def _check_owner(self, reg: Registration) -> None:
        """Memory belongs to one registration: another rank or instance naming the
        same object (under any name) would read and overwrite its live KV cache."""
        mine = reg.memory_ids()
        for other in self.sessions.values():
            shared = mine & other.memory_ids()
            if shared:
                # another tenant's registration is not named (its instance id and rank)
                by = (
                    other.where()
                    if reg.principal.may_act_for(other.principal.name)
                    else "another caller"
                )
                raise exists(
                    f"memory of {reg.where()} is already registered by {by}; "
                    "each rank must register its own KV-cache memory"
                )

    def _check_mapped_quota(self, reg: Registration) -> None:
        """A non-admin principal's registrations map at most
        MAX_MAPPED_BYTES_PER_PRINCIPAL of worker memory together (RESOURCE_EXHAUSTED)."""
        owner = reg.principal
        if owner.admin:
            return
        mine = reg.mapped_bytes()
        held = sum(
            other.mapped_bytes()
            for other in self.sessions.values()
            if other.principal.name == owner.name
        )
        if held + mine > MAX_MAPPED_BYTES_PER_PRINCIPAL:
            raise exhausted(
                f"{reg.where()} maps {format_size(mine)} of worker memory and {owner} "
                f"already maps {format_size(held)}: at most "
                f"{format_size(MAX_MAPPED_BYTES_PER_PRINCIPAL)} a certificate"
            )

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

    def caller(self, who: CallerId) -> Caller:
        """The sealed instance and registration a Save/Load comes from."""
        inst = self.instances.get(who.instance_id)
        if inst is None:
            raise not_found(f"instance_id {who.instance_id[:128]!r} is not registered")
        reg = self.sessions.get(who.session)
        if reg is None or reg.instance_id != who.instance_id:
            raise invalid(f"session does not belong to instance_id {who.instance_id!r}")
        if reg.rank != who.rank:
            raise invalid(f"rank {who.rank} is not the caller's: the session is rank {reg.rank}")
        if inst.seal is None:
            raise precondition(
                f"instance {who.instance_id!r} is not sealed: "
                f"{len(inst.ranks)}/{reg.world_size} ranks registered"
            )
        return Caller(inst.seal, reg)

    def get(self, instance_id: str) -> Instance | None:
        """The instance of ``instance_id``, sealed or not; None when no rank is in."""
        return self.instances.get(instance_id)

    def sealed(self, namespace: str) -> Instance | None:
        """A sealed local instance whose blocks live in final namespace ``namespace``."""
        for inst in self.instances.values():
            if inst.seal is not None and inst.seal.final_namespace == namespace:
                return inst
        return None

    def stats(self) -> RegistryStats:
        return RegistryStats(
            instances=len(self.instances),
            sealed_instances=sum(1 for i in self.instances.values() if i.seal is not None),
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


__all__ = [
    "Caller",
    "CallerId",
    "Instance",
    "LayerReg",
    "Registration",
    "Registry",
    "RegistryStats",
    "Seal",
]


def check_layers_apart(reg: Registration) -> None:
    """INVALID_ARGUMENT when two of ``reg``'s mapped layers share bytes (a layer
    listed twice, or two names for one tensor): every Load into them would be
    refused, so the rank is refused instead (docs/design.md §1)."""
    overlap = first_overlap(reg.copy_table)
    if overlap is None:
        return
    a, b = reg.layers[overlap.layer_a], reg.layers[overlap.layer_b]
    raise invalid(
        f"layers {a.geometry.name!r} (block {overlap.block_a}) and {b.geometry.name!r} "
        f"(block {overlap.block_b}) of {reg.where()} share memory: a Load into both "
        "could not be ordered; register memory several layers share once"
    )
