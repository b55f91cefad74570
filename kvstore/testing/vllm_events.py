"""vLLM KV event payloads built the way vLLM encodes them, for tests and benches.

The router only decodes these (``kvstore.router.vllm_events``); producing
them is what a stand-in publisher does.
"""

from __future__ import annotations

from collections.abc import MutableSequence

import msgpack


def encode_batch(
    events: list[list], ts: float = 0.0, data_parallel_rank: int | None = None
) -> bytes:
    """A ``KVEventBatch`` payload as vLLM's array_like msgspec structs encode it.

    ``events`` are already positional, e.g. ``["BlockRemoved", [1, 2], "GPU"]``.
    """
    batch: list = [ts, events]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


def stored_event(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None):
    """A ``BlockStored`` as vLLM's array_like struct encodes it (medium ``GPU``)."""
    return ["BlockStored", hashes, parent, tokens or [], 16, None, "GPU"]


def removed_event(hashes: list[int]):
    return ["BlockRemoved", hashes, "GPU"]


def churn_batches(
    held: MutableSequence[int],
    fresh: list[int],
    blocks_per_event: int,
    events_per_batch: int,
    token_ids: list[int] | None = None,
) -> list[bytes]:
    """A full cache's steady state: each event stores ``blocks_per_event`` of
    ``fresh`` and is followed by one removing as many of the oldest blocks held
    (``held``, oldest first, then ``fresh``; ``held`` is left holding what
    remains). ``token_ids`` ride along in every ``BlockStored`` (vLLM sends a
    block's tokens), so the decoder pays for them.
    """
    payloads, batch, parent = [], [], None
    queue = [*held, *fresh]  # eviction order: oldest first, this call's blocks last
    oldest = 0
    for start in range(0, len(fresh), blocks_per_event):
        new = fresh[start : start + blocks_per_event]
        batch.append(stored_event(new, parent, token_ids))
        batch.append(removed_event(queue[oldest : oldest + len(new)]))
        oldest += len(new)
        parent = new[-1]
        if len(batch) >= events_per_batch:
            payloads.append(encode_batch(batch, ts=1.0))
            batch = []
    if batch:
        payloads.append(encode_batch(batch, ts=1.0))
    del held[:]
    held.extend(queue[oldest:])
    return payloads
