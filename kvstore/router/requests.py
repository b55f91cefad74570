"""What a request to the router may carry: bounds and formats, checked up front.

Every public :class:`~kvstore.router.core.Router` method runs these before it
takes its lock, so a refused request (INVALID_ARGUMENT naming the field) has
changed nothing. The bounds are the ones in ``kvstore.wire.limits``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.router.load import LoadReport
from kvstore.wire import limits
from kvstore.wire.errors import invalid
from kvstore.wire.events import MalformedEvent, StoreEvent
from kvstore.wire.names import (
    U64_MAX,
    check_final_namespace,
    check_name,
    check_token,
    is_client_namespace,
)


def check_route(
    model: str,
    token_ids: Sequence[int] | None,
    hashes: Sequence[int] | None,
    request_id: str,
    decode_tokens: int,
    namespace: str = "",
    role: str = "",
) -> list[int]:
    """Validate a route request; return its block hashes (empty when tokens are given).
    ``namespace`` and ``role`` narrow the WorkerSets ("" for any): a card's
    client namespace and worker type, so they follow the card's rules."""
    check_name("model", model)
    if namespace and not is_client_namespace(namespace):
        raise invalid(f"namespace: {namespace[:64]!r} is not a client namespace, as cards name")
    if role:
        check_token("role", role)
    if token_ids and hashes:
        raise invalid("token_ids and block_hashes: give one of them, not both")
    if token_ids is not None and len(token_ids) > limits.MAX_TOKEN_IDS:
        raise invalid(f"token_ids: {len(token_ids)} tokens, at most {limits.MAX_TOKEN_IDS}")
    checked = check_hashes("block_hashes", hashes) if hashes else []
    check_request_id(request_id)
    if not 0 <= decode_tokens <= limits.MAX_DECODE_TOKENS:
        raise invalid(f"decode_tokens: {decode_tokens} not in [0, {limits.MAX_DECODE_TOKENS}]")
    return checked


def check_token_blocks(tokens: int, block_size: int) -> None:
    """Prompt tokens that hash to at most MAX_BLOCK_HASHES blocks of ``block_size``
    (the cap block_hashes has: 2^20 tokens of a 1-token block were a million
    hashes, seconds of the router's loop)."""
    if tokens // max(block_size, 1) > limits.MAX_BLOCK_HASHES:
        raise invalid(
            f"token_ids: {tokens} tokens make {tokens // max(block_size, 1)} blocks of "
            f"{block_size}, at most {limits.MAX_BLOCK_HASHES}"
        )


def check_request_id(request_id: str) -> None:
    if len(request_id) > limits.MAX_REQUEST_ID_LEN:
        raise invalid(f"request_id: longer than {limits.MAX_REQUEST_ID_LEN}")


def check_cached_blocks(cached_blocks: int | None) -> None:
    if cached_blocks is not None:
        _check_int("cached_blocks", cached_blocks, limits.MAX_BLOCK_HASHES)


# (LoadReport field, largest value): every count is an int in [0, largest].
_LOAD_COUNTS = (
    ("queued_prefill_tokens", limits.MAX_QUEUED_PREFILL_TOKENS),
    ("running_requests", limits.MAX_RUNNING_REQUESTS),
)


def check_load_report(worker: str, report: LoadReport) -> None:
    """A worker name and a report whose counts are bounded and whose KV usage
    is a fraction."""
    check_name("worker", worker)
    for name, largest in _LOAD_COUNTS:
        _check_int(name, getattr(report, name), largest)
    usage = report.kv_usage
    if isinstance(usage, bool) or not isinstance(usage, int | float) or not math.isfinite(usage):
        raise invalid(f"kv_usage: {usage!r} is not a number")
    if not 0.0 <= usage <= 1.0:
        raise invalid(f"kv_usage: {usage} not in [0, 1]")


def _check_int(name: str, value: int, largest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name}: {value!r} is not an integer")
    if not 0 <= value <= largest:
        raise invalid(f"{name}: {value} not in [0, {largest}]")


def check_hashes(where: str, hashes: Sequence[int]) -> list[int]:
    """At most MAX_BLOCK_HASHES u64 values, as a list."""
    if len(hashes) > limits.MAX_BLOCK_HASHES:
        raise invalid(f"{where}: {len(hashes)} hashes, at most {limits.MAX_BLOCK_HASHES}")
    hashes = list(hashes)
    if hashes and (min(hashes) < 0 or max(hashes) > U64_MAX):
        raise invalid(f"{where}: hashes must be u64")
    return hashes


def check_peer(
    node_id: str, store_address: str, ucx_address: str, namespaces: Sequence[str], lease_ms: int
) -> None:
    """Every field of a store's advertisement."""
    check_name("node_id", node_id)
    for where, addr in (("store_address", store_address), ("ucx_address", ucx_address)):
        if len(addr) > limits.MAX_ADDRESS_LEN:
            raise invalid(f"{where}: longer than {limits.MAX_ADDRESS_LEN}")
    if len(namespaces) > limits.MAX_NAMESPACES_PER_PEER:
        raise invalid(
            f"final_namespaces: {len(namespaces)} given, at most {limits.MAX_NAMESPACES_PER_PEER}"
        )
    for i, ns in enumerate(namespaces):
        check_final_namespace(f"final_namespaces[{i}]", ns)
    if not 0 <= lease_ms <= limits.MAX_LEASE_MS:
        raise invalid(f"lease_ms: {lease_ms} not in [0, {limits.MAX_LEASE_MS}]")


def decode_store_events(node_id: str, payloads: Sequence[bytes]) -> list[StoreEvent]:
    """The publisher's node id and every payload decoded and bounded, or
    INVALID_ARGUMENT naming the first bad field (``events[i].<key>``)."""
    check_name("node_id", node_id)
    if len(payloads) > limits.MAX_EVENTS_PER_PUBLISH:
        raise invalid(f"events: {len(payloads)} events, at most {limits.MAX_EVENTS_PER_PUBLISH}")
    events = []
    for i, payload in enumerate(payloads):
        if len(payload) > limits.MAX_EVENT_BYTES:
            raise invalid(f"events[{i}]: {len(payload)} bytes, at most {limits.MAX_EVENT_BYTES}")
        try:
            events.append(StoreEvent.decode(payload))
        except MalformedEvent as exc:
            where = f"events[{i}].{exc.field}" if exc.field else f"events[{i}]"
            raise invalid(f"{where}: {exc.reason}") from exc
    return events
