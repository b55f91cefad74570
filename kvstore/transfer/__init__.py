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

One-sided reads (protocol 5, :mod:`kvstore.transfer.onesided`): after the
handshake the fetcher asks once per peer for its card (CARD_REQUEST / CARD);
a REQUEST with the rma flag may be answered with a grant (lease id, expiry,
every slot's address) and no data: the fetcher reads every run with NIXL,
commits, and sends RELEASE. Two-sided is the fallback (docs/design.md §4).

Failure rules: every wait is bounded by the fetch deadline; on any failure the
endpoint is aborted (which cancels its UCX requests), the reservation is
aborted only once no request can still write into it, and the error surfaces
as :class:`PeerUnavailable` or :class:`PeerTimeout`. The serving side bounds
its own waits the same way and releases a lease only once no send can still
read from it, including when the fetcher dies mid-transfer.

Peer death: a peer killed at any point costs the fetch (or the served request)
it was part of, never the process. UCX's shared-memory transports are left off
by default (a peer dying while writing into one wedges the receiving worker);
should the local worker still stop receiving, consecutive connect timeouts
have it recreated (:func:`worker_recreations` counts it). See README.md.
"""

from kvstore.transfer.client import fetch
from kvstore.transfer.errors import PeerTimeout, PeerUnavailable, ProtocolError
from kvstore.transfer.server import PeerServer
from kvstore.transfer.slots import Lease, Reservation, SlotSink, SlotSource, SlotTable
from kvstore.transfer.ucx import close_endpoints, worker_recreations

__all__ = [
    "Lease",
    "PeerServer",
    "PeerTimeout",
    "PeerUnavailable",
    "ProtocolError",
    "Reservation",
    "SlotSink",
    "SlotSource",
    "SlotTable",
    "close_endpoints",
    "fetch",
    "worker_recreations",
]
