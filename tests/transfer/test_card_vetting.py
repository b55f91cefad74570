"""A peer's card is loaded in a child process before this one loads it
(kvstore/transfer/card_vetting.py): real NIXL agents, a real child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import need_nixl
from tests.transfer.nodes import forged_metadata, rma_endpoint

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def peer():
    """A NIXL endpoint whose card the vetter judges."""
    need_nixl()
    mem = np.zeros(1 << 20, dtype=np.uint8)
    endpoint = rma_endpoint(mem)
    yield endpoint
    endpoint.close()


@contextlib.asynccontextmanager
async def _vetting(peer, **options):
    """A vetter with the NIXL this process reads with; its child stopped after."""
    from kvstore.transfer import rma
    from kvstore.transfer.card_vetting import CardVetter

    vetter = CardVetter(rma.nixl_module(), peer.backend, **options)
    try:
        yield vetter
    finally:
        await vetter.close()


def test_a_good_card_passes_a_crashing_one_fails_and_the_child_is_started_again(peer):
    good = peer.card().metadata
    crashing = forged_metadata(good, peer.name, "ucx_address_ff")

    async def run():
        async with _vetting(peer) as vetter:
            soon = time.monotonic() + 60
            verdicts = [
                await vetter.loads(good, soon),
                await vetter.loads(crashing, soon),
                await vetter.loads(good + b"", soon),  # kept: no child asked
                await vetter.loads(forged_metadata(good, peer.name, "agent_name_not_utf8"), soon),
            ]
            return verdicts, vetter.children

    verdicts, children = asyncio.run(run())
    # NIXL loads the non-UTF-8 name (the fetching side refuses it, not the child)
    assert verdicts == [True, False, True, True]
    assert children == 2  # the first died of the crashing card


def test_no_verdict_by_the_deadline_is_none_and_not_kept(peer):
    good = peer.card().metadata

    async def run():
        async with _vetting(peer) as vetter:
            late = await vetter.loads(good, time.monotonic())  # no time for a child to start
            later = await vetter.loads(good, time.monotonic() + 60)
            return late, later, vetter.children

    late, later, children = asyncio.run(run())
    assert late is None and later is True
    assert children in (1, 2)  # the first killed mid-start, or never begun


def _renamed(metadata: bytes, name: str, i: int) -> bytes:
    """The same agent's card under another (valid) name: a card of its own digest."""
    assert metadata.count(name.encode()) == 1
    return metadata.replace(name.encode(), (name[:-3] + f"{i:03x}").encode())


def _card_of_a_process_that_ended() -> bytes:
    """The NIXL card of an endpoint in a process that has ended (its tcp port refuses)."""
    script = (
        "import sys, numpy as np; from tests.transfer.nodes import rma_endpoint; "
        "e = rma_endpoint(np.zeros(1 << 20, dtype=np.uint8)); "
        "sys.stdout.write(e.card().metadata.hex())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True)
    return bytes.fromhex(out.stdout.decode().strip().splitlines()[-1])


def test_what_ucx_logs_to_the_childs_stdout_never_answers_a_card(peer):
    """UCX logs to stdout, the child's answer pipe: a card whose tcp address refuses
    (a peer gone, or a forged card) makes the child write a UCX ERROR line before its
    verdict byte. The bytes after it must not answer later cards: a card that
    kills the child must not be answered by a stale 1 (the store would load it)."""
    unreachable = _card_of_a_process_that_ended()
    good = peer.card().metadata
    crashing = forged_metadata(good, peer.name, "ucx_address_ff")

    async def run():
        async with _vetting(peer) as vetter:
            soon = time.monotonic() + 60
            first = await vetter.loads(unreachable, soon)
            goods = [await vetter.loads(_renamed(good, peer.name, i), soon) for i in range(400)]
            return first, goods, await vetter.loads(crashing, soon)

    first, goods, crash = asyncio.run(run())
    assert first is False
    assert (crash, goods.count(False)) == (False, 0)  # the child died of it; none refused


@pytest.mark.parametrize("level", ["INFO", "DEBUG", ""])
def test_a_nixl_log_level_the_operator_set_does_not_refuse_every_card(peer, monkeypatch, level):
    """NIXL's Python half logs to stdout, the child's answer pipe: with
    NIXL_LOG_LEVEL=INFO (or empty: NIXL's default, INFO) its first line came before
    the child's ready byte, the child was taken as not started and every card
    refused (kept), so no peer was ever read one-sided."""
    monkeypatch.setenv("NIXL_LOG_LEVEL", level)
    good = peer.card().metadata

    async def run():
        async with _vetting(peer) as vetter:
            return await vetter.loads(good, time.monotonic() + 60)

    assert asyncio.run(run()) is True


def test_a_card_out_of_time_before_it_is_asked_leaves_the_idle_child_running(peer):
    """A fetch whose half of the time ran out while it waited for the lock (another
    card being vetted) gets no verdict, but the child, idle and in step, is
    kept: it was killed, and the next card paid for a new child's start."""
    good = peer.card().metadata

    async def run():
        async with _vetting(peer) as vetter:
            first = await vetter.loads(good, time.monotonic() + 60)
            late = await vetter.loads(_renamed(good, peer.name, 1), time.monotonic() - 1)
            after = await vetter.loads(_renamed(good, peer.name, 2), time.monotonic() + 60)
            return first, late, after, vetter.children

    assert asyncio.run(run()) == (True, None, True, 1)


def test_a_child_that_did_not_start_is_no_verdict_on_the_card(peer, monkeypatch, tmp_path):
    """A child that never came up (here NIXL's import fails in it; elsewhere a start
    past START_TIMEOUT_S, or no process to be had) says nothing of the card: its
    False was kept by digest, so that peer stayed two-sided for good after the child
    could start again."""
    from kvstore.transfer import rma

    shadow = tmp_path / rma.nixl_module().split(".")[0]
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('no NIXL in this child')\n")
    good = peer.card().metadata

    async def run():
        async with _vetting(peer, restart_after_s=0) as vetter:
            monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
            first = await vetter.loads(good, time.monotonic() + 60)
            monkeypatch.undo()
            return first, await vetter.loads(good, time.monotonic() + 60), vetter.children

    assert asyncio.run(run()) == (None, True, 2)
