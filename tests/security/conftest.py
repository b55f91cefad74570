"""Certificates, and a router and a store server that demand them (mutual TLS)."""

from __future__ import annotations

import pytest

from kvstore.router.core import Router, RouterConfig
from kvstore.service.tls import Security
from kvstore.testing.pki import Pki
from tests.conftest import ServerThread
from tests.router.conftest import ServerThread as RouterThread

ADMIN = "ops"


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_router(pki):
    r = RouterThread(Router(RouterConfig()), security=Security(pki.server, admins=(ADMIN,)))
    yield r
    r.stop()


def tls_store_thread(pki, router=None, **config) -> ServerThread:
    """A host-memory store server demanding client certificates of ``pki``
    (ADMIN an admin); ``config``: further ServerConfig fields."""
    return ServerThread(
        router,
        pool_size=64 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
        tls=pki.server,
        admins=(ADMIN,),
        **config,
    )


@pytest.fixture
def tls_store(pki):
    s = tls_store_thread(pki)
    yield s
    s.stop()
