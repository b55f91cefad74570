"""A request past a count bound is refused before the server makes a Python
object of each of its entries: what a client can make it allocate is bounded
by the bound, not by the message size the channel accepts (16 MiB)."""

from __future__ import annotations

import tracemalloc

import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.service import store_codec as codec
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST

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
