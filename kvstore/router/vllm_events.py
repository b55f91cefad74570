"""vLLM's KV event stream, decoded without vLLM or msgspec.

vLLM's ``ZmqEventPublisher`` sends each batch as a three-frame ZMQ message:
``topic`` (UTF-8, often empty), ``seq`` (u64 big-endian, per publisher),
``payload`` (msgpack of a ``KVEventBatch``). The batch and its events are
msgspec structs; the event union is tagged with the class name. Depending on
the vLLM version the structs are ``array_like`` (positional arrays) or maps:

    batch  [ts, [event, ...], data_parallel_rank?]   or {"ts", "events", ...}
    event  ["BlockStored", block_hashes, parent_block_hash, token_ids,
            block_size, lora_id, medium?, lora_name?, extra_keys?, group_idx?, ...]
           ["BlockRemoved", block_hashes, medium?, group_idx?]
           ["AllBlocksCleared"]
           or maps with the tag under "type"

Trailing fields that hold their default are omitted (``omit_defaults``), so
optional positions may be missing. Block hashes are ints, or bytes when
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is off; bytes become the same u64
vLLM would publish (big-endian, low 64 bits), and negative ints from old
versions wrap to u64, so one block has one key however it was published.

For the router a batch is flattened, not listed: ``decode_batch`` returns
``EventRun``s (per tier, the hashes in order, each stored or removed), and
reads the shapes vLLM sends during decode inline, without an object per event. ``decode_events``
lists every event as a ``BlockEvent`` (tests, tools).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat

import msgpack

from kvstore.wire import limits
from kvstore.wire.events import CLEARED, GPU_TIER, REMOVED, STORE_TIER, STORED
from kvstore.wire.names import U64_MAX

_TAGS = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": CLEARED}


@dataclass
class BlockEvent:
    """One decoded event: what happened to which hashes, in which tier."""

    kind: str  # STORED | REMOVED | CLEARED
    hashes: list[int]
    tier: str = GPU_TIER  # GPU_TIER for vLLM's device cache, STORE_TIER for offloaded media
    parent_hash: int | None = None


@dataclass
class TierOps:
    """One tier's events, flattened and in order: ``hashes[i]`` was stored
    (``keeps[i]``) or removed."""

    hashes: list[int]
    keeps: list[bool]


@dataclass
class EventRun:
    """Consecutive events with no AllBlocksCleared between them, per tier."""

    # an AllBlocksCleared (vLLM's device prefix cache reset: tier gpu only) comes
    # just before the run
    cleared_first: bool
    tiers: dict[str, TierOps]


@dataclass
class VllmBatch:
    seq: int
    ts: float
    data_parallel_rank: int | None
    runs: list[EventRun]
    events: int  # events decoded (those of other groups not counted)
    blocks_stored: int  # hashes in the BlockStored events
    skipped: int = 0  # events of other KV-cache groups (hybrid models)


def decode_message(frames: list[bytes]) -> VllmBatch:
    """Decode one multipart message (topic, seq, payload); ValueError if malformed."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(seq_bytes)}")
    return decode_batch(payload, int.from_bytes(seq_bytes, "big"))


def decode_batch(payload: bytes, seq: int = 0) -> VllmBatch:
    """Decode a batch for the router (``EventRun``s), without an object per event."""
    ts, raw_events, dp_rank = _unpack(payload)
    folder = _Folder()
    folder.fold(raw_events)
    return VllmBatch(
        seq, ts, dp_rank, folder.runs, folder.events, folder.blocks_stored, folder.skipped
    )


def decode_events(payload: bytes) -> list[BlockEvent]:
    """Every event of a batch as a ``BlockEvent``, in order (tests, tools)."""
    _, raw_events, _ = _unpack(payload)
    decoded = (_decode_event(raw, i) for i, raw in enumerate(raw_events))
    return [e for e in decoded if e is not None]


def fold_events(events: Iterable[BlockEvent]) -> list[EventRun]:
    """Already decoded events as runs (what ``Router.apply_worker_events`` applies)."""
    folder = _Folder()
    for e in events:
        folder.add(e)
    return folder.runs


