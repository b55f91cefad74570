"""A store node id in etcd is one store's: two stores given one ``--node-id``
do not take ``stores/<node id>`` from each other; a store restarting at its own
address takes its key back at once. Real etcd, real store servers."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

from kvstore.demo import free_port
from kvstore.membership.layout import StoreRecord
from tests.conftest import ServerThread, wait_for
from tests.membership.conftest import (
    Blocks,
    Proc,
    RouterThread,
    etcd_flags,
    etcd_keys,
    etcd_read,
    prefix_known,
)

LINK = "kvstore.service.router_link"
HASHES = [9300 + i for i in range(4)]


def store_thread(config, node_id: str) -> ServerThread:
    return ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, node_id=node_id, etcd=config
    )


def held(config, node_id: str) -> tuple[int, int, str] | None:
    """(create revision, lease, store address) of ``stores/<node_id>``; None when absent."""
    entry = etcd_keys(config, "stores/").get(f"stores/{node_id}")
    if entry is None:
        return None
    return entry.create_revision, entry.lease, StoreRecord.decode(entry.value).store_address


def test_a_second_store_given_a_live_stores_node_id_leaves_its_key_until_it_stops(
    etcd_config, caplog
):
    """Before, each registration recreated stores/<node id>: the second store took
    the key, the first's lease stayed alive so it never registered again, the
    replicas refused its events as a stale generation and nobody was told. Now
    the key stays the first's across the second's retries; the second logs the
    conflict once (an ERROR naming the node id, the holder's address and what to
    do), serves locally, and registers (logged once) when the first stops: its
    blocks saved meanwhile reach the replica."""
    caplog.set_level(logging.DEBUG, logger=LINK)
    replica = RouterThread(etcd_config)
    first = store_thread(etcd_config, "twin")
    second = blocks = None

    def records(text: str, level: int) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == LINK and r.levelno == level and text in r.getMessage()
        ]

    try:
        generation, lease, address = held(etcd_config, "twin")
        assert address == first.address
        assert wait_for(
            lambda: replica.call(replica.router.peer_generations).get("twin") == generation,
            timeout=30,
        )
        second = store_thread(etcd_config, "twin")
        seen = {(generation, lease, first.address)}  # every view while the second tries

        def tried(times: int) -> bool:
            seen.add(held(etcd_config, "twin"))
            return len(records("registration refused", logging.DEBUG)) >= times

        retried = wait_for(lambda: tried(4) or len(seen) > 1, timeout=60)
        seen.add(held(etcd_config, "twin"))
        assert seen == {(generation, lease, first.address)}  # before: the second's at once
        assert retried, "the second never retried"
        [error] = records("not registered in etcd", logging.ERROR)
        message = error.getMessage()
        assert "'twin'" in message and repr(first.address) in message
        assert "another --node-id" in message and error.exc_info is None
        assert replica.call(replica.router.peer_generations).get("twin") == generation

        blocks = Blocks(second.address)  # it serves locally all the same
        blocks.save(HASHES)
        assert not records("registered in etcd now", logging.INFO)

        first.stop()  # revokes its lease: the key goes, the second takes it
        first = None
        _took_over(etcd_config, replica, second, blocks.namespace, generation)
        assert wait_for(lambda: records("registered in etcd now", logging.INFO), timeout=30)
    finally:
        if blocks is not None:
            blocks.close()
        for store in (first, second):
            if store is not None:
                store.stop()
        replica.stop()
    assert len(records("not registered in etcd", logging.ERROR)) == 1
    [info] = records("registered in etcd now", logging.INFO)
    assert "'twin'" in info.getMessage() and address in info.getMessage()


def test_a_store_restarting_at_its_address_takes_its_key_before_the_old_lease_lapses(
    tmp_path, etcd_config
):
    """A store killed (SIGKILL: no revoke) leaves its key under a live lease; a
    store started again at the same address replaces it at once, as before,
    while that lease still lives (a 60 s TTL here)."""
    config = dataclasses.replace(etcd_config, ttl_s=60)
    port = free_port()
    procs: list[Proc] = []

    def serve(name: str) -> Proc:
        args = ["serve", "--port", str(port), "--node-id", "solo", "--device", "cpu"]
        args += ["--pool-size", "16MiB", "--no-transfer", "--no-router", *etcd_flags(config)]
        procs.append(Proc(tmp_path, name, *args))
        return procs[-1]

    try:
        crashed = serve("before")
        assert wait_for(lambda: held(config, "solo") is not None, timeout=60), crashed.tail()
        generation, lease, address = held(config, "solo")
        assert address.endswith(f":{port}")
        os.kill(crashed.pid, signal.SIGKILL)
        crashed.proc.wait(timeout=30)
        assert held(config, "solo") == (generation, lease, address)  # the lease lives on

        again = serve("after")
        assert wait_for(lambda: (held(config, "solo") or (0,))[0] > generation, timeout=60), (
            again.tail()
        )
        _, new_lease, new_address = held(config, "solo")
        assert new_address == address and new_lease != lease
        # the old lease still lived when its key was replaced: no wait for it to lapse
        assert etcd_read(config, lambda etcd: etcd.refresh(lease)) > 0
        assert again.alive()
        log = again.log.read_text(errors="replace")
        assert "not registered in etcd" not in log and "Traceback" not in log
    finally:
        for proc in procs:
            proc.kill()


def test_a_registered_store_refused_after_losing_its_lease_pauses_its_feeds_until_it_registers(
    etcd_config, caplog
):
    """A registered store whose key another store at its node id took meanwhile
    (here: the key deleted under the first's live lease, so the second, retrying,
    creates it), and whose lease is then lost (revoked here), is refused when it
    registers again: it logs that once, its feeds pause (generation 0, nothing
    queued or sent, blocks it saves meanwhile not published), and once the
    second stops it registers and its feed resumes with a snapshot: the replica
    indexes every block it holds, under its new generation."""
    from kvstore.membership.etcd import delete, modified_at

    caplog.set_level(logging.DEBUG, logger=LINK)
    replica = RouterThread(etcd_config)
    first = store_thread(etcd_config, "twin")
    first_address, second_address = first.address, ""
    second = blocks = None
    key = f"{etcd_config.prefix}stores/twin"

    def records(text: str, level: int, store: ServerThread) -> list[logging.LogRecord]:
        """``store``'s: its refusal names its address, its registration the other's."""
        other = second_address if store is first else first_address
        mine = f"not {store.address!r}" if level == logging.ERROR else f"at {other} "
        return [
            r
            for r in caplog.records
            if r.name == LINK
            and r.levelno == level
            and text in r.getMessage()
            and mine in r.getMessage()
        ]

    def feeds(store: ServerThread) -> list[tuple[int, bool, int]]:
        """(generation, synced, queued) of each of ``store``'s feeds."""
        link = store.server.link
        return store.call(lambda: [(f.generation, f.synced, f.queued) for f in link.feeds.values()])

    try:
        generation, lease, _ = held(etcd_config, "twin")
        blocks = Blocks(first.address)
        blocks.save(HASHES[:2])
        assert wait_for(
            lambda: prefix_known(replica.address, blocks.namespace, HASHES, "twin") == 2,
            timeout=30,
        )
        assert feeds(first) == [(generation, True, 0)]

        second = store_thread(etcd_config, "twin")  # refused: the first holds the key
        second_address = second.address
        assert wait_for(lambda: records("not registered in etcd", logging.ERROR, second), 30)
        # the key goes while the first's lease lives on: the second, retrying, takes it
        entry = etcd_keys(etcd_config, "stores/")["stores/twin"]
        assert entry.lease == lease
        taken = etcd_read(
            etcd_config, lambda e: e.txn([modified_at(key, entry.mod_revision)], [delete(key)])
        )
        assert taken.succeeded
        assert wait_for(
            lambda: (held(etcd_config, "twin") or (0, 0, ""))[2] == second.address, timeout=30
        )
        theirs = held(etcd_config, "twin")[0]
        assert wait_for(
            lambda: replica.call(replica.router.peer_generations).get("twin") == theirs,
            timeout=30,
        )

        etcd_read(etcd_config, lambda e: e.revoke(lease))  # the first's lease is lost
        assert wait_for(lambda: records("not registered in etcd", logging.ERROR, first), 30)
        [error] = records("not registered in etcd", logging.ERROR, first)
        assert repr(second.address) in error.getMessage() and error.exc_info is None
        assert held(etcd_config, "twin")[:1] == (theirs,)  # the second keeps it
        assert first.call(lambda: first.server.link.generation) == 0
        assert feeds(first) == [(0, False, 0)]  # paused
        blocks.save(HASHES[2:], first_block=2)  # saved while paused: not queued
        assert feeds(first) == [(0, False, 0)]
        assert replica.call(replica.router.peer_generations).get("twin") == theirs

        second.stop()  # revokes its lease: the first registers again, and resumes
        second = None
        ours = _took_over(etcd_config, replica, first, blocks.namespace, theirs)
        assert wait_for(lambda: feeds(first) == [(ours, True, 0)], timeout=30)
    finally:
        if blocks is not None:
            blocks.close()
        for store in (first, second):
            if store is not None:
                store.stop()
        replica.stop()
    assert len(records("not registered in etcd", logging.ERROR, first)) == 1
    assert len(records("registered in etcd now", logging.INFO, first)) == 1


def _took_over(etcd_config, replica, store, namespace: str, before: int) -> int:
    """``store`` comes to hold ``stores/twin`` under a generation past ``before``; the
    replica follows it there and indexes its 4 blocks. Its generation."""
    assert wait_for(
        lambda: (held(etcd_config, "twin") or (0, 0, ""))[2] == store.address, timeout=30
    )
    generation = held(etcd_config, "twin")[0]
    assert generation > before
    assert wait_for(
        lambda: prefix_known(replica.address, namespace, HASHES, "twin") == 4, timeout=30
    )
    assert replica.call(replica.router.peer_generations).get("twin") == generation
    return generation
