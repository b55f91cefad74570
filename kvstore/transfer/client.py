"""The fetching side: :func:`fetch` pulls a prefix from a peer into a SlotSink."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from kvstore.transfer.errors import PeerUnavailable, ProtocolError, RmaFailed
from kvstore.transfer.handshake import PeerSecret, authenticate_peer
from kvstore.transfer.onesided import PeerReads, RmaReader
from kvstore.transfer.slots import (
    AheadSink,
    Reservation,
    SlotSink,
    SlotTable,
    run_starts,
    segment_bounds,
    transfer_order,
)
from kvstore.transfer.ucx import (
    DATA_TAG_BASE,
    RECV_WINDOW,
    Conn,
    abort_and_settle,
    all_posted,
    endpoint_pool,
    frame_sends,
    post_frame,
    pump,
    recv_exact,
    recv_frame,
    run_ops,
    segment_views,
    send_frame,
    started,
    when_settled,
)
from kvstore.transfer.wire import (
    MAX_BLOCKS_PER_FETCH,
    Grant,
    Kind,
    Offer,
    check_namespace,
    decode_error,
    decode_offer,
    encode_go,
    encode_release,
    encode_request,
)
from kvstore.wire.errors import Code, KVError, invalid
from kvstore.wire.names import is_u64

log = logging.getLogger(__name__)


def _check_fetch_args(namespace: str, hashes: Sequence[int], timeout_s: float) -> list[int]:
    check_namespace(namespace, invalid)
    hashes = [int(h) for h in hashes]
    if len(hashes) > MAX_BLOCKS_PER_FETCH:
        raise invalid(f"{len(hashes)} hashes, limit {MAX_BLOCKS_PER_FETCH}")
    if not all(is_u64(h) for h in hashes):
        raise invalid("block hashes must be unsigned 64-bit")
    if len(set(hashes)) != len(hashes):
        raise invalid("block hashes must be distinct: a peer would serve each copy")
    if not timeout_s > 0:
        raise invalid("timeout_s must be positive")
    return hashes


async def fetch(
    peer_address: str,
    namespace: str,
    hashes: Sequence[int],
    sink: SlotSink,
    timeout_s: float = 10.0,
    secret: PeerSecret | None = None,
    rma: RmaReader | None = None,
    ahead: bool = False,
) -> int:
    """Pull the longest prefix of ``hashes`` the peer holds into slots of ``sink``.

    Returns how many blocks were fetched and committed (a prefix of ``hashes``,
    0 when the peer has none). Raises PeerUnavailable / PeerTimeout when the
    peer fails or is too slow; then, as on any failure, the reservation is
    aborted and nothing becomes visible. Errors raised by the sink propagate.

    With ``secret``, a new connection first runs the handshake: a peer that does
    not prove the cluster secret is refused (PeerUnauthenticated) before any
    request is sent, so no byte of it reaches the sink.

    With ``rma`` the fetch reads one-sided when the peer hands out a card and
    grants the read (else two-sided, as without it); a failed one-sided read
    raises RmaFailed (a PeerUnavailable) with the reservation aborted, or kept
    for good when a read might still land in it. The lease is RELEASEd after
    the read, whether it committed, failed or was cancelled (on an endpoint
    still usable: else the peer keeps it to its end); a RELEASE that cannot
    go out never fails the fetch, and gives up when the lease ends.

    With ``ahead`` (the caller knows the peer holds every block of ``hashes``:
    the router said so) an :class:`~kvstore.transfer.slots.AheadSink` reserves
    every block's slots while the peer prepares its answer, and frees those of
    blocks the peer does not offer after all; a peer that offers another layout
    is PeerUnavailable. Without it the sink reserves after the answer, for the
    offered blocks only: a reservation evicts, and a peer that holds nothing
    must cost the local cache nothing.
    """
    hashes = _check_fetch_args(namespace, hashes, timeout_s)
    if not hashes:
        return 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    pool = endpoint_pool()
    conn = await pool.acquire(peer_address, deadline)
    reusable = False
    try:
        if secret is not None and not conn.authenticated:
            await authenticate_peer(conn, secret, deadline)
        reads = await rma.peer(conn, deadline) if rma is not None else None
        ahead_sink = sink if ahead and _reserves_ahead(type(sink)) else None
        fetched = await _fetch_on(conn, namespace, hashes, sink, deadline, reads, ahead_sink)
        reusable = True
        return fetched
    except (RmaFailed, asyncio.CancelledError) as e:
        reusable = getattr(e, "released", False)  # the lease RELEASEd: the exchange is over
        raise
    finally:
        pool.release(conn, reusable)


@functools.cache
def _reserves_ahead(kind: type) -> bool:
    """Whether sinks of ``kind`` are AheadSinks (a Protocol check: slow, so once a type)."""
    return issubclass(kind, AheadSink)


async def _fetch_on(
    conn: Conn,
    namespace: str,
    hashes: list[int],
    sink: SlotSink,
    deadline: float,
    reads: PeerReads | None,
    ahead_sink: AheadSink | None,
) -> int:
    """One fetch on ``conn``: one-sided with ``reads``, reserving ahead into
    ``ahead_sink`` (both None: two-sided, reserving after the offer)."""
    body = encode_request(namespace, hashes, rma=reads is not None)
    asked = asyncio.get_running_loop().time()  # a granted lease runs from before this
    request = started(frame_sends(conn, Kind.REQUEST, body))
    ahead = await _reserve_ahead(conn, ahead_sink, namespace, hashes, request)
    try:
        kind, _, body = await _recv_reply(conn, deadline, request)
        if kind is Kind.ERROR:
            raise decode_error(body, conn.peer)
        offer = _decode_offer(conn, body, len(hashes), reads is not None)
    except BaseException:
        if ahead is not None:
            ahead.abort()  # nothing was asked to land in it yet
        raise
    if not offer.num_blocks:
        if ahead is not None:
            ahead.abort()
        return 0
    reservation = await _reservation(conn, sink, namespace, hashes, offer, ahead, deadline)
    if offer.grant is not None and reads is not None:
        await _read_one_sided(conn, reads, reservation, offer, deadline, asked)
        return offer.num_blocks
    try:
        table = reservation.slots
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


async def _reserve_ahead(
    conn: Conn,
    sink: AheadSink | None,
    namespace: str,
    hashes: list[int],
    request: list[Awaitable],
) -> Reservation | None:
    """With the REQUEST posted, reserve every asked block's slots while the peer
    leases and answers (None without an ahead sink: the sink reserves after the
    offer). The peer may offer fewer blocks: the rest are freed then. On
    failure the endpoint is aborted (the peer drops what it leased on the close)."""
    if sink is None:
        return None
    try:
        if not all_posted(request):  # thread mode: a task posts the REQUEST once it runs
            await asyncio.sleep(0)
        return sink.reserve_ahead(namespace, hashes)
    except BaseException:
        await abort_and_settle(conn, request)
        raise


async def _reservation(
    conn: Conn,
    sink: SlotSink,
    namespace: str,
    hashes: list[int],
    offer: Offer,
    ahead: Reservation | None,
    deadline: float,
) -> Reservation:
    """The slots the offered blocks land in, checked against the offer: the ahead
    reservation cut to the offer (another layout than the one reserved is the
    peer's fault), else one made now in the offer's layout. On failure the
    offer is declined."""
    try:
        if ahead is None:
            reservation = sink.reserve(namespace, hashes[: offer.num_blocks], offer.slot_sizes)
            if not _matches(reservation.slots, offer):
                reservation.abort()
                raise KVError(
                    Code.INTERNAL,
                    "sink reservation does not match the offer's blocks and slot sizes",
                )
            return reservation
        ahead.keep(offer.num_blocks)
        if not _matches(ahead.slots, offer):
            raise PeerUnavailable(
                f"peer {conn.peer}: offered slot sizes that do not match the layout of "
                f"namespace {namespace}"
            )
        return ahead
    except BaseException:
        if ahead is not None:
            ahead.abort()  # nothing was asked to land in it yet
        await _release_grant(conn, offer, deadline)
        raise


async def _read_one_sided(
    conn: Conn,
    reads: PeerReads,
    reservation: Reservation,
    offer: Offer,
    deadline: float,
    asked: float,
) -> None:
    """Read the granted slots into the reservation (``asked``: when the REQUEST
    went out, from when the grant's expiry counts), commit, RELEASE the lease.
    A read that failed (RmaFailed) or was cancelled commits nothing; its
    reservation is aborted, or kept for good if a read may still land in it,
    and its lease is RELEASEd too: the peer unpins at once, and the endpoint
    (nothing of this exchange left on it) serves the two-sided retry or the
    next fetch; the exception says so (``released``). On an endpoint no longer
    usable, or any other failure, the endpoint is aborted and the peer keeps
    the lease to its end."""
    assert offer.grant is not None
    try:
        await reads.read(reservation.slots, offer.grant, offer.lanes, deadline, asked)
    except BaseException as e:
        if isinstance(e, RmaFailed) and e.unsettled:
            log.error("one-sided read from %s unsettled: its slots stay reserved", conn.peer)
        else:
            reservation.abort()
        if isinstance(e, RmaFailed | asyncio.CancelledError) and conn.usable:
            _post_release(conn, offer.grant, asked)
            e.released = True  # read by fetch()
        else:
            conn.abort()
        raise
    reservation.commit()
    _post_release(conn, offer.grant, asked)


def _post_release(conn: Conn, grant: Grant, asked: float) -> None:
    """RELEASE, one-way: the fetch is done once it is posted (its outcome stands
    whatever becomes of the RELEASE). Frames on an endpoint arrive in order, so
    the peer sees it before the next REQUEST. It has until the lease ends
    (counted from ``asked``): the peer then unpins on its own and drops the
    connection, so a RELEASE not out by then is moot and its endpoint stuck. A
    send that fails or runs out aborts the endpoint (a fetch queued behind it
    on a dead peer fails now) and is logged once."""
    body = encode_release(grant.lease_id)
    send = post_frame(conn, Kind.RELEASE, body, asked + grant.expiry_s)
    if send is not None:
        send.add_done_callback(functools.partial(_log_unsent_release, conn.peer, grant))


def _log_unsent_release(peer: str, grant: Grant, send: asyncio.Task) -> None:
    error = "cancelled" if send.cancelled() else send.exception()
    if error is not None:
        log.warning(
            "RELEASE of one-sided lease %d to %s not sent (%s): the peer keeps its "
            "blocks pinned until the lease ends (%g s after the request)",
            grant.lease_id,
            peer,
            error,
            grant.expiry_s,
        )


async def _release_grant(conn: Conn, offer: Offer, deadline: float) -> None:
    """RELEASE after a one-sided read, else GO(0) to cancel an offer: the peer
    releases its lease and the endpoint stays reusable."""
    if offer.grant is None:
        kind, body = Kind.GO, encode_go(0)
    else:
        kind, body = Kind.RELEASE, encode_release(offer.grant.lease_id)
    try:
        await send_frame(conn, kind, deadline, body=body)
    except KVError:
        conn.abort()  # the caller reports its own outcome; the peer releases on close


def _matches(table: SlotTable, offer: Offer) -> bool:
    """Whether ``table`` holds exactly the offered blocks' slots, of the offered sizes."""
    if len(offer.layouts) == 1:  # the rule: every block in the namespace's one layout
        layout, n = offer.layouts[0], offer.num_blocks
        return (
            table.num_blocks == n
            and len(table.nbytes) == n * len(layout)
            and bool((table.counts == len(layout)).all())
            and bool((table.nbytes.reshape(n, len(layout)) == layout).all())
        )
    return np.array_equal(table.counts, offer.slot_counts) and np.array_equal(
        table.nbytes, offer.flat_sizes()
    )


async def _recv_reply(
    conn: Conn, deadline: float, request: list[Awaitable]
) -> tuple[Kind, int, bytes]:
    try:
        return await recv_frame(conn, [Kind.REPLY, Kind.ERROR], deadline, after=request)
    except ProtocolError as e:
        conn.abort()
        raise PeerUnavailable(f"peer {conn.peer}: bad reply: {e}") from None


def _decode_offer(conn: Conn, body: bytes, requested: int, rma: bool) -> Offer:
    try:
        return decode_offer(body, requested, rma)
    except ProtocolError as e:
        conn.abort()
        raise PeerUnavailable(f"peer {conn.peer}: bad offer: {e}") from None


async def _receive_segments(conn: Conn, views: list[Any], go_body: bytes, deadline: float) -> None:
    """Post receives (a window ahead), then say GO, then wait for every segment."""

    async def recv(i: int, view: Any) -> None:
        await recv_exact(conn.ep, view, DATA_TAG_BASE + i)

    receivers = [asyncio.ensure_future(c) for c in pump(recv, views, RECV_WINDOW)]
    try:
        await asyncio.sleep(0)  # let the first window of receives be posted
        go = frame_sends(conn, Kind.GO, go_body)
    except BaseException:
        await abort_and_settle(conn, receivers)
        raise
    await run_ops(conn, [*receivers, *go], deadline, "receiving slots")