def _unpack(payload: bytes) -> tuple[float, list, int | None]:
    if len(payload) > limits.MAX_EVENT_BYTES:
        raise ValueError(f"batch is {len(payload)} bytes, at most {limits.MAX_EVENT_BYTES}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types
        raise ValueError(f"batch is not valid msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, dp_rank = raw[0], raw[1], (raw[2] if len(raw) > 2 else None)
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, dp_rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise ValueError("batch must be [ts, events, ...] or a map with 'events'")
    if not isinstance(events, list):
        raise ValueError("batch events must be an array")
    if not isinstance(ts, (int, float)):
        raise ValueError("batch ts must be a number")
    return float(ts), events, dp_rank if isinstance(dp_rank, int) else None


class _Folder:
    """Builds the runs of a batch. ``fold`` takes vLLM's commonest shapes inline
    (``["BlockStored", [h], parent, tokens, size, lora, "GPU"]`` and
    ``["BlockRemoved", [h], "GPU"]``: one u64 hash, no group index) and hands
    anything else to the full decoder, so both accept and refuse the same events."""

    def __init__(self):
        self.runs: list[EventRun] = []
        self.events = self.blocks_stored = self.skipped = 0
        self._new_run(False)

    def _new_run(self, cleared: bool) -> None:
        self._gpu = TierOps([], [])
        self.runs.append(EventRun(cleared, {GPU_TIER: self._gpu}))

    def fold(self, raw_events: list) -> None:
        add_hash, add_keep = self._gpu.hashes.append, self._gpu.keeps.append
        stored = fast = 0
        for i, ev in enumerate(raw_events):
            if type(ev) is list:
                n = len(ev)
                if n == 7 and ev[0] == "BlockStored":  # vLLM's usual positional shape
                    keep, hs, medium, parent = True, ev[1], ev[6], ev[2]
                elif n == 3 and ev[0] == "BlockRemoved":
                    keep, hs, medium, parent = False, ev[1], ev[2], None
                else:
                    hs = None
                if (
                    type(hs) is list
                    and len(hs) == 1
                    and medium == "GPU"
                    and type(h := hs[0]) is int
                    and 0 <= h <= U64_MAX
                    and (parent is None or (type(parent) is int and 0 <= parent <= U64_MAX))
                ):
                    add_hash(h)
                    add_keep(keep)
                    stored += keep
                    fast += 1
                    continue
            self.blocks_stored += stored
            stored = 0
            event = _decode_event(ev, i)
            if event is None:
                self.skipped += 1
            else:
                self.add(event)
            add_hash, add_keep = self._gpu.hashes.append, self._gpu.keeps.append
        self.blocks_stored += stored
        self.events += fast

    def add(self, event: BlockEvent) -> None:
        self.events += 1
        if event.kind == CLEARED:
            self._new_run(True)
            return
        ops = self.runs[-1].tiers.setdefault(event.tier, TierOps([], []))
        keep = event.kind == STORED
        ops.hashes.extend(event.hashes)
        ops.keeps.extend(repeat(keep, len(event.hashes)))
        if keep:
            self.blocks_stored += len(event.hashes)


def _decode_event(raw: object, i: int) -> BlockEvent | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, f = raw[0], raw[1:]
        kind = _TAGS.get(tag)
        if kind == STORED:
            if len(f) < 5:
                raise ValueError(f"events[{i}]: BlockStored needs at least 5 fields, got {len(f)}")
            hashes, parent, medium = f[0], f[1], _at(f, 5)
            group = _at(f, 8)
        elif kind == REMOVED:
            if len(f) < 1:
                raise ValueError(f"events[{i}]: BlockRemoved needs block_hashes")
            hashes, parent, medium, group = f[0], None, _at(f, 1), _at(f, 2)
        elif kind == CLEARED:
            return BlockEvent(CLEARED, [])
        else:
            raise ValueError(f"events[{i}]: unknown event tag {tag!r}")
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        kind = _TAGS.get(raw["type"])
        if kind is None:
            raise ValueError(f"events[{i}]: unknown event tag {raw['type']!r}")
        if kind == CLEARED:
            return BlockEvent(CLEARED, [])
        if "block_hashes" not in raw:
            raise ValueError(f"events[{i}]: missing block_hashes")
        hashes, parent = raw["block_hashes"], raw.get("parent_block_hash")
        medium, group = raw.get("medium"), raw.get("group_idx")
    else:
        raise ValueError(f"events[{i}]: not a tagged event")
    if group not in (None, 0):
        return None  # another KV-cache group of a hybrid model: same hashes, other layers
    return BlockEvent(
        kind,
        normalize_hashes(hashes, f"events[{i}].block_hashes"),
        _tier(medium),
        None if parent is None else _one_hash(parent, f"events[{i}].parent"),
    )


def _at(fields: list, index: int) -> object:
    return fields[index] if len(fields) > index else None


def _tier(medium: object) -> str:
    if medium is None or medium == "GPU":
        return GPU_TIER
    return STORE_TIER  # CPU / disk offload on the worker's own host


def normalize_hashes(hashes: object, where: str) -> list[int]:
    """Validate and convert a hash list to u64 ints (fast path: all ints)."""
    if not isinstance(hashes, list):
        raise ValueError(f"{where} must be an array")
    if len(hashes) > limits.MAX_HASHES_PER_EVENT:
        raise ValueError(f"{where}: {len(hashes)} hashes, at most {limits.MAX_HASHES_PER_EVENT}")
    if not hashes:
        return hashes
    if set(map(type, hashes)) == _INT_ONLY and min(hashes) >= 0 and max(hashes) <= U64_MAX:
        return hashes
    return [_one_hash(h, where) for h in hashes]


_INT_ONLY = {int}


def _one_hash(h: object, where: str) -> int:
    if type(h) is int:
        if not -(1 << 63) <= h <= U64_MAX:
            raise ValueError(f"{where}: hash {h} is not a 64-bit integer")
        return h & U64_MAX
    if isinstance(h, bytes):
        if not 1 <= len(h) <= 64:
            raise ValueError(f"{where}: byte hash of {len(h)} bytes")
        return int.from_bytes(h, "big") & U64_MAX
    raise ValueError(f"{where}: hash of type {type(h).__name__}")
