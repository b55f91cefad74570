"""UCX progress on the event loop (kvstore.transfer.progress): polled while a
transfer runs, asleep once the connection is idle.

ucxx's own blocking mode never re-armed the worker's fd after its first event,
and a receive posted for a frame that comes later polled until it came: after
one fetch, both the fetcher and the peer used a whole core each, idle, for as
long as the pooled connection stayed open.
"""

from __future__ import annotations

import pytest

from tests.conftest import need_nixl
from tests.transfer.nodes import HASHES, blocks_of

KIB = 1 << 10
IDLE_S = 2.0
# A spinning loop uses about IDLE_S of CPU in IDLE_S (half of it on a loaded
# 2-core host); an idle one a few milliseconds.
MOST_CPU_S = 0.25 * IDLE_S


@pytest.mark.parametrize(
    "rma, env",
    [(False, {}), (True, {}), (False, {"UCX_MM_ERROR_HANDLING": "y"})],
    ids=["two-sided", "one-sided", "shared-memory"],
)
def test_an_idle_pooled_connection_costs_neither_side_cpu(nodes, rma, env):
    """Over tcp (the default) and shared memory (UCX_MM_ERROR_HANDLING=y): the
    next REQUEST on a sleeping peer must wake it through UCX's fd."""
    if rma:
        need_nixl()
    server, client = nodes(**env), nodes(**env)
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [16 * KIB] * 4), rma=rma)
    first = client.call("fetch", address=address, hashes=HASHES[:4], rma=rma)
    assert first["error"] is None and first["n"] == [4], first
    assert server.call("port_stats")["connections"] == 1  # pooled, open, idle

    idle = [node.submit("idle_cpu", seconds=IDLE_S) for node in (server, client)]
    for node, rid in zip((server, client), idle):
        used = node.result(rid)
        assert used["cpu_s"] < MOST_CPU_S, used
        assert used["sleeps"] >= 1, used  # its progress went to sleep

    # the sleeping peer wakes for the next REQUEST on the same connection
    again = client.call("fetch", address=address, hashes=HASHES[:4])
    assert again["error"] is None and again["n"] == [4] and again["corrupt"] == [], again
    assert server.call("port_stats")["connections"] == 1


def test_a_loop_that_ended_without_stop_progress_is_let_go():
    """Each event loop that used UCX kept its entry in ucxx's ProgressTasks (and
    with it the loop, its progress and whatever it held) after the loop closed."""
    import asyncio

    from ucxx._lib_async import application_context as app

    from kvstore.transfer.ucx import loop_progress

    async def closed_entries() -> list | None:
        if loop_progress() is None:
            return None
        return [loop for loop in app.ProgressTasks if loop.is_closed()]

    if asyncio.run(closed_entries()) is None:
        pytest.skip("ucxx progresses on a thread of its own here")
    assert asyncio.run(closed_entries()) == []
