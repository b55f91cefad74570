"""A store whose port answers but whose service hangs must not hang an engine."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.wire.errors import Code, KVError


class HungStore(pb_grpc.KVStoreServicer):
    """Takes RegisterLayers and never answers it (a stuck handler)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def RegisterLayers(self, request, context):
        self.release.wait(30)
        return iter(())


@pytest.fixture
def hung_store():
    servicer = HungStore()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(0)


def test_a_registration_the_store_never_answers_fails_in_time(hung_store):
    shm = kv_cache_shm("kv_first", 4, 4, 1, 8, torch.float16, "NHD")
    client = StoreClient(hung_store)
    try:
        start = time.monotonic()
        with pytest.raises(KVError, match="did not answer the registration within 1s") as err:
            client.register("i", "m", [KVLayer("l0", shm.tensor, shm=shm)], accept_timeout=1.0)
        assert err.value.code is Code.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 10
    finally:
        client.close()
        shm.close()
