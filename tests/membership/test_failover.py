"""Failover with real processes: router and store servers as ``kvstore`` commands on
one real etcd, stopped with SIGSTOP, killed with SIGKILL, etcd itself killed.

The only timing bound asserted is the issue's liveness bound: a silent store
leaves routing and peer queries within TTL + 2 s. Measured times are printed
(``pytest -s``) for the notes.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.demo import free_port, free_ports
from kvstore.wire.errors import Code, KVError
from tests.conftest import wait_for
from tests.membership.conftest import (
    TTL_S,
    Blocks,
    Cluster,
    EtcdServer,
    Proc,
    etcd_keys,
    prefix_known,
    require_etcd,
    wait_healthy,
)
from tests.router.conftest import card

HASHES = [7100 + i for i in range(4)]
MORE = [7200 + i for i in range(4)]


def started(*servers: tuple[str, Proc]) -> list[str]:
    for address, proc in servers:
        wait_healthy(address, proc)
    return [address for address, _ in servers]


def store_blocks(address: str, hashes: list[int]) -> int:
    """Route's store-tier hit for ``hashes`` through the router at ``address`` (-1: no answer)."""
    with RouterClient(address, timeout_s=2) as client:
        try:
            return client.route("llama-8b", hashes=hashes, track=False).store_blocks
        except KVError:
            return -1


