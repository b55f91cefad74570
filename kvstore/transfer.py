"""Peer transfer: pull sealed blocks' slot bytes from another store server over UCX.

A store server runs a :class:`PeerServer` next to its gRPC service; another
node that misses a prefix calls :func:`fetch` with the peer's address. The
bytes go straight from the peer's pool views into slots the fetching store
reserved (UCX tag messages, zero-copy rendezvous above 8 KiB; GPU to GPU where
UCX is CUDA-aware). This module knows nothing about the store: the serving
side sees a :class:`SlotSource`, the fetching side a :class:`SlotSink`.

Wire protocol (one fetch at a time per endpoint; endpoints are pooled)::

    fetcher                                      peer
    REQUEST [version, namespace, hashes u64le] ─▶  lease the longest sealed prefix
                          ◀─ REPLY [layouts, block_layout, lanes, peer run starts]
                                                   (or ERROR [code, msg])
    reserve local slots, post every receive
    GO [n, fetcher run starts]  (n = all offered, or 0 to cancel) ─▶
                          ◀─ slot bytes, one tag message per segment, windowed
    all receives done: commit                     all sends done: release lease

Every control frame is a fixed 16-byte preamble (magic, version, kind, arg)
then a msgpack body of ``arg`` bytes, sent as ONE message when both fit
INLINE_FRAME_BYTES (else as two). A frame sent and the answer awaited are one
wait, so a fetch costs two waits on each side before the data. Counts, sizes
and string lengths are bounded on both sides, msgpack is decoded with explicit
limits, nothing is unpickled. A UCX receive never writes past the view it was
posted with (a longer message fails as truncated), and every slot size the
peer announces must equal what the sink reserved.

Coalescing: slots travel in *transfer order*: with ``lanes`` L (chosen by the
peer, a divisor of every block's slot count), lane 0 of every block, then lane
1, ..., where lane r of a block is its slots r, r + L, r + 2L, ... (L = 1 is
the flattened (block, slot) order). A store allocates a tp_rank's slots of
many blocks consecutively and slot s belongs to rank s % tp_size, so lanes =
tp_size turns its memory order into transfer order; the peer picks the L that
gives it the fewest runs. Each side lists its *run starts*: the positions
``i > 0`` in transfer order where slot ``i`` does not begin where slot ``i - 1``
ends in its memory (or changes memory kind or CUDA allocation, or where a run
would pass MAX_SEGMENT_BYTES). The peer sends its
list in REPLY, the fetcher its own in GO (packed u32, strictly increasing,
within range: checked on receipt). Both split the accepted slots at the union
of the two lists; each resulting *segment* is contiguous on both sides and
travels as ONE tag message (tag = DATA_TAG_BASE + segment index), posted as a
view spanning its slots, whose length is the sum of their offered sizes. In a
store, a block's slots of one rank sit consecutively in one slab, so a fetch
collapses to a few large messages instead of one per slot.

Failure rules: every wait is bounded by the fetch deadline; on any failure the
endpoint is aborted (which cancels its UCX requests), the reservation is
aborted only once no request can still write into it, and the error surfaces
as :class:`PeerUnavailable` or :class:`PeerTimeout`. The serving side bounds
its own waits the same way and releases a lease only once no send can still
read from it, including when the fetcher dies mid-transfer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import struct
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import msgpack
import numpy as np

from kvstore import limits
from kvstore.errors import KVError

log = logging.getLogger(__name__)

# ---- bounds -----------------------------------------------------------------

PROTOCOL_VERSION = 3  # 2: run starts in REPLY and GO; 3: one message per control frame
MAX_NAMESPACE_LEN = limits.MAX_NAMESPACE_LEN + 1 + 16  # client namespace "." fingerprint
MAX_BLOCKS_PER_FETCH = limits.MAX_BLOCKS_PER_REQUEST
MAX_SLOTS_PER_BLOCK = limits.MAX_LAYERS * limits.MAX_TP_SIZE
MAX_SLOTS_PER_FETCH = 1 << 20  # a peer trims its prefix to stay under this
MAX_SLOT_BYTES = limits.MAX_BYTES_PER_BLOCK
MAX_REQUEST_BYTES = 128 << 10
MAX_REPLY_BYTES = 16 << 20
MAX_ERROR_BYTES = 8 << 10
MAX_GO_BYTES = 4 * MAX_SLOTS_PER_FETCH + 64
# A control frame whose preamble and body fit this many bytes travels as one
# message (nearly all do); a longer one as its preamble, then its body.
INLINE_FRAME_BYTES = 64 << 10
# A run of adjacent slots is cut at this many bytes (one UCX message at most).
MAX_SEGMENT_BYTES = 64 << 20
NO_CAP = 1 << 62  # run_starts without cuts at MAX_SEGMENT_BYTES
MAX_LANES = limits.MAX_TP_SIZE
MAX_HASH = (1 << 64) - 1

# Outstanding segment messages per fetch. Receives run ahead of sends so data
# lands in posted receives (the expected, zero-copy path) rather than UCX's
# unexpected-message queue.
SEND_WINDOW = 64
RECV_WINDOW = 256
# How long to wait, after aborting an endpoint, for its requests to settle.
ABORT_GRACE_S = 5.0

# Tags are hashed by ucxx with the endpoint's own tag; ints hash identically
# in every process, which is why tags are ints and never strings.
CONTROL_TAG = 1
DATA_TAG_BASE = 2

# Settings applied (unless already set) before this process first starts UCX.
# - MM_ERROR_HANDLING: endpoints with peer-failure handling (needed to notice a
#   dead peer) may otherwise not use the shared-memory transports, and
#   intra-node traffic falls back to tcp over loopback.
# - UCXPY_PROGRESS_MODE=blocking: the event loop progresses UCX when the
#   worker's fd is readable, instead of a progress thread handing completions
#   over. On a 2-core host this cut a small round trip from 0.56 to 0.09 ms and
#   a one-block fetch from 5.1 to 1.6 ms, and raised fetch throughput from
#   ~5 to ~7.5 GB/s; on the H200 host GPU fetches went from 82 to 98 GB/s
#   (bench/transfer.py). The cost: UCX's own copies (shared-memory
#   rendezvous) run on the loop's thread. Set it to "thread" to move them off.
# - UCXPY_ENABLE_PYTHON_FUTURE (only with a progress thread): a notifier
#   thread wakes the loop per batch of completions instead of every pending
#   request spinning on asyncio.sleep(0).
UCX_DEFAULTS = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


# ---- errors -----------------------------------------------------------------


class PeerUnavailable(KVError):
    """The peer refused, broke the connection, died, or spoke nonsense."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class PeerTimeout(KVError):
    """The peer did not finish within the fetch deadline."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, message)


class ProtocolError(Exception):
    """A frame that breaks the wire protocol (bad magic, kind, size or body)."""


# ---- the store's side of the contract -------------------------------------------


@dataclass(frozen=True)
class SlotTable:
    """Where slots lie, block after block: one row per slot, no Python object per slot.

    ``memory`` tells runs apart: 0 for host memory, else a key of the CUDA
    allocation the slot lies in (adjacent allocations are never merged into
    one message). ``owner`` keeps the memory alive while the table is in use.
    """

    ptr: np.ndarray  # uint64 address of each slot
    nbytes: np.ndarray  # int64 size of each slot
    memory: np.ndarray  # int64: 0 = host, else the CUDA allocation's key
    counts: np.ndarray  # int64 slots per block
    owner: Any = None

    def __post_init__(self) -> None:
        n = len(self.ptr)
        if not (len(self.nbytes) == len(self.memory) == n == int(self.counts.sum())):
            raise ValueError("slot table columns disagree")

    @property
    def num_blocks(self) -> int:
        return len(self.counts)

    def layouts(self) -> tuple[list[list[int]], np.ndarray]:
        """The distinct per-block slot-size lists and each block's index into them."""
        n = len(self.counts)
        if not n:
            return [], np.zeros(0, dtype=np.int64)
        k = int(self.counts[0])
        if bool(np.all(self.counts == k)):
            rows = self.nbytes.reshape(n, k)
            if bool(np.all(rows == rows[0])):
                return [rows[0].tolist()], np.zeros(n, dtype=np.int64)
            unique, index = np.unique(rows, axis=0, return_inverse=True)
            return unique.tolist(), index.reshape(-1).astype(np.int64)
        return distinct_layouts(b.tolist() for b in np.split(self.nbytes,
                                                             np.cumsum(self.counts)[:-1]))

    def prefix(self, num_blocks: int) -> SlotTable:
        """The table of the first ``num_blocks`` blocks."""
        end = int(self.counts[:num_blocks].sum())
        return SlotTable(self.ptr[:end], self.nbytes[:end], self.memory[:end],
                         self.counts[:num_blocks], self.owner)

    def take(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ptr, nbytes, memory) of the slots in ``order`` (flat slot indices)."""
        return self.ptr[order], self.nbytes[order], self.memory[order]

    @classmethod
    def from_views(cls, buffers: list[list[Any]]) -> SlotTable:
        """The table of per-block lists of contiguous 1-D views (numpy, torch, cupy or
        anything with an array interface): the general, slower way to build one."""
        refs = [slot_ref(v) for views in buffers for v in views]
        return cls(np.fromiter((r.ptr for r in refs), dtype=np.uint64, count=len(refs)),
                   np.fromiter((r.nbytes for r in refs), dtype=np.int64, count=len(refs)),
                   np.fromiter((_alloc_key(r) if r.cuda else 0 for r in refs), dtype=np.int64,
                               count=len(refs)),
                   np.asarray([len(v) for v in buffers], dtype=np.int64), owner=buffers)


class Lease(Protocol):
    """Pinned sealed blocks on the serving peer, valid until release()."""

    hashes: list[int]  # the leased prefix of the requested hashes
    slots: SlotTable  # their slots, block after block, read straight out of the pool

    def release(self) -> None: ...


class Reservation(Protocol):
    """Local slots allocated for incoming blocks, invisible until commit()."""

    slots: SlotTable  # writable, sized as asked

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class SlotSource(Protocol):
    """Implemented by the block store on the serving peer."""

    def lease(self, namespace: str, hashes: list[int]) -> Lease | None: ...


class SlotSink(Protocol):
    """Implemented by the block store on the fetching node."""

    def reserve(self, namespace: str, hashes: list[int],
                slot_sizes: list[list[int]]) -> Reservation: ...


# ---- framing ----------------------------------------------------------------

MAGIC = b"KVTP"
_PREAMBLE = struct.Struct("<4sBBHQ")  # magic, version, kind, reserved, arg


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3
    GO = 4


_BODY_LIMITS = {Kind.REQUEST: MAX_REQUEST_BYTES, Kind.REPLY: MAX_REPLY_BYTES,
                Kind.ERROR: MAX_ERROR_BYTES, Kind.GO: MAX_GO_BYTES}


def encode_preamble(kind: Kind, arg: int) -> bytes:
    return _PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, kind, 0, arg)


def encode_frame(kind: Kind, body: bytes) -> list[bytes]:
    """The messages of one control frame: preamble and body together when they fit
    INLINE_FRAME_BYTES, else the preamble alone and then the body."""
    pre = encode_preamble(kind, len(body))
    if len(pre) + len(body) <= INLINE_FRAME_BYTES:
        return [pre + body]
    return [pre, body]


def decode_preamble(raw: bytes, expect: Sequence[Kind]) -> tuple[Kind, int]:
    """Check a preamble and return (kind, arg); arg is the body length."""
    magic, version, kind, _reserved, arg = _PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if kind not in [int(k) for k in expect]:
        raise ProtocolError(f"frame kind {kind}, expected one of {[k.name for k in expect]}")
    kind = Kind(kind)
    limit = _BODY_LIMITS.get(kind)
    if limit is not None and not 0 < arg <= limit:
        raise ProtocolError(f"{kind.name} body of {arg} bytes, limit {limit}")
    return kind, arg


def _unpack(body: bytes, max_len: int) -> Any:
    """msgpack with every container and string bounded; no extension types."""
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_len, max_bin_len=max_len, max_array_len=MAX_BLOCKS_PER_FETCH,
            max_map_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack body: {e}") from None


def encode_request(namespace: str, hashes: Sequence[int]) -> bytes:
    packed = np.asarray(hashes, dtype="<u8").tobytes()
    return msgpack.packb([PROTOCOL_VERSION, namespace, packed], use_bin_type=True)


def decode_request(body: bytes) -> tuple[str, list[int]]:
    req = _unpack(body, MAX_REQUEST_BYTES)
    if not (isinstance(req, list) and len(req) == 3):
        raise ProtocolError("request is not [version, namespace, hashes]")
    version, namespace, packed = req
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"request version {version!r}")
    check_namespace(namespace, ProtocolError)
    if not isinstance(packed, bytes) or len(packed) % 8:
        raise ProtocolError("hashes must be packed little-endian u64")
    count = len(packed) // 8
    if not 0 < count <= MAX_BLOCKS_PER_FETCH:
        raise ProtocolError(f"{count} hashes, limit 1..{MAX_BLOCKS_PER_FETCH}")
    return namespace, np.frombuffer(packed, dtype="<u8").tolist()


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


def encode_offer(slot_sizes: list[list[int]], run_starts: Sequence[int] = (),
                 lanes: int = 1) -> bytes:
    """An offer of blocks given as per-block slot-size lists."""
    return encode_layouts(*distinct_layouts(slot_sizes), run_starts, lanes)


def distinct_layouts(blocks: Iterable[Sequence[int]]) -> tuple[list[list[int]], np.ndarray]:
    """Each distinct per-block slot-size list once, and each block's index into them."""
    seen: dict[tuple[int, ...], int] = {}
    index = [seen.setdefault(tuple(b), len(seen)) for b in blocks]
    return [list(x) for x in seen], np.asarray(index, dtype=np.int64)


