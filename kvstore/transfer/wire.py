"""The transfer wire format: preambles, control frames and their bounds.

Every control frame is a fixed 16-byte preamble (magic, version, kind, arg)
then a msgpack body of ``arg`` bytes. Counts, sizes and string lengths are
bounded on decode, msgpack is read with explicit limits, and nothing is
unpickled. See the package docstring for the exchange these frames make.
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvstore.transfer.errors import PeerUnavailable, ProtocolError, VersionMismatch
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.names import MAX_FINAL_NAMESPACE_LEN

log = logging.getLogger(__name__)

# Raised whenever a frame's layout or the exchange changes: peers of another
# version are refused. 4: the optional HELLO / CHALLENGE / PROOF handshake.
# 5: one-sided reads (CARD_REQUEST / CARD, REQUEST's rma flag, a grant in REPLY,
# RELEASE).
PROTOCOL_VERSION = 5
MAX_BLOCKS_PER_FETCH = limits.MAX_BLOCKS_PER_REQUEST
MAX_SLOTS_PER_BLOCK = limits.MAX_LAYERS * limits.MAX_TP_SIZE
MAX_SLOTS_PER_FETCH = 1 << 20  # a peer trims its prefix to stay under this
MAX_SLOT_BYTES = limits.MAX_BYTES_PER_BLOCK
MAX_REQUEST_BYTES = 128 << 10
MAX_REPLY_BYTES = 16 << 20
MAX_ERROR_BYTES = 8 << 10
MAX_GO_BYTES = 4 * MAX_SLOTS_PER_FETCH + 64
MAX_HANDSHAKE_BYTES = 256
MAX_CARD_FRAME_BYTES = 272 << 10  # a PeerCard (kvstore.transfer.rma.MAX_CARD_BYTES) and framing
MAX_RELEASE_BYTES = 64
MAX_LEASE_EXPIRY_MS = 600_000  # a one-sided lease a peer announces: at most 10 minutes
NONCE_BYTES = 32  # fresh from os.urandom on each side of each connection
MAC_BYTES = 32  # HMAC-SHA256
# A control frame whose preamble and body fit this many bytes travels as one
# message (nearly all do); a longer one as its preamble, then its body.
INLINE_FRAME_BYTES = 64 << 10
# A run of adjacent slots is cut at this many bytes (one UCX message at most).
MAX_SEGMENT_BYTES = 64 << 20
NO_CAP = 1 << 62  # run_starts without cuts at MAX_SEGMENT_BYTES
MAX_LANES = limits.MAX_TP_SIZE

MAGIC = b"KVTP"
PREAMBLE = struct.Struct("<4sBBHQ")  # magic, version, kind, reserved, arg


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3
    GO = 4
    HELLO = 5  # fetcher: [version, fetcher nonce]
    CHALLENGE = 6  # peer: [peer nonce, peer's MAC]
    PROOF = 7  # fetcher: [fetcher's MAC]
    CARD_REQUEST = 8  # fetcher: [version]; after the handshake, once per connection
    CARD = 9  # peer: [card] (b"" when it serves no one-sided reads)
    RELEASE = 10  # fetcher: [lease id]; one-way, after a one-sided read


class Preamble(NamedTuple):
    kind: Kind
    length: int  # body bytes that follow


class FetchRequest(NamedTuple):
    namespace: str  # final namespace
    hashes: list[int]
    rma: bool = False  # the fetcher reads one-sided if the peer grants it


class Grant(NamedTuple):
    """A peer's lease for a one-sided read: its id (named in RELEASE), how long the
    peer pins the blocks without RELEASE, and where each offered slot lies in its
    registered memory (block after block)."""

    lease_id: int
    expiry_s: float
    addresses: np.ndarray  # uint64 per slot


class Go(NamedTuple):
    accepted: int  # blocks the fetcher takes: all offered, or 0 to cancel
    run_starts: bytes  # the fetcher's packed run starts, not yet checked


_BODY_LIMITS = {
    Kind.REQUEST: MAX_REQUEST_BYTES,
    Kind.REPLY: MAX_REPLY_BYTES,
    Kind.ERROR: MAX_ERROR_BYTES,
    Kind.GO: MAX_GO_BYTES,
    Kind.HELLO: MAX_HANDSHAKE_BYTES,
    Kind.CHALLENGE: MAX_HANDSHAKE_BYTES,
    Kind.PROOF: MAX_HANDSHAKE_BYTES,
    Kind.CARD_REQUEST: MAX_RELEASE_BYTES,
    Kind.CARD: MAX_CARD_FRAME_BYTES,
    Kind.RELEASE: MAX_RELEASE_BYTES,
}


def encode_preamble(kind: Kind, arg: int) -> bytes:
    return PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, kind, 0, arg)


def encode_frame(kind: Kind, body: bytes) -> list[bytes]:
    """The messages of one control frame: preamble and body together when they fit
    INLINE_FRAME_BYTES, else the preamble alone and then the body."""
    pre = encode_preamble(kind, len(body))
    if len(pre) + len(body) <= INLINE_FRAME_BYTES:
        return [pre + body]
    return [pre, body]


def decode_preamble(raw: bytes, expect: Sequence[Kind]) -> Preamble:
    """Check a preamble: magic, version, an expected kind, a body within bounds."""
    magic, version, kind, _reserved, arg = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if kind not in [int(k) for k in expect]:
        raise ProtocolError(f"frame kind {kind}, expected one of {[k.name for k in expect]}")
    kind = Kind(kind)
    limit = _BODY_LIMITS.get(kind)
    if limit is not None and not 0 < arg <= limit:
        raise ProtocolError(f"{kind.name} body of {arg} bytes, limit {limit}")
    return Preamble(kind, arg)


def _unpack(body: bytes, max_len: int) -> Any:
    """msgpack with every container and string bounded; no extension types."""
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=MAX_BLOCKS_PER_FETCH,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack body: {e}") from None


def encode_request(namespace: str, hashes: Sequence[int], rma: bool = False) -> bytes:
    packed = np.asarray(hashes, dtype="<u8").tobytes()
    return msgpack.packb([PROTOCOL_VERSION, namespace, packed, rma], use_bin_type=True)


def decode_request(body: bytes) -> FetchRequest:
    req = _unpack(body, MAX_REQUEST_BYTES)
    if not (isinstance(req, list) and len(req) == 4):
        raise ProtocolError("request is not [version, namespace, hashes, rma]")
    version, namespace, packed, rma = req
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"request version {version!r}")
    if not isinstance(rma, bool):
        raise ProtocolError(f"request rma flag {rma!r}, need true or false")
    check_namespace(namespace, ProtocolError)
    if not isinstance(packed, bytes) or len(packed) % 8:
        raise ProtocolError("hashes must be packed little-endian u64")
    count = len(packed) // 8
    if not 0 < count <= MAX_BLOCKS_PER_FETCH:
        raise ProtocolError(f"{count} hashes, limit 1..{MAX_BLOCKS_PER_FETCH}")
    hashes = np.frombuffer(packed, dtype="<u8").tolist()
    if len(set(hashes)) != count:  # a set of ints: faster than np.unique at every count
        raise ProtocolError("hashes must be distinct")
    return FetchRequest(namespace, hashes, rma)


@dataclass(frozen=True)
class Offer:
    """What the peer will send: the distinct slot layouts, which one each offered
    block has (a prefix of the request), and where the peer's memory breaks runs
    of adjacent slots (see run_starts). Blocks of one namespace nearly always
    share one layout, so nothing here is per slot unless asked for."""

    layouts: list[list[int]]
    block_layout: np.ndarray  # int64 per block: index into layouts
    run_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lanes: int = 1
    grant: Grant | None = None  # a one-sided read was granted: no GO, no data frames

    @property
    def num_blocks(self) -> int:
        return len(self.block_layout)

    @property
    def slot_counts(self) -> np.ndarray:
        lens = np.array([len(x) for x in self.layouts], dtype=np.int64)
        return lens[self.block_layout] if len(lens) else np.zeros(0, dtype=np.int64)

    @property
    def slot_sizes(self) -> list[list[int]]:
        """Per block, its slot sizes (the blocks of one layout share one list)."""
        return [self.layouts[i] for i in self.block_layout.tolist()]

    def flat_sizes(self) -> np.ndarray:
        """Every offered slot's size, block after block."""
        if not self.num_blocks:
            return np.zeros(0, dtype=np.int64)
        arrays = [np.asarray(x, dtype=np.int64) for x in self.layouts]
        if len(arrays) == 1:
            return np.tile(arrays[0], self.num_blocks)
        return np.concatenate([arrays[i] for i in self.block_layout.tolist()])


