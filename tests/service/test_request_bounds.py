"""A request past a count bound is refused before the server makes a Python
object of each of its entries: what a client can make it allocate is bounded
by the bound, not by the message size the channel accepts (16 MiB)."""

from __future__ import annotations

import tracemalloc

import pytest

from kvstore._proto import router_pb2
from kvstore._proto import store_pb2 as pb
from kvstore.router.requests import check_route, decode_store_events
from kvstore.service import store_codec as codec
from kvstore.service.router_service import listed
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import (
    MAX_BLOCK_HASHES,
    MAX_BLOCKS_PER_REQUEST,
    MAX_EVENTS_PER_PUBLISH,
    MAX_LAYERS,
    MAX_TOKEN_IDS,
)

ENTRIES = 1_000_000  # ~10 MB on the wire; ~40 MB as Python ints and tuples


def refused_within(fn, request) -> tuple[KVError, int]:
    """The KVError ``fn(request)`` raises, and the most it allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(KVError) as refused:
            fn(request)
        return refused.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", [pb.SaveRequest, pb.LoadRequest])
def test_save_and_load_refs_past_the_bound_are_refused_before_they_are_built(kind):
    request = kind(block_hashes=range(ENTRIES), block_ids=range(ENTRIES))
    error, peak = refused_within(codec.refs, request)
    assert error.code is Code.INVALID_ARGUMENT
    assert f"block_hashes has {ENTRIES} entries, more than {MAX_BLOCKS_PER_REQUEST}" in (
        error.message
    )
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


@pytest.mark.parametrize("kind", [pb.QueryRequest, pb.PrefetchRequest])
def test_query_and_prefetch_hashes_past_the_bound_are_refused_before_they_are_built(kind):
    error, peak = refused_within(codec.block_hashes, kind(block_hashes=range(ENTRIES)))
    assert error.code is Code.INVALID_ARGUMENT and "block_hashes" in error.message
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_hashes_within_the_bound_come_through_in_order():
    hashes = list(range(MAX_BLOCKS_PER_REQUEST))
    assert codec.block_hashes(pb.QueryRequest(block_hashes=hashes)) == hashes
    request = pb.SaveRequest(block_hashes=hashes, block_ids=hashes[::-1])
    assert codec.refs(request) == list(zip(hashes, hashes[::-1], strict=True))


def test_registration_layers_past_the_bound_are_counted_before_any_is_decoded():
    """Before: every layer was decoded first (150,000 held the loop ~1.5 s), and
    1,025 layers without memory were refused naming layers[2].memory, not the count."""
    request = pb.RegisterLayersRequest(layers=[pb.LayerSpec()] * 100_000)
    error, peak = refused_within(lambda r: codec.decode_registration(r), request)
    assert error.code is Code.INVALID_ARGUMENT
    assert f"layers has 100000 entries, more than {MAX_LAYERS}" in error.message
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


ROUTER_CASES = {
    "route token_ids": (
        router_pb2.RouteRequest(token_ids=range(2 * MAX_TOKEN_IDS)),
        lambda r: check_route("m", listed(r.token_ids, MAX_TOKEN_IDS), None, "", 0),
        f"token_ids: {2 * MAX_TOKEN_IDS} tokens",
    ),
    "route block_hashes": (
        router_pb2.RouteRequest(block_hashes=range(ENTRIES)),
        lambda r: check_route("m", None, listed(r.block_hashes, MAX_BLOCK_HASHES), "", 0),
        f"block_hashes: {ENTRIES} hashes",
    ),
    "publish events": (
        router_pb2.PublishEventsRequest(node_id="n", events=[b""] * ENTRIES),
        lambda r: decode_store_events(r.node_id, listed(r.events, MAX_EVENTS_PER_PUBLISH)),
        f"events: {ENTRIES} events",
    ),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_fields_past_their_bound_are_refused_before_they_are_copied(case):
    """The router's edge copied token_ids, block_hashes and events into lists
    before the core counted them: a 16 MiB Route took ~270 MB and held the loop
    0.5 s. Past its bound a field now reaches the core as it is, refused by length."""
    request, refuse, message = ROUTER_CASES[case]
    error, peak = refused_within(refuse, request)
    assert error.code is Code.INVALID_ARGUMENT and message in error.message
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_router_fields_within_their_bound_come_through_as_lists():
    request = router_pb2.RouteRequest(token_ids=range(MAX_TOKEN_IDS))
    tokens = listed(request.token_ids, MAX_TOKEN_IDS)
    assert isinstance(tokens, list) and tokens == list(range(MAX_TOKEN_IDS))