def encode_layouts(layouts: Sequence[Sequence[int]], block_layout: Sequence[int] | np.ndarray,
                   run_starts: Sequence[int] = (), lanes: int = 1) -> bytes:
    """Each distinct layout once and an index per block, so a 64-slot x 8k-block
    reply stays small."""
    packed = [np.asarray(k, dtype="<u8").tobytes() for k in layouts]
    return msgpack.packb([packed, np.asarray(block_layout, dtype="<u4").tobytes(), lanes,
                          encode_run_starts(run_starts)], use_bin_type=True)


def decode_offer(body: bytes, requested: int) -> Offer:
    """Validate everything a (possibly malicious) peer says before acting on it."""
    reply = _unpack(body, MAX_REPLY_BYTES)
    if not (isinstance(reply, list) and len(reply) == 4):
        raise ProtocolError("reply is not [layouts, block_layout, lanes, run_starts]")
    packed_layouts, packed_index, lanes, packed_starts = reply
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
    offer = Offer(layouts, index, lanes=lanes)
    num_slots = int(offer.slot_counts.sum())
    if num_slots > MAX_SLOTS_PER_FETCH:
        raise ProtocolError(f"{num_slots} slots, limit {MAX_SLOTS_PER_FETCH}")
    if not (isinstance(lanes, int) and 1 <= lanes <= MAX_LANES
            and all(len(s) % lanes == 0 for s in layouts)):
        raise ProtocolError(f"lanes {lanes!r} must be 1..{MAX_LANES} and divide every "
                            "block's slot count")
    return Offer(layouts, index, decode_run_starts(packed_starts, num_slots), lanes)


