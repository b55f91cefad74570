"""vLLM KV event payloads built the way vLLM encodes them, for tests and benches.

The router only decodes these (``kvstore.router.vllm_events``); producing
them is what a stand-in publisher does.
"""

from __future__ import annotations

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
