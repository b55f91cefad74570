"""Issue 12, item 5: the router connects only to event endpoints it is told to allow.

Before, a card's ``kv_events_endpoint`` made the router dial any address. Now
``--events-allow`` (default: loopback and ipc) decides; a card naming another
endpoint is PERMISSION_DENIED at RegisterWorker, naming the field, and the
worker is not admitted.
"""

from __future__ import annotations

import argparse

import pytest

from kvstore.cli.router import add_router_arguments, build_served_router
from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router, RouterConfig
from kvstore.router.endpoints import EndpointAllowList
from kvstore.wire.errors import Code, KVError
from tests.router.conftest import ServerThread, card

FIELD = "card.kv_events_endpoint"


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5557",
        "tcp://127.8.9.10:1",
        "tcp://[::1]:5557",
        "tcp://localhost:5557",
        "tcp://LOCALHOST:5557",
        "ipc:///tmp/kvstore-events",
        "ipc://@abstract",
    ],
)
def test_the_default_allows_loopback_and_local_sockets(endpoint):
    EndpointAllowList().check(endpoint)
    assert EndpointAllowList().allows(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://10.0.0.9:5557",
        "tcp://192.168.1.1:5557",
        "tcp://[fd00::1]:5557",
        "tcp://[::ffff:10.0.0.9]:5557",
        "tcp://events.example.com:5557",
        "tcp://localhost.evil.com:5557",
        "tcp://0.0.0.0:5557",
    ],
)
def test_the_default_refuses_every_other_host_naming_the_field(endpoint):
    with pytest.raises(KVError) as info:
        EndpointAllowList().check(endpoint)
    assert info.value.code is Code.PERMISSION_DENIED
    assert FIELD in info.value.message and endpoint in info.value.message


@pytest.mark.parametrize(
    "endpoint",
    [
        "10.0.0.9:5557",
        "udp://127.0.0.1:5557",
        "inproc://events",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000",
        "tcp://*:5557",
        "tcp://127.0.0.1;10.0.0.9:5557",
        "ipc://",
        "ipc:///run/kvstore/../../etc/x",
    ],
)
def test_a_malformed_endpoint_is_invalid_argument_naming_the_field(endpoint):
    with pytest.raises(KVError) as info:
        EndpointAllowList(["tcp://*:*", "ipc://*"]).check(endpoint)
    assert info.value.code is Code.INVALID_ARGUMENT and FIELD in info.value.message


def test_patterns_by_cidr_port_range_exact_name_and_path_glob():
    allow = EndpointAllowList(
        [
            "tcp://10.0.0.0/8:5550-5560",
            "tcp://[fd00::/8]:*",
            "tcp://events.internal:5557",
            "ipc:///run/kvstore/*",
        ]
    )
    assert allow.allows("tcp://10.1.2.3:5555")
    assert not allow.allows("tcp://10.1.2.3:5561")  # outside the port range
    assert not allow.allows("tcp://11.1.2.3:5555")
    assert allow.allows("tcp://[fd12::7]:9")
    assert allow.allows("tcp://events.internal:5557")
    assert not allow.allows("tcp://events.internal:5558")
    assert not allow.allows("tcp://x.events.internal:5557")  # exact names only, no DNS
    assert allow.allows("ipc:///run/kvstore/w0.sock")
    assert not allow.allows("ipc:///tmp/w0.sock")
    assert not allow.allows("tcp://127.0.0.1:5555")  # loopback only when listed


@pytest.mark.parametrize(
    "pattern",
    ["10.0.0.0/8", "tcp://10.0.0.0/8", "tcp://10.0.0.0/33:*", "tcp://h:0", "tcp://h:9-1",
     "tcp://bad_host!:*", "zmq://x:1", "ipc://"],
)  # fmt: skip
def test_a_bad_pattern_is_refused_at_startup_naming_it(pattern):
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    with pytest.raises(ValueError, match="--events-allow"):
        build_served_router(parser.parse_args(["--events-allow", pattern]))


def test_the_flag_replaces_the_default():
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    served = build_served_router(parser.parse_args(["--events-allow", "tcp://10.0.0.0/8:*"]))
    allow = served.router.config.events_allow
    assert allow.allows("tcp://10.0.0.1:1") and not allow.allows("tcp://127.0.0.1:1")
    default = build_served_router(parser.parse_args([])).router.config.events_allow
    assert default.allows("tcp://127.0.0.1:1") and not default.allows("tcp://10.0.0.1:1")


def test_the_core_refuses_the_card_and_nothing_changes():
    router = Router(RouterConfig(events_allow=EndpointAllowList(["ipc:///run/kvstore/*"])))
    router.register_worker("w0", card(kv_events_endpoint="ipc:///run/kvstore/w0"))
    with pytest.raises(KVError) as info:
        router.register_worker("w0", card(kv_events_endpoint="tcp://127.0.0.1:5557"))
    assert info.value.code is Code.PERMISSION_DENIED and FIELD in info.value.message
    assert router.worker_generations() == {"w0": 1}  # the admitted generation stays


@pytest.fixture
def plain_router():
    r = ServerThread(Router(RouterConfig()))  # plaintext on loopback, the default allow-list
    yield r
    r.stop()


def test_register_worker_over_grpc_naming_a_foreign_endpoint_is_refused(plain_router):
    """Before: the router subscribed to tcp://10.0.0.9:5557 because a card said so."""
    with RouterClient(plain_router.address) as client:
        with pytest.raises(KVError) as info:
            client.register_worker("w0", card(kv_events_endpoint="tcp://10.0.0.9:5557"))
        assert info.value.code is Code.PERMISSION_DENIED and FIELD in info.value.message
        stats = plain_router.router.stats()
        assert stats.workers == 0  # not admitted
        client.register_worker("w0", card(kv_events_endpoint="tcp://127.0.0.1:5557"))
        assert plain_router.router.stats().workers == 1
