"""What kvstore keeps in etcd: the keys under its prefix and their records.

    <prefix>stores/<node id>           StoreRecord   the store server's lease (owner: its publisher)
    <prefix>routers/<address>          RouterRecord  the router replica's lease
    <prefix>workers/<worker>           NameClaim     the worker's lease
    <prefix>worksets/<model>/<namespace>/<role>/card             SetCard   no lease
    <prefix>worksets/<model>/<namespace>/<role>/members/<worker> MemberRecord  the worker's lease

``<prefix>`` is ``/kvstore/v1/`` unless configured. Every path component is
percent-encoded (``urllib.parse.quote`` with nothing safe), so a ``/`` never
occurs inside one, keys are ASCII, and one set's prefix is never a prefix of
another's. Records are msgpack maps (``use_bin_type``); a record that does not
decode is logged and skipped by whoever reads it, never fatal.

A worker's lease is held by the router replica that admitted it; its name
claim and its member key are written together and vanish together. Both name
the worker's owner, the caller that admitted it (docs/design.md §8).
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields
from urllib.parse import quote, unquote

import msgpack

from kvstore.wire.card import WorkerCard

_CARD_FIELDS = frozenset(f.name for f in fields(WorkerCard))
_CARD_TYPES = typing.get_type_hints(WorkerCard)


@dataclass(frozen=True, order=True)
class SetId:
    """A WorkerSet: (model = display name, namespace, role = worker type)."""

    model: str
    namespace: str
    role: str

    @classmethod
    def of(cls, card: WorkerCard) -> SetId:
        return cls(card.display_name, card.namespace, card.worker_type)

    def __str__(self) -> str:
        return f"{self.model}/{self.namespace}/{self.role}"


@dataclass(frozen=True)
class Layout:
    """The keys under one prefix (ending in ``/``)."""

    prefix: str

    @property
    def stores(self) -> str:
        return f"{self.prefix}stores/"

    @property
    def routers(self) -> str:
        return f"{self.prefix}routers/"

    @property
    def worksets(self) -> str:
        return f"{self.prefix}worksets/"

    def store(self, node_id: str) -> str:
        return self.stores + _q(node_id)

    def router(self, address: str) -> str:
        return self.routers + _q(address)

    @property
    def workers(self) -> str:
        return f"{self.prefix}workers/"

    def worker(self, name: str) -> str:
        return self.workers + _q(name)

    def workset(self, set_id: SetId) -> str:
        return f"{self.worksets}{_q(set_id.model)}/{_q(set_id.namespace)}/{_q(set_id.role)}/"

    def card(self, set_id: SetId) -> str:
        return self.workset(set_id) + "card"

    def members(self, set_id: SetId) -> str:
        return self.workset(set_id) + "members/"

    def member(self, set_id: SetId, name: str) -> str:
        return self.members(set_id) + _q(name)

    def name_under(self, directory: str, key: str) -> str:
        """The node id or address of ``key``, a key directly under ``directory``."""
        return unquote(key.removeprefix(directory))

    def parse_workset_key(self, key: str) -> tuple[SetId, str | None] | None:
        """``(set, worker name)`` of a member key, ``(set, None)`` of a card key,
        None for anything else under ``worksets/``."""
        parts = key.removeprefix(self.worksets).split("/")
        if len(parts) == 4 and parts[3] == "card":
            return SetId(*map(unquote, parts[:3])), None
        if len(parts) == 5 and parts[3] == "members":
            return SetId(*map(unquote, parts[:3])), unquote(parts[4])
        return None


def _q(component: str) -> str:
    return quote(component, safe="")


# -- records -----------------------------------------------------------------


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(raw: bytes) -> dict:
    try:
        value = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several types
        raise ValueError(f"not msgpack: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("not a msgpack map")
    return value


def _card_of(value: object) -> WorkerCard:
    if not isinstance(value, dict):
        raise ValueError("card is not a map")
    known = {k: v for k, v in value.items() if k in _CARD_FIELDS}
    for name, field_value in known.items():
        if not _of_type(field_value, _CARD_TYPES[name]):
            raise ValueError(f"card.{name}: {type(field_value).__name__}, not {_CARD_TYPES[name]}")
    try:
        return WorkerCard(**known)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"card: {exc}") from None


def _of_type(value: object, hint: object) -> bool:
    """Whether ``value`` (as msgpack gave it) is of a card field's type: str, int,
    bool, list[str] or dict[str, str] (a record another tool wrote may be anything)."""
    origin = typing.get_origin(hint)
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else False


def _owner(value: dict) -> str:
    """The owner a record names ("" when none: the anonymous local caller)."""
    return str(value.get("owner", ""))


@dataclass(frozen=True)
class StoreRecord:
    """A store server: where workers and peers reach it, and who speaks for it.

    ``owner``: the principal (certificate CN) that may publish as this node id,
    this generation; None until the first publisher claims it through a
    replica (``claims.py``), which writes it into this value.
    """

    store_address: str
    ucx_address: str = ""
    owner: str | None = None

    def encode(self) -> bytes:
        value = {"store": self.store_address, "ucx": self.ucx_address}
        if self.owner is not None:
            value["owner"] = self.owner
        return _pack(value)

    @classmethod
    def decode(cls, raw: bytes) -> StoreRecord:
        value = _unpack(raw)
        owner = value.get("owner")
        return cls(
            str(value.get("store", "")),
            str(value.get("ucx", "")),
            None if owner is None else str(owner),
        )


@dataclass(frozen=True)
class RouterRecord:
    """A router replica: the gRPC address stores publish to and clients route through."""

    address: str

    def encode(self) -> bytes:
        return _pack({"address": self.address})

    @classmethod
    def decode(cls, raw: bytes) -> RouterRecord:
        return cls(str(_unpack(raw).get("address", "")))


@dataclass(frozen=True)
class NameClaim:
    """Which WorkerSet a worker name is admitted into now, and for whom: only
    ``owner`` (a certificate CN; "" = the anonymous local caller) or an admin
    may re-register or remove the name while it is admitted."""

    set_id: SetId
    owner: str = ""

    def encode(self) -> bytes:
        s = self.set_id
        return _pack({"set": [s.model, s.namespace, s.role], "owner": self.owner})

    @classmethod
    def decode(cls, raw: bytes) -> NameClaim:
        value = _unpack(raw)
        parts = value.get("set")
        if not (isinstance(parts, list) and len(parts) == 3):
            raise ValueError("set is not [model, namespace, role]")
        return cls(SetId(*map(str, parts)), _owner(value))


@dataclass(frozen=True)
class SetCard:
    """A WorkerSet's first-wins identity: its checksum, hash format and reference
    card, and its owner, the principal that admitted its first member (only it
    or an admin may join the set while it has members)."""

    checksum: str
    hash_format: str
    card: WorkerCard
    owner: str = ""

    def encode(self) -> bytes:
        return _pack(
            {
                "checksum": self.checksum,
                "hash_format": self.hash_format,
                "card": asdict(self.card),
                "owner": self.owner,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> SetCard:
        value = _unpack(raw)
        return cls(
            str(value.get("checksum", "")),
            str(value.get("hash_format", "")),
            _card_of(value.get("card")),
            _owner(value),
        )


@dataclass(frozen=True)
class MemberRecord:
    """An admitted worker: its whole card, so every replica can route to it,
    and its owner (as in its :class:`NameClaim`), so every replica's core
    records who admitted it."""

    card: WorkerCard
    owner: str = ""

    def encode(self) -> bytes:
        return _pack({"card": asdict(self.card), "owner": self.owner})

    @classmethod
    def decode(cls, raw: bytes) -> MemberRecord:
        value = _unpack(raw)
        return cls(_card_of(value.get("card")), _owner(value))
