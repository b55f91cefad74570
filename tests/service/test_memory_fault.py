"""A worker that shrinks its registered shared memory gets an error, not a dead server.

The server runs as its own process, so a SIGBUS that reached it would show here
as UNAVAILABLE on the next call instead of killing the test run.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.copy.host import native_copy_function
from kvstore.demo import free_port, start_server
from kvstore.wire.errors import Code, KVError

pytestmark = pytest.mark.skipif(
    native_copy_function() is None, reason="the SIGBUS guard lives in the native host copier"
)


@pytest.fixture
def store():
    port = free_port()
    proc = start_server(port, "cpu", 16 << 20)
    client = StoreClient(f"127.0.0.1:{port}", timeout=20)
    yield client
    client.close()
    proc.kill()
    proc.wait(timeout=10)


def test_truncated_worker_memory_fails_the_request_and_the_server_lives(store):
    shm = kv_cache_shm("kv_first", num_blocks=8, block_size=16, heads=2, head_dim=64)
    try:
        shm.tensor.copy_(torch.arange(shm.tensor.numel(), dtype=torch.float16).view_as(shm.tensor))
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = store.register("shrinker", "trunc", [layer], block_size=16)
        namespace = session.wait_sealed(timeout=30).final_namespace
        session.save([(101, 0)])

        os.truncate(f"/dev/shm/{shm.name}", 0)  # every page of the cache is gone now

        for op, refs in (("save", [(102, 1)]), ("load", [(101, 2)])):
            with pytest.raises(KVError) as err:
                getattr(session, op)(refs)
            assert err.value.code is Code.FAILED_PRECONDITION, err.value
            assert "shrank or vanished" in err.value.message and "rank 0" in err.value.message

        assert store.query(namespace, [101]).prefix_blocks == 1  # sealed before: still whole
        assert store.query(namespace, [102]).prefix_blocks == 0  # never half-visible
        assert store.stats() is not None  # the server is alive
    finally:
        shm.close()