def encode_run_starts(starts: Sequence[int]) -> bytes:
    return np.asarray(starts, dtype="<u4").tobytes()


def decode_run_starts(packed: Any, num_slots: int) -> np.ndarray:
    """Packed u32 slot indices, strictly increasing, each within 1..num_slots-1."""
    if not isinstance(packed, bytes) or len(packed) % 4:
        raise ProtocolError("run starts must be packed u32")
    starts = np.frombuffer(packed, dtype="<u4").astype(np.int64)
    if len(starts) > max(num_slots - 1, 0):
        raise ProtocolError(f"{len(starts)} run starts for {num_slots} slots")
    if len(starts) and (starts[0] < 1 or starts[-1] >= num_slots
                        or not bool(np.all(np.diff(starts) > 0))):
        raise ProtocolError("run starts must be increasing slot indices within 1.."
                            f"{num_slots - 1}")
    return starts


def encode_go(accepted: int, run_starts: Sequence[int] = ()) -> bytes:
    return msgpack.packb([accepted, encode_run_starts(run_starts)], use_bin_type=True)


def decode_go(body: bytes, offered: int) -> tuple[int, bytes]:
    """(accepted block count, the fetcher's packed run starts, not yet checked)."""
    go = _unpack(body, MAX_GO_BYTES)
    if not (isinstance(go, list) and len(go) == 2 and isinstance(go[0], int)
            and isinstance(go[1], bytes)):
        raise ProtocolError("GO is not [accepted, run_starts]")
    accepted, packed = go
    if accepted not in (0, offered):
        raise ProtocolError(f"GO for {accepted} blocks, {offered} were offered")
    return accepted, packed