def encode_offer(
    slot_sizes: list[list[int]], run_starts: Sequence[int] = (), lanes: int = 1
) -> bytes:
    """An offer of blocks given as per-block slot-size lists."""
    return encode_layouts(*distinct_layouts(slot_sizes), run_starts, lanes)


def distinct_layouts(blocks: Iterable[Sequence[int]]) -> tuple[list[list[int]], np.ndarray]:
    """Each distinct per-block slot-size list once, and each block's index into them."""
    seen: dict[tuple[int, ...], int] = {}
    index = [seen.setdefault(tuple(b), len(seen)) for b in blocks]
    return [list(x) for x in seen], np.asarray(index, dtype=np.int64)


def encode_layouts(
    layouts: Sequence[Sequence[int]],
    block_layout: Sequence[int] | np.ndarray,
    run_starts: Sequence[int] = (),
    lanes: int = 1,
    grant: Grant | None = None,
) -> bytes:
    """Each distinct layout once and an index per block, so a 64-slot x 8k-block
    reply stays small; with ``grant``, its lease id, expiry (ms) and packed
    addresses follow."""
    packed = [np.asarray(k, dtype="<u8").tobytes() for k in layouts]
    reply = [
        packed,
        np.asarray(block_layout, dtype="<u4").tobytes(),
        lanes,
        encode_run_starts(run_starts),
    ]
    if grant is not None:
        addresses = np.asarray(grant.addresses, dtype="<u8").tobytes()
        reply += [grant.lease_id, round(grant.expiry_s * 1000), addresses]
    return msgpack.packb(reply, use_bin_type=True)


