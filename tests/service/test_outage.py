"""A peer that is down is logged once, not once a try (kvstore/service/outage.py).

Before, ``kvstore router --store ADDR`` with the store down logged a five-line
AioRpcError warning every second, for as long as it stayed down.
"""

from __future__ import annotations

import asyncio
import logging
import re

import grpc

from kvstore.demo import free_port
from kvstore.router.core import Router, RouterConfig
from kvstore.service.feeds import follow_store
from kvstore.service.outage import Outage, grpc_reason
from kvstore.service.store_server import ServerConfig, StoreServer
from kvstore.wire.events import STORED, StoreEvent
from tests.router.conftest import Clock

NS = "m.0123456789abcdef"
FEEDS = "kvstore.service.feeds"


def test_an_outage_is_logged_when_lost_reminded_while_down_and_once_when_back(caplog):
    clock = Clock(0.0)
    log = logging.getLogger("test.outage")
    outage = Outage(log, "peer P", "retrying", remind_s=300, first_s=0.5, cap_s=15, clock=clock)
    caplog.set_level(logging.DEBUG, "test.outage")
    assert outage.delay() == 0 and not outage.down
    outage.recovered()  # never down: nothing to say
    delays = []
    for _ in range(8):  # eight failures 10 s apart: one line
        outage.failed("UNAVAILABLE: refused")
        delays.append(outage.delay())
        clock.now += 10
    assert delays == [0.5, 1, 2, 4, 8, 15, 15, 15]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [(logging.WARNING, "peer P lost (UNAVAILABLE: refused); retrying")]
    clock.now = 300  # 300 s after it was lost: reminded, once
    outage.failed("UNAVAILABLE: refused")
    outage.failed("UNAVAILABLE: refused")
    clock.now = 599
    outage.failed("UNAVAILABLE: refused")
    assert [r.getMessage() for r in caplog.records[1:]] == [
        "peer P still down after 300 s (9 tries; the last: UNAVAILABLE: refused)"
    ]
    clock.now = 612.5
    outage.recovered("3 dropped")
    outage.recovered()
    assert [(r.levelno, r.getMessage()) for r in caplog.records[2:]] == [
        (logging.INFO, "peer P resumed after 612.5 s (11 failed tries; 3 dropped)")
    ]
    assert not outage.down and outage.delay() == 0
    clock.now += 60  # up for a minute: settled
    outage.failed("again")  # a new outage: a new first line, backoff from the start
    assert caplog.records[-1].getMessage() == "peer P lost (again); retrying"
    assert outage.delay() == 0.5


def test_a_peer_that_flaps_is_logged_once_a_reminder_and_backs_off_across_returns(caplog):
    """A stream that opens and is cut at once (a router cut as too slow) logged a
    lost WARNING and a resumed INFO every cycle, and retried after 0.5 s each
    time. Now a loss within settle_s of a return is a relapse: logged at most
    once a remind_s with how many there were, its return with it, and the
    backoff goes on doubling."""
    clock = Clock(0.0)
    log = logging.getLogger("test.outage")
    outage = Outage(log, "peer P", "retrying", remind_s=300, settle_s=60, clock=clock)
    caplog.set_level(logging.DEBUG, "test.outage")
    delays = []
    while clock.now < 300:  # lost, back after the delay, lost again 1 s later
        outage.failed("CANCELLED: too slow")
        delays.append(outage.delay())
        clock.now += delays[-1]
        outage.recovered()
        clock.now += 1
    assert delays[:7] == [0.5, 1, 2, 4, 8, 15, 15] and len(delays) == 23
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, "peer P lost (CANCELLED: too slow); retrying"),
        (logging.INFO, "peer P resumed after 0.5 s (1 failed tries)"),
    ]
    outage.failed("CANCELLED: too slow")  # past remind_s: one line with the count
    clock.now += 2
    outage.recovered()  # and its return
    assert [(r.levelno, r.getMessage()) for r in caplog.records[2:]] == [
        (
            logging.WARNING,
            "peer P lost again (CANCELLED: too slow), 23 times within 60 s of coming "
            "back since the last line; retrying",
        ),
        (logging.INFO, "peer P resumed after 2.0 s (1 failed tries)"),
    ]
    clock.now += 60  # up for settle_s: the next loss is a new outage, backoff anew
    outage.failed("UNAVAILABLE: gone")
    assert caplog.records[-1].getMessage() == "peer P lost (UNAVAILABLE: gone); retrying"
    assert outage.delay() == 0.5


def test_a_grpc_failure_is_its_code_and_details_without_the_debug_string():
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="failed to connect to all addresses",
        debug_error_string="UNKNOWN:Error received from peer {grpc_status:14}",
    )
    assert grpc_reason(err) == "UNAVAILABLE: failed to connect to all addresses"
    assert grpc_reason(ValueError("bad")) == "ValueError: bad"
    assert grpc_reason(EOFError()) == "EOFError"


def test_a_router_following_a_store_that_is_down_logs_it_once_and_its_return(caplog):
    """The feed tries a store nobody listens on many times: one WARNING (code and
    details, no traceback); a real store started on that address: one INFO, and
    its events reach the router."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    router = Router(RouterConfig())
    tries = []  # the feed reads its clock once per failed try and once when back

    def clock() -> float:
        tries.append(1)
        return float(len(tries))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        feed = loop.create_task(follow_store(router, address, retry_s=0.02, clock=clock))
        store = None
        try:
            deadline = loop.time() + 30
            while len(tries) < 6:  # six failed tries
                assert loop.time() < deadline and not feed.done(), "the feed stopped trying"
                await asyncio.sleep(0.02)
            store = StoreServer(
                ServerConfig(
                    port=port, device="cpu", pool_size=1 << 20, slab_bytes=64 << 10, node_id="s1"
                )
            )
            await store.start()
            while not any("resumed" in r.getMessage() for r in caplog.records):
                assert loop.time() < deadline, "the store's return was never logged"
                await asyncio.sleep(0.02)
            while not router.query_prefix(NS, [41, 42]):  # events flow again
                assert loop.time() < deadline, "the router never saw the store's events"
                store.service.publish(StoreEvent(STORED, NS, [41, 42], "s1"))
                await asyncio.sleep(0.05)
        finally:
            feed.cancel()
            if store is not None:
                await store.stop(grace=0)

    with caplog.at_level(logging.INFO, FEEDS):
        asyncio.run(run())
    records = [r for r in caplog.records if r.name == FEEDS]
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith(f"store events from {address} lost (UNAVAILABLE: ")
    assert "debug_error_string" not in message and "\n" not in message
    assert warnings[0].exc_info is None
    resumed = [r.getMessage() for r in records if "resumed" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].startswith(f"store events from {address} resumed")
    assert int(re.search(r"\((\d+) failed tries\)", resumed[0]).group(1)) >= 6