def _decode_layout(packed: Any) -> list[int]:
    if not isinstance(packed, bytes) or len(packed) % 8:
        raise ProtocolError("a layout must be packed u64 slot sizes")
    sizes = np.frombuffer(packed, dtype="<u8")
    if not 0 < len(sizes) <= MAX_SLOTS_PER_BLOCK:
        raise ProtocolError(f"{len(sizes)} slots per block, limit 1..{MAX_SLOTS_PER_BLOCK}")
    if int(sizes.min()) < 1 or int(sizes.max()) > MAX_SLOT_BYTES:
        raise ProtocolError(f"slot size outside 1..{MAX_SLOT_BYTES}")
    return sizes.tolist()


def encode_error(code: grpc.StatusCode, message: str) -> bytes:
    return msgpack.packb([code.name, message[:1024]], use_bin_type=True)


def decode_error(body: bytes, peer: str) -> KVError:
    """A peer's refusal: our own bad request stays INVALID_ARGUMENT, the rest is UNAVAILABLE."""
    err = _unpack(body, MAX_ERROR_BYTES)
    if not (isinstance(err, list) and len(err) == 2 and all(isinstance(x, str) for x in err)):
        return PeerUnavailable(f"peer {peer} sent a malformed error")
    code, message = err
    if code == grpc.StatusCode.INVALID_ARGUMENT.name:
        return KVError(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}: {message}")
    return PeerUnavailable(f"peer {peer} refused ({code}): {message}")


def check_namespace(namespace: Any, error: Callable[[str], Exception]) -> None:
    if not isinstance(namespace, str) or not 0 < len(namespace) <= MAX_NAMESPACE_LEN:
        raise error(f"namespace must be a string of 1..{MAX_NAMESPACE_LEN} characters")


# ---- buffers ----------------------------------------------------------------


class SlotRef:
    """Where one slot view lies (``obj`` keeps it alive)."""

    __slots__ = ("obj", "ptr", "nbytes", "cuda")

    def __init__(self, obj: Any, ptr: int, nbytes: int, cuda: bool):
        self.obj, self.ptr, self.nbytes, self.cuda = obj, ptr, nbytes, cuda


def slot_ref(buf: Any) -> SlotRef:
    """Address and size of a contiguous slot view (numpy, torch CPU/CUDA, cupy)."""
    if type(buf) is np.ndarray:
        if not buf.flags.c_contiguous:
            raise ValueError("slot views must be contiguous")
        return SlotRef(buf, buf.__array_interface__["data"][0], buf.nbytes, False)
    if type(buf).__module__.startswith("torch") and buf.device.type in ("cpu", "cuda"):
        if not buf.is_contiguous():
            raise ValueError("slot views must be contiguous")
        return SlotRef(buf, buf.data_ptr(), buf.numel() * buf.element_size(), buf.is_cuda)
    from ucxx._lib.arr import Array

    arr = Array(buf)
    if not arr.c_contiguous:
        raise ValueError("slot views must be contiguous")
    return SlotRef(buf, arr.ptr, arr.nbytes, arr.cuda)


def _alloc_key(ref: SlotRef) -> int:
    """Which allocation a CUDA view lies in (adjacent allocations must not be merged),
    or a unique negative number when that cannot be told."""
    obj = ref.obj
    try:
        if type(obj).__module__.startswith("torch"):
            return int(obj.untyped_storage().data_ptr()) or -1 - id(ref)
        mem = getattr(getattr(obj, "data", None), "mem", None)  # cupy
        if mem is not None and getattr(mem, "ptr", 0):
            return int(mem.ptr)
    except Exception:
        log.debug("cannot tell the allocation of a CUDA view", exc_info=True)
    return -1 - id(ref)


