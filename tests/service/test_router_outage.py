"""A hung router loses nothing: blocks saved meanwhile reach its index after it resumes.

Real processes: a standalone router, a store server advertising to it, two
TP worker processes. The router is frozen with SIGSTOP, so every publish to it
times out; after SIGCONT its index must hold every sealed block of the store.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.demo import free_ports
from tests.conftest import wait_for
from tests.service.test_peer_fetch import LAYOUT, ready, spawn, wait_healthy

pytest.importorskip("ucxx")


def known(router: RouterClient, ns: str, hashes: list[int]) -> int:
    try:
        peers = router.query_prefix(ns, hashes)
    except Exception:
        return -1
    return max((p.prefix_blocks for p in peers), default=0)


def test_blocks_saved_while_the_router_hung_reach_its_index_after(tmp_path):
    from kvstore.testing.worker import WorkerGroup

    rport, sport = free_ports(2)
    router_proc = spawn("router", "--port", str(rport))
    procs = [router_proc]
    group = None
    try:
        wait_healthy(f"127.0.0.1:{rport}", router_proc)
        store = f"127.0.0.1:{sport}"
        procs.append(
            spawn(
                "serve",
                "--port",
                str(sport),
                "--device",
                "cpu",
                "--pool-size",
                "64MiB",
                "--router",
                f"127.0.0.1:{rport}",
                "--node-id",
                "a",
            )
        )
        ready(store, procs[-1])
        group = WorkerGroup(store, "src", 2, **LAYOUT)
        ns = group.namespace
        router = RouterClient(f"127.0.0.1:{rport}", timeout_s=2)
        first, second = [4000 + i for i in range(4)], [4100 + i for i in range(4)]
        group.each("fill", [(h, i) for i, h in enumerate(first + second)])
        group.each("save", [(h, i) for i, h in enumerate(first)])
        assert wait_for(lambda: known(router, ns, first) == 4, timeout=15)

        os.kill(router_proc.pid, signal.SIGSTOP)
        try:
            group.each("save", [(h, 4 + i) for i, h in enumerate(second)])
            time.sleep(7)  # the publish of these events times out (5 s) meanwhile
        finally:
            os.kill(router_proc.pid, signal.SIGCONT)

        assert wait_for(lambda: known(router, ns, second) == 4, timeout=45)
        assert known(router, ns, first) == 4
        router.close()
    finally:
        if group is not None:
            group.close()
        for p in procs:
            p.kill()
            p.wait(timeout=10)
