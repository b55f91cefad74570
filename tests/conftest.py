"""Shared fixtures: a real store server on a loopback port, in a thread."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from kvstore.service.store_server import ServerConfig, StoreServer
from kvstore.transfer import rma


def need_nixl() -> None:
    """Skip without NIXL; under CI=true its absence fails (it is a dependency there)."""
    ok = rma.available()
    if not ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"nixl is required under CI=true: {ok.reason}")
        pytest.skip(ok.reason)


class ServerThread:
    """Runs a real StoreServer (gRPC on 127.0.0.1, free port) on its own event loop."""

    def __init__(self, router=None, **config):
        """``router``: a ServedRouter to embed (as ``kvstore serve`` does); ``config``:
        ServerConfig fields."""
        self.loop = asyncio.new_event_loop()
        self.server = StoreServer(ServerConfig(port=0, **config), router)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        """Run a plain function on the server's loop (to read core state safely)."""

        async def wrap():
            return fn(*args)

        return self.run(wrap())

    def stop(self):
        self.run(self.server.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    s = ServerThread(pool_size=64 << 20, device="cpu", slab_bytes=4 << 20)
    yield s
    s.stop()


def wait_for(predicate, timeout=10.0, interval=0.05):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
