"""A peer's card is loaded in a child process before this one loads it
(kvstore/transfer/card_vetting.py): real NIXL agents, a real child process."""

from __future__ import annotations

import asyncio
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


def _vetter(peer):
    from kvstore.transfer import rma
    from kvstore.transfer.card_vetting import CardVetter

    return CardVetter(rma.nixl_module(), peer.backend)


def test_a_good_card_passes_a_crashing_one_fails_and_the_child_is_started_again(peer):
    good = peer.card().metadata
    crashing = forged_metadata(good, peer.name, "ucx_address_ff")

    async def run():
        vetter = _vetter(peer)
        try:
            soon = time.monotonic() + 60
            verdicts = [
                await vetter.loads(good, soon),
                await vetter.loads(crashing, soon),
                await vetter.loads(good + b"", soon),  # kept: no child asked
                await vetter.loads(forged_metadata(good, peer.name, "agent_name_not_utf8"), soon),
            ]
            return verdicts, vetter.children
        finally:
            await vetter.close()

    verdicts, children = asyncio.run(run())
    # NIXL loads the non-UTF-8 name (the fetching side refuses it, not the child)
    assert verdicts == [True, False, True, True]
    assert children == 2  # the first died of the crashing card


def test_no_verdict_by_the_deadline_is_none_and_not_kept(peer):
    good = peer.card().metadata

    async def run():
        vetter = _vetter(peer)
        try:
            late = await vetter.loads(good, time.monotonic())  # no time for a child to start
            later = await vetter.loads(good, time.monotonic() + 60)
            return late, later, vetter.children
        finally:
            await vetter.close()

    late, later, children = asyncio.run(run())
    assert late is None and later is True
    assert children in (1, 2)  # the first killed mid-start, or never begun
