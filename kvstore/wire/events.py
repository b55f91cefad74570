"""Store events, msgpack-encoded (docs/design.md §6).

Every seal, eviction and clear in a store server becomes one event; the
router indexes them and ``kvstore events`` prints them. An event is a
msgpack map with these keys (``encode`` writes all; ``decode`` needs type,
namespace, block_hashes and worker, and checks every key it gets, naming the
bad one in :class:`MalformedEvent`):

    {"type": "stored" | "removed" | "cleared",
     "namespace": str,            # final namespace (with fingerprint)
     "block_hashes": [u64, ...],  # empty for "cleared"
     "parent_hash": u64 | None,   # hash before block_hashes[0], "stored" only
     "token_ids": [u32, ...],     # when known, else []
     "worker": str,               # who holds the blocks (store node id)
     "tier": "gpu" | "store" | "remote",
     "seq": u64,                  # per-source sequence number
     "ts": float}                 # unix seconds
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import msgpack

from kvstore.wire import limits
from kvstore.wire.names import U64_MAX, is_u64

U32_MAX = (1 << 32) - 1

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
EVENT_TYPES = (STORED, REMOVED, CLEARED)
# Where a holder keeps a block: the worker's own GPU, its node's store, a peer store.
GPU_TIER = "gpu"
STORE_TIER = "store"
REMOTE_TIER = "remote"
TIERS = (GPU_TIER, STORE_TIER, REMOTE_TIER)


@dataclass
class StoreEvent:
    type: str
    namespace: str
    block_hashes: list[int]
    worker: str
    tier: str = STORE_TIER
    parent_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    seq: int = 0
    ts: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, payload: bytes) -> StoreEvent:
        """Decode and validate every field; raises :class:`MalformedEvent` (a
        ValueError naming the field) on anything malformed."""
        try:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types
            raise MalformedEvent(
                "", f"not valid msgpack: {str(exc) or type(exc).__name__}"
            ) from exc
        if not isinstance(raw, dict):
            raise MalformedEvent("", f"must be a msgpack map, got {_kind(raw)}")
        for key in raw:
            if not isinstance(key, str):
                raise MalformedEvent("", f"keys must be strings, got {_kind(key)}")
            if key not in _FIELDS:
                raise MalformedEvent(key[:64], f"unknown key; the keys are {_FIELDS}")
        for key in _REQUIRED:
            if key not in raw:
                raise MalformedEvent(key, "missing")
        for key, check in _CHECKS:
            if key in raw:
                check(key, raw[key])
        event = cls(**raw)
        if event.type == CLEARED and event.block_hashes:
            raise MalformedEvent("block_hashes", "must be empty for a cleared event")
        if event.type != STORED and event.parent_hash is not None:
            raise MalformedEvent("parent_hash", f"must be nil for a {event.type} event")
        return event


class MalformedEvent(ValueError):
    """A store event that does not decode; ``field`` is its key at fault ("" for
    the event as a whole)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def _kind(value: object) -> str:
    """``value``'s type in msgpack's words."""
    return _KINDS.get(type(value), type(value).__name__)


_KINDS = {
    type(None): "nil",
    bool: "boolean",
    int: "integer",
    float: "float",
    str: "string",
    bytes: "binary",
    list: "array",
    dict: "map",
}


def _one_of(choices: tuple[str, ...]) -> Callable[[str, object], None]:
    def check(key: str, value: object) -> None:
        if not isinstance(value, str) or value not in choices:
            shown = repr(value[:64]) if isinstance(value, str) else _kind(value)
            raise MalformedEvent(key, f"{shown} is not one of {choices}")

    return check


def _string(key: str, value: object) -> None:
    if not isinstance(value, str):
        raise MalformedEvent(key, f"must be a string, got {_kind(value)}")


def _u64(key: str, value: object) -> None:
    if not is_u64(value):
        shown = value if type(value) is int else _kind(value)
        raise MalformedEvent(key, f"must be a u64 integer, got {shown}")


def _u64_or_nil(key: str, value: object) -> None:
    if value is not None:
        _u64(key, value)


def _int_array(what: str, highest: int, longest: int) -> Callable[[str, object], None]:
    """An array of at most ``longest`` integers in [0, ``highest``] (fast path: all fine)."""

    def check(key: str, value: object) -> None:
        if not isinstance(value, list):
            raise MalformedEvent(key, f"must be an array of {what}s, got {_kind(value)}")
        if len(value) > longest:
            raise MalformedEvent(key, f"{len(value)} items, at most {longest}")
        if not value or (
            set(map(type, value)) == _INT_ONLY and min(value) >= 0 and max(value) <= highest
        ):
            return
        for i, item in enumerate(value):
            if type(item) is not int or not 0 <= item <= highest:
                shown = item if type(item) is int else _kind(item)
                raise MalformedEvent(f"{key}[{i}]", f"must be a {what}, got {shown}")

    return check


_INT_ONLY = {int}


def _seconds(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        shown = value if isinstance(value, float) else _kind(value)
        raise MalformedEvent(key, f"must be a finite number, got {shown}")


_FIELDS = tuple(f.name for f in fields(StoreEvent))
_REQUIRED = ("type", "namespace", "block_hashes", "worker")  # the rest have defaults
_CHECKS: tuple[tuple[str, Callable[[str, object], None]], ...] = (
    ("type", _one_of(EVENT_TYPES)),
    ("namespace", _string),
    ("block_hashes", _int_array("u64 integer", U64_MAX, limits.MAX_HASHES_PER_EVENT)),
    ("worker", _string),
    ("tier", _one_of(TIERS)),
    ("parent_hash", _u64_or_nil),
    ("token_ids", _int_array("u32 token id", U32_MAX, limits.MAX_TOKEN_IDS)),
    ("seq", _u64),
    ("ts", _seconds),
)