def run_starts(ptr: np.ndarray, size: np.ndarray, memory: np.ndarray,
               cap: int | None = None) -> np.ndarray:
    """Indices ``i > 0`` where slot ``i`` does not continue slot ``i - 1`` in memory.

    A run also breaks between host and CUDA memory, between CUDA allocations,
    and before it would pass ``cap`` bytes (MAX_SEGMENT_BYTES).
    """
    n = len(ptr)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    cap = MAX_SEGMENT_BYTES if cap is None else cap
    size = size.astype(np.uint64, copy=False)
    breaks = (ptr[1:] != ptr[:-1] + size[:-1]) | (memory[1:] != memory[:-1])
    starts = (np.nonzero(breaks)[0] + 1).astype(np.int64)
    # Cut runs longer than cap greedily: one binary search per cut, not a walk
    # over the run's slots (a 256 MiB run of 16 KiB slots has 16384 of them).
    edges = np.concatenate(([0], starts, [n]))
    csum = np.concatenate(([0], np.cumsum(size, dtype=np.uint64))).astype(np.int64)
    long_runs = np.nonzero(csum[edges[1:]] - csum[edges[:-1]] > cap)[0]
    if not len(long_runs):
        return starts
    extra = []
    for r in long_runs.tolist():
        first, end = int(edges[r]), int(edges[r + 1])
        while True:  # slots first .. cut-1 are the most that fit in cap (at least one)
            cut = max(first + 1, int(np.searchsorted(csum, csum[first] + cap, "right")) - 1)
            if cut >= end:
                break
            extra.append(cut)
            first = cut
    return np.union1d(starts, np.asarray(extra, dtype=np.int64))


