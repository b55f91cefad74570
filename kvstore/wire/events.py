"""Store events, msgpack-encoded (docs/design.md §6).

Every seal, eviction and clear in a store server becomes one event; the
router indexes them and ``kvstore events`` prints them. An event is a
msgpack map with these keys (all present; ``parent_hash`` may be nil):

    {"type": "stored" | "removed" | "cleared",
     "namespace": str,            # final namespace (with fingerprint)
     "block_hashes": [u64, ...],  # empty for "cleared"
     "parent_hash": u64 | None,   # hash before block_hashes[0], "stored" only
     "token_ids": [int, ...],     # when known, else []
     "worker": str,               # who holds the blocks (store node id)
     "tier": "gpu" | "store" | "remote",
     "seq": u64,                  # per-source sequence number
     "ts": float}                 # unix seconds
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import msgpack

from kvstore.wire.names import is_u64

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
        """Decode and validate; raises ValueError on anything malformed."""
        try:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types
            raise ValueError(f"event is not valid msgpack: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("event must be a msgpack map")
        try:
            event = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"event has wrong keys: {exc}") from exc
        if event.type not in EVENT_TYPES:
            raise ValueError(f"event type {event.type!r} not one of {EVENT_TYPES}")
        if event.tier not in TIERS:
            raise ValueError(f"event tier {event.tier!r} not one of {TIERS}")
        if not all(is_u64(h) for h in event.block_hashes):
            raise ValueError("block_hashes must be u64 integers")
        return event