@pytest.mark.parametrize("command", ["router", "store"])
def test_a_taken_metrics_port_fails_the_start_before_etcd_hears_of_it(
    cluster, etcd_config, command
):
    """/metrics binds before a router replica (or a store) announces itself in etcd:
    a taken port exits 1 naming it and leaves no key behind to expire."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = cluster.router if command == "router" else cluster.store
        _, proc = start(command, "--metrics-port", str(port))
        assert proc.proc.wait(60) == 1, proc.tail()
        assert etcd_keys(etcd_config) == {}
    assert f"cannot serve /metrics on 127.0.0.1:{port}: " in proc.tail()


def test_a_stopped_store_leaves_routing_within_ttl_and_returns_when_resumed(cluster):
    routers = started(*(cluster.router(f"router{i}") for i in range(2)))
    store, proc = cluster.store("s1")
    started((store, proc))
    blocks = Blocks(store)
    try:
        blocks.save(HASHES)
        with RouterClient(routers[0]) as client:
            client.register_worker("w", card(node_id="s1", final_namespace=blocks.namespace))
        for r in routers:
            assert wait_for(lambda r=r: store_blocks(r, HASHES) == 4, timeout=15), r
            assert prefix_known(r, blocks.namespace, HASHES, "s1") == 4

        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            left: dict[str, float] = {}
            while len(left) < len(routers) and time.monotonic() - stopped < TTL_S + 4:
                for r in routers:
                    if r not in left and prefix_known(r, blocks.namespace, HASHES, "s1") == 0:
                        left[r] = time.monotonic() - stopped
                time.sleep(0.05)
            print(f"\nstore left routing after {sorted(left.values())} s (TTL {TTL_S} s)")
            assert sorted(left) == sorted(routers), "the stopped store never left"
            assert max(left.values()) <= TTL_S + 2
            assert [store_blocks(r, HASHES) for r in routers] == [0, 0]
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        for r in routers:
            assert wait_for(
                lambda r=r: prefix_known(r, blocks.namespace, HASHES, "s1") == 4, timeout=15
            ), f"{r} never saw the store again:\n{proc.tail()}"
            assert wait_for(lambda r=r: store_blocks(r, HASHES) == 4, timeout=5)
        print(f"store back in routing {time.monotonic() - resumed:.2f} s after SIGCONT")
    finally:
        blocks.close()


def test_routing_goes_on_when_one_of_three_routers_is_killed_mid_traffic(cluster):
    servers = [cluster.router(f"router{i}") for i in range(3)]
    routers = started(*servers)
    store, proc = cluster.store("s1")
    started((store, proc))
    blocks = Blocks(store)
    try:
        blocks.save(HASHES)
        # Registered through router2 (it survives: a unary registration lives as
        # long as the replica that admitted it).
        with RouterClient(routers[2]) as client:
            client.register_worker("w", card(node_id="s1", final_namespace=blocks.namespace))
        for r in routers:
            assert wait_for(lambda r=r: store_blocks(r, HASHES) == 4, timeout=15), r

        errors: list[Exception] = []
        latencies: list[tuple[float, float]] = []  # (start, seconds)
        stop = threading.Event()

        def traffic() -> None:
            with RouterClient(routers, timeout_s=5) as client:  # router0 first
                while not stop.is_set():
                    began = time.monotonic()
                    try:
                        reply = client.route("llama-8b", hashes=HASHES, track=False)
                        assert reply.worker == "w" and reply.store_blocks == 4, reply
                    except Exception as exc:  # every failure is a test failure
                        errors.append(exc)
                    latencies.append((began, time.monotonic() - began))

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            time.sleep(0.5)
            servers[0][1].proc.kill()  # SIGKILL router0 while traffic flows through it
            killed = time.monotonic()
            time.sleep(1.0)
            blocks.save(MORE, first_block=8)  # new blocks still reach the survivors
        finally:
            stop.set()
            thread.join(30)
        assert errors == [], errors
        before = sum(1 for began, _ in latencies if began < killed)
        after = sum(1 for began, _ in latencies if began >= killed)
        assert before and after
        worst = max(seconds for began, seconds in latencies if began >= killed - 0.5)
        print(f"\nroutes {before} before, {after} after the kill; slowest around it {worst:.3f} s")
        for r in routers[1:]:
            assert wait_for(
                lambda r=r: prefix_known(r, blocks.namespace, MORE, "s1") == 4, timeout=10
            )
        gone = f"routers/127.0.0.1%3A{routers[0].rsplit(':', 1)[1]}"
        assert wait_for(lambda: gone not in etcd_keys(cluster.config, "routers/"), TTL_S + 3)
    finally:
        blocks.close()


def test_a_store_moves_to_the_next_router_without_etcd(tmp_path):
    """Without etcd, ``--router A,B`` uses A; when A dies the store moves to B
    with a full snapshot."""
    *rports, sport = free_ports(3)
    procs = [Proc(tmp_path, f"router{i}", "router", "--port", str(p)) for i, p in enumerate(rports)]
    routers = [f"127.0.0.1:{p}" for p in rports]
    started(*zip(routers, procs[:2]))  # both up before the store picks the first one
    store = f"127.0.0.1:{sport}"
    procs.append(
        Proc(
            tmp_path,
            "store",
            "serve",
            "--port",
            str(sport),
            "--device",
            "cpu",
            "--pool-size",
            "16MiB",
            "--no-transfer",
            "--node-id",
            "s1",
            "--router",
            ",".join(routers),
        )
    )
    blocks = None
    try:
        started((store, procs[2]))
        blocks = Blocks(store)
        blocks.save(HASHES)
        assert wait_for(lambda: prefix_known(routers[0], blocks.namespace, HASHES, "s1") == 4, 15)
        assert prefix_known(routers[1], blocks.namespace, HASHES, "s1") == 0  # one at a time
        procs[0].kill()
        killed = time.monotonic()
        assert wait_for(
            lambda: prefix_known(routers[1], blocks.namespace, HASHES, "s1") == 4, timeout=20
        ), procs[2].tail()
        print(f"\nstore moved to the next router in {time.monotonic() - killed:.2f} s")
    finally:
        if blocks is not None:
            blocks.close()
        for p in procs:
            p.kill()


@pytest.fixture
def own_etcd():
    server = EtcdServer(require_etcd())
    server.start()
    yield server
    server.stop()


def test_etcd_killed_and_restarted_empty_everything_registers_again(own_etcd, tmp_path):
    from kvstore.membership.etcd import EtcdConfig

    config = EtcdConfig.parse(own_etcd.url, TTL_S, "/kvstore-test/restart/")
    cluster = Cluster(tmp_path, config)
    try:
        routers = started(*(cluster.router(f"router{i}") for i in range(2)))
        store, proc = cluster.store("s1")
        started((store, proc))
        blocks = Blocks(store)
        try:
            blocks.save(HASHES)
            with RouterClient(routers[0]) as client:
                worker_card = card(node_id="s1", final_namespace=blocks.namespace)
                client.register_worker("w", worker_card)
            for r in routers:
                assert wait_for(lambda r=r: store_blocks(r, HASHES) == 4, timeout=15), r

            own_etcd.kill()
            down = time.monotonic()
            # Without etcd: local saves, routing and peer queries go on, on the last state.
            blocks.save(MORE, first_block=8)
            time.sleep(TTL_S + 1)  # past every lease: nothing local may expire
            for r in routers:
                assert store_blocks(r, HASHES) == 4
                assert wait_for(
                    lambda r=r: prefix_known(r, blocks.namespace, MORE, "s1") == 4, timeout=5
                )
            print(f"\netcd down for {time.monotonic() - down:.1f} s: routing went on")

            own_etcd.start(fresh=True)  # etcd came back with nothing
            back = time.monotonic()

            def registered() -> bool:
                keys = etcd_keys(config)
                return {"stores/s1", "workers/w"} <= set(keys) and sum(
                    k.startswith("routers/") for k in keys
                ) == len(routers)

            assert wait_for(registered, timeout=15), [p.tail() for p in cluster.procs]
            print(f"everything registered again {time.monotonic() - back:.2f} s after etcd")

            def routed_generations() -> list[int | None]:
                """Each replica's routed generation; None while it admits no worker: the
                empty etcd's state reaches a replica before the worker's new key may."""
                generations: list[int | None] = []
                for r in routers:
                    with RouterClient(r, timeout_s=2) as client:
                        try:
                            routed = client.route("llama-8b", hashes=HASHES, track=False)
                        except KVError as e:
                            if e.code is not Code.NOT_FOUND:
                                raise
                            routed = None
                        generations.append(routed.generation if routed else None)
                return generations

            def member_generation() -> int:
                members = etcd_keys(config, "worksets/")
                return next(e.mod_revision for k, e in members.items() if "/members/" in k)

            # Both replicas converge on etcd's new state: the worker's new generation...
            assert wait_for(lambda: routed_generations() == [member_generation()] * 2, timeout=10)
            # ...and the store's blocks, sent again under its new generation.
            for r in routers:
                assert wait_for(
                    lambda r=r: prefix_known(r, blocks.namespace, HASHES + MORE, "s1") == 8,
                    timeout=15,
                )
            print(f"replicas agree again {time.monotonic() - back:.2f} s after etcd")
        finally:
            blocks.close()
    finally:
        cluster.close()


def test_router_client_moves_past_a_dead_router_and_stays_on_the_live_one():
    from kvstore.router.core import Router, RouterConfig
    from tests.router.conftest import ServerThread

    live = ServerThread(Router(RouterConfig()))
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        with RouterClient(f"{dead},{live.address}", timeout_s=5) as client:
            assert client.register_worker("w", card()).name == "w"
            assert client.address == live.address  # the one that answered stays current
            assert client.route("llama-8b", token_ids=list(range(32))).worker == "w"
            with pytest.raises(KVError) as refused:  # a refusal is not a reason to move on
                client.route("no-such-model", token_ids=list(range(32)))
            assert refused.value.code is Code.NOT_FOUND and client.address == live.address
        with RouterClient(dead, timeout_s=2) as alone, pytest.raises(KVError) as gone:
            alone.stats()
        assert gone.value.code is Code.UNAVAILABLE
    finally:
        live.stop()


def test_a_member_cut_off_from_its_cluster_ends_our_watch_and_refuses_calls():
    """Two of three members die: the third has no leader. Without etcd's
    'hasleader' metadata it kept our watch open and silent for good (a replica
    or store following it would never hear another change, nor move to a live
    endpoint), and every call waited out its timeout. With it the member
    cancels the watch and answers 'no leader' at once."""
    import asyncio

    from kvstore.membership.etcd import Etcd, EtcdConfig
    from kvstore.testing.etcd import EtcdCluster

    cluster = EtcdCluster(require_etcd(), 3, election_ms=500)
    cluster.start()
    try:
        config = EtcdConfig.parse(cluster.members[2].url, TTL_S, "/kvstore-test/cut/")

        async def cut_off() -> tuple[KVError, KVError]:
            etcd = Etcd(config)
            try:
                _, revision = await etcd.list_prefix(config.prefix)
                for member in cluster.members[:2]:
                    member.kill()
                with pytest.raises(KVError) as watch:
                    async with asyncio.timeout(30):  # a silent watch fails the test here
                        async for change in etcd.watch_prefix(config.prefix, revision + 1):
                            raise AssertionError(f"a change without a leader: {change}")
                with pytest.raises(KVError) as call:
                    await etcd.get(config.prefix + "x")
                return watch.value, call.value
            finally:
                await etcd.close()

        watch, call = asyncio.run(cut_off())
        assert "no leader" in watch.message and "no leader" in call.message
    finally:
        cluster.stop()