def decode_offer(body: bytes, requested: int, rma: bool = False) -> Offer:
    """Validate everything a (possibly malicious) peer says before acting on it.
    ``rma``: the request asked for a one-sided read, so a grant may follow."""
    reply = _unpack(body, MAX_REPLY_BYTES)
    if not (isinstance(reply, list) and len(reply) in ((4, 7) if rma else (4,))):
        raise ProtocolError("reply is not [layouts, block_layout, lanes, run_starts(, grant)]")
    packed_layouts, packed_index, lanes, packed_starts = reply[:4]
    if not isinstance(packed_index, bytes) or len(packed_index) % 4:
        raise ProtocolError("block_layout must be packed u32")
    index = np.frombuffer(packed_index, dtype="<u4").astype(np.int64)
    if len(index) > requested:
        raise ProtocolError(f"peer offers {len(index)} blocks, {requested} were asked")
    if not isinstance(packed_layouts, list) or len(packed_layouts) > max(len(index), 1):
        raise ProtocolError("layouts must be a list, at most one per block")
    layouts = [_decode_layout(p) for p in packed_layouts]
    if len(index) and int(index.max()) >= len(layouts):
        raise ProtocolError("block_layout points past the layouts")
    num_slots = _num_slots(layouts, index)
    if num_slots > MAX_SLOTS_PER_FETCH:
        raise ProtocolError(f"{num_slots} slots, limit {MAX_SLOTS_PER_FETCH}")
    if not (
        isinstance(lanes, int)
        and 1 <= lanes <= MAX_LANES
        and all(len(s) % lanes == 0 for s in layouts)
    ):
        raise ProtocolError(
            f"lanes {lanes!r} must be 1..{MAX_LANES} and divide every block's slot count"
        )
    grant = _decode_grant(reply[4:], num_slots) if len(reply) == 7 else None
    return Offer(layouts, index, decode_run_starts(packed_starts, num_slots), lanes, grant)


