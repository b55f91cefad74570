"""Certificates, and a router and a store server that demand them (mutual TLS)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import ServedRouter
from kvstore.service.tls import Security
from kvstore.testing.pki import Pki
from tests.conftest import ServerThread

ADMIN = "ops"


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


class TlsRouterThread:
    """A standalone router on 127.0.0.1 (free port) behind mutual TLS, on its own loop."""

    def __init__(self, security: Security):
        self.router = Router(RouterConfig())
        self.served = ServedRouter(self.router)
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
        server = grpc.aio.server()
        self.served.start(server, self.security)
        self.port = self.security.bind(server, "127.0.0.1:0")
        await server.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=1)
        await self.served.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def tls_router(pki):
    r = TlsRouterThread(Security(pki.server, admins=(ADMIN,)))
    yield r
    r.stop()


@pytest.fixture
def tls_store(pki):
    s = ServerThread(
        pool_size=64 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
        tls=pki.server,
        admins=(ADMIN,),
    )
    yield s
    s.stop()
