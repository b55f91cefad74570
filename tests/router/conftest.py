"""Shared helpers: card factory, a manual clock, and a real gRPC router server.

The server is the production one (grpc.aio + ServedRouter) on an
ephemeral 127.0.0.1 port, run on its own event loop in a background thread so
the tests can use the ordinary synchronous client.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc
import pytest

from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import FeedSpecs, ServedRouter
from kvstore.service.tls import PLAINTEXT, Security
from kvstore.wire.card import WorkerCard
from kvstore.wire.names import client_namespace_of

BASE = WorkerCard(
    display_name="llama-8b",
    kv_block_size=16,
    source_path="/models/llama-8b",
    model_config_checksum="cfg-1",
    tokenizer_checksum="tok-1",
    prompt_formatter_checksum="fmt-1",
    chat_template_checksum="tpl-1",
    generation_config_checksum="gen-1",
    extra_files={"/models/llama-8b/preprocessor_config.json": "pp-1"},
    context_length=32768,
    worker_type="decode",
)


def card(**changes) -> WorkerCard:
    """BASE with ``changes``; lists and dicts are copied so tests cannot share them.
    A ``final_namespace`` given alone brings its client namespace as ``namespace``."""
    if "." in changes.get("final_namespace", "") and "namespace" not in changes:
        changes["namespace"] = client_namespace_of(changes["final_namespace"])
    c = replace(BASE, **changes)
    c.aliases, c.needs, c.multimodal = list(c.aliases), list(c.needs), list(c.multimodal)
    c.extra_files = dict(c.extra_files)
    return c


class Clock:
    """A clock the test moves by hand (no sleeping, no timing thresholds)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class ServerThread:
    """A router served on 127.0.0.1 (free port) on its own event loop; plaintext,
    or mutual TLS with ``security``."""

    def __init__(
        self, router: Router, feeds: FeedSpecs | None = None, security: Security = PLAINTEXT
    ):
        self.router = router
        self.served = ServedRouter(router, feeds)
        self.security = security
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("router server did not start")
        self.address = f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.server = grpc.aio.server()
        self.served.start(self.server, self.security)
        self.port = self.security.bind(self.server, "127.0.0.1:0")
        await self.server.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(grace=1)
        await self.served.close()

    def call(self, coro_fn, timeout: float = 30):
        """Run ``coro_fn()`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def router() -> Router:
    return Router(RouterConfig())


@pytest.fixture
def served():
    """(router, client) talking over a real loopback gRPC connection."""
    router = Router(RouterConfig())
    server = ServerThread(router)
    client = RouterClient(server.address)
    try:
        yield router, client, server
    finally:
        client.close()
        server.stop()