def _num_slots(layouts: list[list[int]], block_layout: np.ndarray) -> int:
    """Slots of the blocks, each ``len(layouts[block_layout[i]])``."""
    if len(layouts) == 1:  # one layout: the usual offer
        return len(layouts[0]) * len(block_layout)
    lens = np.array([len(x) for x in layouts], dtype=np.int64)
    return int(lens[block_layout].sum()) if len(block_layout) else 0


def _decode_grant(fields: list[Any], num_slots: int) -> Grant:
    """Lease id (u64), expiry (1 ms .. MAX_LEASE_EXPIRY_MS), one u64 address per slot."""
    lease_id, expiry_ms, packed = fields
    if not (isinstance(lease_id, int) and 0 <= lease_id < 1 << 64):
        raise ProtocolError(f"grant lease id {lease_id!r} is not a u64")
    if not (isinstance(expiry_ms, int) and 0 < expiry_ms <= MAX_LEASE_EXPIRY_MS):
        raise ProtocolError(f"grant expiry {expiry_ms!r} ms outside 1..{MAX_LEASE_EXPIRY_MS}")
    if not isinstance(packed, bytes) or len(packed) != 8 * num_slots:
        raise ProtocolError(f"grant addresses must be {num_slots} packed u64")
    return Grant(lease_id, expiry_ms / 1000, np.frombuffer(packed, dtype="<u8").astype(np.uint64))


def encode_card(card: bytes) -> bytes:
    return msgpack.packb([card], use_bin_type=True)


def decode_card(body: bytes) -> bytes:
    """The peer's encoded PeerCard, b"" when it serves no one-sided reads (the card's
    own fields are checked by kvstore.transfer.rma.PeerCard.decode)."""
    card = _unpack(body, MAX_CARD_FRAME_BYTES)
    if not (isinstance(card, list) and len(card) == 1 and isinstance(card[0], bytes)):
        raise ProtocolError("CARD is not [card]")
    return card[0]


def encode_card_request() -> bytes:
    return msgpack.packb([PROTOCOL_VERSION], use_bin_type=True)


def encode_release(lease_id: int) -> bytes:
    return msgpack.packb([lease_id], use_bin_type=True)


def decode_release(body: bytes) -> int:
    release = _unpack(body, MAX_RELEASE_BYTES)
    if not (isinstance(release, list) and len(release) == 1 and isinstance(release[0], int)):
        raise ProtocolError("RELEASE is not [lease id]")
    return release[0]


def encode_run_starts(starts: Sequence[int]) -> bytes:
    return np.asarray(starts, dtype="<u4").tobytes()


def decode_run_starts(packed: Any, num_slots: int) -> np.ndarray:
    """Packed u32 slot indices, strictly increasing, each within 1..num_slots-1."""
    if not isinstance(packed, bytes) or len(packed) % 4:
        raise ProtocolError("run starts must be packed u32")
    if not packed:  # one run (a grant's offer, as a rule)
        return np.zeros(0, dtype=np.int64)
    starts = np.frombuffer(packed, dtype="<u4").astype(np.int64)
    if len(starts) > max(num_slots - 1, 0):
        raise ProtocolError(f"{len(starts)} run starts for {num_slots} slots")
    if len(starts) and (
        starts[0] < 1 or starts[-1] >= num_slots or not bool(np.all(np.diff(starts) > 0))
    ):
        raise ProtocolError(f"run starts must be increasing slot indices within 1..{num_slots - 1}")
    return starts


def encode_go(accepted: int, run_starts: Sequence[int] = ()) -> bytes:
    return msgpack.packb([accepted, encode_run_starts(run_starts)], use_bin_type=True)