def transfer_order(slot_counts: Sequence[int], lanes: int) -> np.ndarray:
    """Flat (block, slot) indices in transfer order: lane-major, then block, then slot."""
    counts = np.asarray(slot_counts, dtype=np.int64)
    n = int(counts.sum())
    if lanes == 1 or n == 0:
        return np.arange(n, dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    if bool(np.all(counts == counts[0])):  # one layout: a reshape does it
        k = int(counts[0])
        grid = first[:, None] + np.arange(k, dtype=np.int64)[None, :]
        return grid.reshape(len(counts), k // lanes, lanes).transpose(2, 0, 1).ravel()
    return np.concatenate([f + np.arange(r, c, lanes, dtype=np.int64)
                           for r in range(lanes)
                           for f, c in zip(first.tolist(), counts.tolist(), strict=True)])


def choose_lanes(table: SlotTable) -> int:
    """The lane count (a power of two dividing every block's slot count) whose
    transfer order leaves the fewest runs in this side's memory. Cuts at the
    segment cap do not count: every order has those."""
    best, fewest = 1, None
    lanes = 1
    counts = table.counts
    while lanes <= MAX_LANES and bool(np.all(counts % lanes == 0)):
        order = transfer_order(counts.tolist(), lanes)
        runs = len(run_starts(*table.take(order), cap=NO_CAP))
        if fewest is None or runs < fewest:
            best, fewest = lanes, runs
        if runs == 0:
            break
        lanes *= 2
    return best


def segment_bounds(num_slots: int, *lists: np.ndarray) -> list[tuple[int, int]]:
    """[first, end) slot ranges split at the union of the run-start lists."""
    cuts = np.zeros(0, dtype=np.int64)
    for starts in lists:
        cuts = np.union1d(cuts, starts[starts < num_slots])
    edges = [0, *cuts.tolist(), num_slots]
    return list(zip(edges[:-1], edges[1:]))


class _Span:
    """A byte range exposed through the array interface UCX reads (host or CUDA);
    ``owner`` keeps the memory it lies in alive."""

    def __init__(self, ptr: int, nbytes: int, cuda: bool, readonly: bool, owner: Any):
        face = {"data": (ptr, readonly), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        if cuda:  # no "stream": the slots' writers finished before they were offered
            self.__cuda_array_interface__ = face
        else:
            self.__array_interface__ = face
        self.owner = owner


def segment_views(ptr: np.ndarray, size: np.ndarray, memory: np.ndarray,
                  bounds: list[tuple[int, int]], writable: bool, owner: Any) -> list[Any]:
    """One UCX-wrapped view per segment [a, b) of slots that lie back to back."""
    from ucxx._lib.arr import Array

    csum = np.concatenate(([0], np.cumsum(size, dtype=np.int64))).tolist()
    starts, cuda = ptr.tolist(), (memory != 0).tolist()
    views = []
    for a, b in bounds:
        nbytes = csum[b] - csum[a]
        span = _Span(starts[a], nbytes, cuda[a], not writable, owner)
        arr = Array(span if cuda[a] else np.asarray(span))  # host: UCX reads the buffer protocol
        if arr.ptr != starts[a] or arr.nbytes != nbytes:
            raise ValueError("segment view does not cover its slots")
        views.append(arr)
    return views


def _ucxx() -> Any:
    """Import ucxx late, after our UCX defaults are in the environment."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    threaded = os.environ["UCXPY_PROGRESS_MODE"].startswith("thread")
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1" if threaded else "0")
    import ucxx

    return ucxx


def _is_ucx_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError)


@dataclass(eq=False)
class Conn:
    """One UCX endpoint and whether it may still carry another fetch."""

    ep: Any
    peer: str
    broken: bool = False
    # Requests that were still in flight when we gave up on them.
    unsettled: list[asyncio.Task] = field(default_factory=list)

    def abort(self) -> None:
        """Close abruptly: UCX cancels every request still posted on the endpoint."""
        if not self.broken:
            self.broken = True
            try:
                self.ep.abort()
            except Exception:  # already closed by the peer's failure
                log.debug("abort of endpoint to %s failed", self.peer, exc_info=True)

    @property
    def usable(self) -> bool:
        return not self.broken and not self.ep.closed


async def run_ops(conn: Conn, ops: list[Awaitable], deadline: float | None, what: str) -> list:
    """Await UCX operations without ever abandoning one that may still touch memory.

    Cancelling a ucxx coroutine does not cancel its UCX request, which could then
    write into a buffer we freed. So operations run as tasks that are never
    cancelled: on failure, timeout or outer cancellation the endpoint is aborted
    (UCX then cancels its requests) and we wait for them to settle. Tasks that
    do not settle within the grace period are left in ``conn.unsettled``.
    """
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(op) for op in ops]
    if not tasks:
        return []
    timeout = None if deadline is None else max(0.0, deadline - loop.time())
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout,
                                           return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled from outside
        await _abort_and_settle(conn, tasks)
        raise
    failed = [t for t in done if t.exception() is not None]
    if not failed and not pending:
        return [t.result() for t in tasks]
    await _abort_and_settle(conn, tasks)
    if failed:
        raise _peer_error(failed[0].exception(), conn.peer, what)
    raise PeerTimeout(f"peer {conn.peer}: {what} did not finish within the deadline")


async def _abort_and_settle(conn: Conn, tasks: list[asyncio.Task]) -> None:
    conn.abort()
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=ABORT_GRACE_S)
        if still:
            log.error("%d UCX requests to %s did not settle after abort", len(still), conn.peer)
            conn.unsettled.extend(still)
    for t in tasks:  # mark exceptions as retrieved: the first one is reported
        if t.done() and not t.cancelled():
            t.exception()


def _peer_error(exc: BaseException, peer: str, what: str) -> Exception:
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, ProtocolError):
        return PeerUnavailable(f"peer {peer}: protocol error during {what}: {exc}")
    if _is_ucx_error(exc):
        return PeerUnavailable(f"peer {peer}: {what} failed: {type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


def when_settled(conn: Conn, fn: Callable[[], None]) -> None:
    """Run ``fn`` (free slots, drop a lease) once no request of ``conn`` can touch them."""
    pending = [t for t in conn.unsettled if not t.done()]
    if not pending:
        fn()
        return
    remaining = len(pending)

    def one_done(_task: asyncio.Task) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            fn()

    for t in pending:
        t.add_done_callback(one_done)


def frame_sends(conn: Conn, kind: Kind, body: bytes) -> list[Awaitable]:
    """Send operations of one frame, to be awaited together with what comes next."""
    return [conn.ep.send(np.frombuffer(m, dtype=np.uint8), tag=CONTROL_TAG)
            for m in encode_frame(kind, body)]


async def send_frame(conn: Conn, kind: Kind, deadline: float | None, *, body: bytes) -> None:
    await run_ops(conn, frame_sends(conn, kind, body), deadline, f"sending {kind.name}")


async def recv_frame(conn: Conn, expect: Sequence[Kind], deadline: float | None,
                     after: Sequence[Awaitable] = ()) -> tuple[Kind, int, bytes]:
    """Receive one frame (awaiting the operations ``after`` alongside: a frame just
    sent, so that a request and its answer cost one wake-up, not two). The first
    message lands in an INLINE_FRAME_BYTES buffer; a longer body, announced by the
    (bounded) preamble, in a buffer of exactly its size."""
    first = np.zeros(INLINE_FRAME_BYTES, dtype=np.uint8)
    await run_ops(conn, [*after, conn.ep.recv(first, tag=CONTROL_TAG)], deadline,
                  "waiting for a frame")
    kind, arg = decode_preamble(first[:_PREAMBLE.size].tobytes(), expect)
    end = _PREAMBLE.size + arg
    if end <= INLINE_FRAME_BYTES:
        return kind, arg, first[_PREAMBLE.size:end].tobytes()
    body = np.empty(arg, dtype=np.uint8)
    await run_ops(conn, [conn.ep.recv(body, tag=CONTROL_TAG)], deadline, f"receiving {kind.name}")
    return kind, arg, body.tobytes()


def pump(op: Callable[[int, Any], Awaitable[Any]], views: list[Any], window: int) -> list[Coroutine]:
    """At most ``window`` operations in flight, issued in slot order."""
    items = iter(enumerate(views))

    async def worker() -> None:
        for i, view in items:
            await op(i, view)

    return [worker() for _ in range(min(window, len(views)))]


# ---- serving side -------------------------------------------------------------


class PeerServer:
    """UCX listener on a store server that serves fetch requests from a SlotSource.

    One connection serves its fetches one after another; a fetcher that wants
    parallelism opens more endpoints. ``timeout_s`` bounds how long a lease may
    wait on a fetcher (for GO, then for all slot sends).
    """

    def __init__(self, source: SlotSource, host: str = "127.0.0.1", port: int = 0, *,
                 timeout_s: float = 30.0, send_window: int = SEND_WINDOW):
        self.source = source
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.send_window = send_window
        self._listener: Any = None
        self._conns: set[Conn] = set()
        self._handlers: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        """``host:port`` to advertise to the router."""
        if self._listener is None:
            raise RuntimeError("PeerServer is not started")
        return f"{self.host}:{self._listener.port}"

    async def start(self) -> None:
        ucxx = _ucxx()
        self._listener = ucxx.create_listener(self._on_connect, port=self.port)
        self.port = self._listener.port

    async def stop(self) -> None:
        """Stop listening, cut every connection, and wait for leases to be released."""
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns):
            conn.abort()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=ABORT_GRACE_S)
        self._listener = None

    async def _on_connect(self, ep: Any) -> None:
        conn = Conn(ep, peer="fetcher")
        task = asyncio.current_task()
        self._conns.add(conn)
        if task is not None:
            self._handlers.add(task)
        try:
            while conn.usable:
                _, _, body = await recv_frame(conn, [Kind.REQUEST], deadline=None)
                await self._serve(conn, body)
        except (KVError, ProtocolError) as e:
            log.debug("connection from a fetcher ended: %s", e)
        except Exception:
            log.exception("peer transfer connection failed")
        finally:
            conn.abort()
            self._conns.discard(conn)
            if task is not None:
                self._handlers.discard(task)

    async def _serve(self, conn: Conn, body: bytes) -> None:
        """One fetch: refuse, or lease, offer, await GO, send, release."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            namespace, hashes = decode_request(body)
        except ProtocolError as e:
            await self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, str(e), deadline)
            return
        try:
            lease = self.source.lease(namespace, hashes)
        except KVError as e:
            await self._refuse(conn, e.code, e.message, deadline)
            return
        except Exception as e:
            log.exception("SlotSource.lease failed")
            await self._refuse(conn, grpc.StatusCode.INTERNAL, f"lease failed: {e}", deadline)
            return
        if lease is None:
            await send_frame(conn, Kind.REPLY, deadline, body=encode_offer([]))
            return
        try:
            await self._send_lease(conn, lease, hashes, deadline)
        finally:
            when_settled(conn, lease.release)

    async def _send_lease(self, conn: Conn, lease: Lease, hashes: list[int],
                          deadline: float) -> None:
        try:
            table = _offerable(lease, hashes)
        except (KVError, ValueError) as e:
            log.error("SlotSource returned a bad lease: %s", e)
            await self._refuse(conn, grpc.StatusCode.INTERNAL, f"bad lease: {e}", deadline)
            return
        layouts, block_layout = table.layouts()
        lanes = choose_lanes(table)
        order = transfer_order(table.counts.tolist(), lanes)
        ptr, size, memory = table.take(order)
        mine = run_starts(ptr, size, memory)
        offer = encode_layouts(layouts, block_layout, mine, lanes)
        if not table.num_blocks:
            await send_frame(conn, Kind.REPLY, deadline, body=offer)
            return
        _, _, body = await recv_frame(conn, [Kind.GO], deadline,
                                      after=frame_sends(conn, Kind.REPLY, offer))
        accepted, packed = decode_go(body, table.num_blocks)
        if accepted:  # GO accepts all that was offered, or nothing
            theirs = decode_run_starts(packed, len(order))
            bounds = segment_bounds(len(order), mine, theirs)
            views = segment_views(ptr, size, memory, bounds, writable=False, owner=table.owner)
            await self._send_slots(conn, views, deadline)

    async def _send_slots(self, conn: Conn, views: list[Any], deadline: float,
                          first: int = 0) -> None:
        """Send segments ``first``, ``first + 1``, ... each on its own tag.

        A method of its own so that tests can make a peer fail half-way.
        """
        async def send(i: int, view: Any) -> None:
            await conn.ep.send(view, tag=DATA_TAG_BASE + first + i)

        await run_ops(conn, pump(send, views, self.send_window), deadline, "sending slots")

    async def _refuse(self, conn: Conn, code: grpc.StatusCode, message: str,
                      deadline: float) -> None:
        await send_frame(conn, Kind.ERROR, deadline, body=encode_error(code, message))


def _offerable(lease: Lease, hashes: list[int]) -> SlotTable:
    """The leased prefix's slots, trimmed to the per-fetch bounds."""
    table, n = lease.slots, len(lease.hashes)
    if n > len(hashes) or list(lease.hashes) != hashes[:n] or table.num_blocks != n:
        raise ValueError("lease is not a prefix of the request")
    counts = table.counts
    fits = (counts > 0) & (counts <= MAX_SLOTS_PER_BLOCK) & (np.cumsum(counts) <= MAX_SLOTS_PER_FETCH)
    keep = n if bool(fits.all()) else int(np.argmin(fits))
    table = table.prefix(keep)
    if len(table.nbytes) and not (int(table.nbytes.min()) > 0
                                  and int(table.nbytes.max()) <= MAX_SLOT_BYTES):
        raise ValueError("slot size out of bounds")
    return table


# ---- fetching side ------------------------------------------------------------


class EndpointPool:
    """Idle endpoints per peer address: creating one costs a connection handshake."""

    def __init__(self, max_idle_per_peer: int = 4):
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[str, list[Conn]] = {}

    async def acquire(self, address: str, deadline: float) -> Conn:
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.abort()
        return await connect(address, deadline)

    def release(self, conn: Conn, reusable: bool) -> None:
        idle = self._idle.setdefault(conn.peer, [])
        if reusable and conn.usable and len(idle) < self.max_idle_per_peer:
            idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EndpointPool] = (
    weakref.WeakKeyDictionary())


def endpoint_pool() -> EndpointPool:
    """The running event loop's pool (ucxx endpoints belong to one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = EndpointPool()
    return _POOLS[loop]


async def close_endpoints() -> None:
    """Drop every pooled endpoint of the running loop (shutdown, tests)."""
    endpoint_pool().close()


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KVError(grpc.StatusCode.INVALID_ARGUMENT, f"bad peer address {address!r}")
    return host.strip("[]"), int(port)


async def connect(address: str, deadline: float) -> Conn:
    host, port = parse_address(address)
    ucxx = _ucxx()
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise PeerTimeout(f"peer {address}: no time left to connect")
    try:
        ep = await asyncio.wait_for(
            ucxx.create_endpoint(host, port, connect_timeout=remaining), remaining)
    except (asyncio.TimeoutError, TimeoutError):
        raise PeerTimeout(f"peer {address}: connect did not finish in {remaining:.1f}s") from None
    except Exception as e:
        if _is_ucx_error(e) or isinstance(e, OSError | RuntimeError):
            raise PeerUnavailable(f"peer {address}: connect failed: {e}") from None
        raise
    return Conn(ep, peer=address)


def _check_fetch_args(namespace: str, hashes: Sequence[int], timeout_s: float) -> list[int]:
    def invalid(msg: str) -> KVError:
        return KVError(grpc.StatusCode.INVALID_ARGUMENT, msg)

    check_namespace(namespace, invalid)
    hashes = [int(h) for h in hashes]
    if len(hashes) > MAX_BLOCKS_PER_FETCH:
        raise invalid(f"{len(hashes)} hashes, limit {MAX_BLOCKS_PER_FETCH}")
    if any(not 0 <= h <= MAX_HASH for h in hashes):
        raise invalid("block hashes must be unsigned 64-bit")
    if not timeout_s > 0:
        raise invalid("timeout_s must be positive")
    return hashes


async def fetch(peer_address: str, namespace: str, hashes: Sequence[int], sink: SlotSink,
                timeout_s: float = 10.0) -> int:
    """Pull the longest prefix of ``hashes`` the peer holds into slots of ``sink``.

    Returns how many blocks were fetched and committed (a prefix of ``hashes``,
    0 when the peer has none). Raises PeerUnavailable / PeerTimeout when the
    peer fails or is too slow; then, as on any failure, the reservation is
    aborted and nothing becomes visible. Errors raised by the sink propagate.
    """
    hashes = _check_fetch_args(namespace, hashes, timeout_s)
    if not hashes:
        return 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    pool = endpoint_pool()
    conn = await pool.acquire(peer_address, deadline)
    reusable = False
    try:
        fetched = await _fetch_on(conn, namespace, hashes, sink, deadline)
        reusable = True
        return fetched
    finally:
        pool.release(conn, reusable)


async def _fetch_on(conn: Conn, namespace: str, hashes: list[int], sink: SlotSink,
                    deadline: float) -> int:
    request = frame_sends(conn, Kind.REQUEST, encode_request(namespace, hashes))
    kind, _, body = await _recv_reply(conn, deadline, request)
    if kind is Kind.ERROR:
        raise decode_error(body, conn.peer)
    offer = _decode_offer(conn, body, len(hashes))
    if not offer.num_blocks:
        return 0
    try:
        reservation = sink.reserve(namespace, hashes[:offer.num_blocks], offer.slot_sizes)
    except BaseException:
        await _cancel_offer(conn, deadline)
        raise
    try:
        table = _reserved_table(reservation, offer)
        order = transfer_order(table.counts.tolist(), offer.lanes)
        ptr, size, memory = table.take(order)
        mine = run_starts(ptr, size, memory)
        bounds = segment_bounds(len(order), offer.run_starts, mine)
        segments = segment_views(ptr, size, memory, bounds, writable=True, owner=table.owner)
        await _receive_segments(conn, segments, encode_go(offer.num_blocks, mine), deadline)
    except BaseException:
        conn.abort()  # a half-finished exchange: this endpoint cannot be reused
        when_settled(conn, reservation.abort)
        raise
    reservation.commit()
    return offer.num_blocks


async def _cancel_offer(conn: Conn, deadline: float) -> None:
    """GO(0): the peer releases its lease and the endpoint stays reusable."""
    try:
        await send_frame(conn, Kind.GO, deadline, body=encode_go(0))
    except KVError:
        conn.abort()  # the caller reports the sink's error, not this one


def _reserved_table(reservation: Reservation, offer: Offer) -> SlotTable:
    """The sink's slots, checked against the offer: same blocks, same slot sizes."""
    table = reservation.slots
    if (not np.array_equal(table.counts, offer.slot_counts)
            or not np.array_equal(table.nbytes, offer.flat_sizes())):
        raise KVError(grpc.StatusCode.INTERNAL,
                      "sink reservation does not match the offer's blocks and slot sizes")
    return table


async def _recv_reply(conn: Conn, deadline: float,
                      request: list[Awaitable]) -> tuple[Kind, int, bytes]:
    try:
        return await recv_frame(conn, [Kind.REPLY, Kind.ERROR], deadline, after=request)
    except ProtocolError as e:
        conn.abort()
        raise PeerUnavailable(f"peer {conn.peer}: bad reply: {e}") from None


def _decode_offer(conn: Conn, body: bytes, requested: int) -> Offer:
    try:
        return decode_offer(body, requested)
    except ProtocolError as e:
        conn.abort()
        raise PeerUnavailable(f"peer {conn.peer}: bad offer: {e}") from None


async def _receive_segments(conn: Conn, views: list[Any], go_body: bytes,
                            deadline: float) -> None:
    """Post receives (a window ahead), then say GO, then wait for every segment."""
    async def recv(i: int, view: Any) -> None:
        await conn.ep.recv(view, tag=DATA_TAG_BASE + i)

    receivers = [asyncio.ensure_future(c) for c in pump(recv, views, RECV_WINDOW)]
    try:
        await asyncio.sleep(0)  # let the first window of receives be posted
    except BaseException:
        await _abort_and_settle(conn, receivers)
        raise
    await run_ops(conn, [*receivers, *frame_sends(conn, Kind.GO, go_body)],
                  deadline, "receiving slots")