def decode_go(body: bytes, offered: int) -> Go:
    """The fetcher's answer to an offer of ``offered`` blocks."""
    go = _unpack(body, MAX_GO_BYTES)
    if not (
        isinstance(go, list)
        and len(go) == 2
        and isinstance(go[0], int)
        and isinstance(go[1], bytes)
    ):
        raise ProtocolError("GO is not [accepted, run_starts]")
    accepted, packed = go
    if accepted not in (0, offered):
        raise ProtocolError(f"GO for {accepted} blocks, {offered} were offered")
    return Go(accepted, packed)


class Challenge(NamedTuple):
    nonce: bytes  # the peer's
    mac: bytes  # the peer's proof over both nonces


def encode_hello(nonce: bytes) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, nonce], use_bin_type=True)


def decode_hello(body: bytes) -> bytes:
    """The fetcher's nonce."""
    hello = _unpack(body, MAX_HANDSHAKE_BYTES)
    if not (isinstance(hello, list) and len(hello) == 2 and hello[0] == PROTOCOL_VERSION):
        raise ProtocolError(f"HELLO is not [{PROTOCOL_VERSION}, nonce]")
    return _fixed_bytes(hello[1], NONCE_BYTES, "HELLO nonce")


def encode_challenge(nonce: bytes, mac: bytes) -> bytes:
    return msgpack.packb([nonce, mac], use_bin_type=True)


def decode_challenge(body: bytes) -> Challenge:
    challenge = _unpack(body, MAX_HANDSHAKE_BYTES)
    if not (isinstance(challenge, list) and len(challenge) == 2):
        raise ProtocolError("CHALLENGE is not [nonce, mac]")
    nonce, mac = challenge
    return Challenge(
        _fixed_bytes(nonce, NONCE_BYTES, "CHALLENGE nonce"),
        _fixed_bytes(mac, MAC_BYTES, "CHALLENGE mac"),
    )


def encode_proof(mac: bytes) -> bytes:
    return msgpack.packb([mac], use_bin_type=True)


def decode_proof(body: bytes) -> bytes:
    proof = _unpack(body, MAX_HANDSHAKE_BYTES)
    if not (isinstance(proof, list) and len(proof) == 1):
        raise ProtocolError("PROOF is not [mac]")
    return _fixed_bytes(proof[0], MAC_BYTES, "PROOF mac")


def _fixed_bytes(value: Any, size: int, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"{what} must be {size} bytes")
    return value


def _decode_layout(packed: Any) -> list[int]:
    if not isinstance(packed, bytes) or len(packed) % 8:
        raise ProtocolError("a layout must be packed u64 slot sizes")
    if not 0 < len(packed) // 8 <= MAX_SLOTS_PER_BLOCK:
        raise ProtocolError(f"{len(packed) // 8} slots per block, limit 1..{MAX_SLOTS_PER_BLOCK}")
    sizes = np.frombuffer(packed, dtype="<u8").tolist()
    if min(sizes) < 1 or max(sizes) > MAX_SLOT_BYTES:  # a block's few slots: no numpy call
        raise ProtocolError(f"slot size outside 1..{MAX_SLOT_BYTES}")
    return sizes


def encode_error(code: Code, message: str) -> bytes:
    return msgpack.packb([code.name, message[:1024]], use_bin_type=True)


def decode_error(body: bytes, peer: str) -> KVError:
    """A peer's refusal: our own bad request stays INVALID_ARGUMENT, the rest is UNAVAILABLE."""
    err = _unpack(body, MAX_ERROR_BYTES)
    if not (isinstance(err, list) and len(err) == 2 and all(isinstance(x, str) for x in err)):
        return PeerUnavailable(f"peer {peer} sent a malformed error")
    code, message = err
    if code == Code.INVALID_ARGUMENT.name:
        return KVError(Code.INVALID_ARGUMENT, f"peer {peer}: {message}")
    return PeerUnavailable(f"peer {peer} refused ({code}): {message}")


def check_namespace(namespace: Any, error: Callable[[str], Exception]) -> None:
    if not isinstance(namespace, str) or not 0 < len(namespace) <= MAX_FINAL_NAMESPACE_LEN:
        raise error(f"namespace must be a string of 1..{MAX_FINAL_NAMESPACE_LEN} characters")
