"""Stopping is never lost: a cancel that arrives as etcd answers still cancels.

A store's shutdown cancels its etcd tasks (the routers' directory, the lease)
and awaits them. Python 3.11's ``asyncio.wait_for`` returned the inner result
when the caller was cancelled in the same loop pass as that result came back,
and dropped the cancel: the directory then watched on, and the shutdown that
awaited it hung (1 run in 5 of a membership test on a loaded host). kvstore's
own waits no longer drop a cancel; aetcd's still can, so its tasks are
stopped by :func:`cancel_task`, which cancels again until they end. The tests
put the answer and the cancel in one loop pass, so they are deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvstore.membership.etcd import Etcd, EtcdConfig, cancel_task

NOWHERE = EtcdConfig.parse("127.0.0.1:9")  # never dialled: the calls below answer themselves


def cancelled_as_it_answers(call) -> bool:
    """Run ``call(answer)`` as a task, answer and cancel it in one loop pass;
    True when the task ended cancelled, False when it returned the answer."""

    async def go():
        answer = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(call(answer))
        await asyncio.sleep(0)  # the task now awaits the answer
        answer.set_result("answered")
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            return True
        return False

    return asyncio.run(go())


def test_an_etcd_call_cancelled_as_etcd_answers_ends_cancelled():
    async def call(answer):
        etcd = Etcd(NOWHERE)
        try:
            return await etcd._call("get k", lambda client: answer)
        finally:
            await etcd.close()

    assert cancelled_as_it_answers(call)


def test_a_cancel_the_etcd_library_drops_is_raised_after_all():
    """aetcd waits with asyncio.wait_for, which on 3.11 drops such a cancel."""

    async def call(answer):
        etcd = Etcd(NOWHERE)
        try:
            return await etcd._call("get k", lambda client: asyncio.wait_for(answer, 10))
        finally:
            await etcd.close()

    assert cancelled_as_it_answers(call)


def test_an_etcd_call_answered_before_any_cancel_returns_the_answer():
    async def go():
        etcd = Etcd(NOWHERE)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result("answered")
        try:
            return await etcd._call("get k", lambda client: answer)
        finally:
            await etcd.close()

    assert asyncio.run(go()) == "answered"


def test_a_task_that_drops_a_cancel_is_cancelled_again_until_it_ends():
    dropped = []

    async def drops_the_first_cancel():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            dropped.append(True)  # as aetcd's wait_for does when its answer just came
        await asyncio.sleep(60)

    async def go():
        task = asyncio.create_task(drops_the_first_cancel())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_task(task, again_s=0.05), 5)
        return task.cancelled()

    assert asyncio.run(go())
    assert dropped == [True]


def test_a_cancel_of_the_caller_is_passed_on_to_the_task():
    async def drops_the_first_cancel():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        await asyncio.sleep(60)

    async def go():
        task = asyncio.create_task(drops_the_first_cancel())
        await asyncio.sleep(0)
        stopper = asyncio.create_task(cancel_task(task, again_s=60))
        await asyncio.sleep(0.05)  # the task dropped the first cancel
        stopper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopper
        await asyncio.sleep(0)
        return task.done()

    assert asyncio.run(go())


def test_cancel_task_raises_what_the_task_raised():
    async def fails_on_cancel():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("broken on the way out") from None

    async def go():
        task = asyncio.create_task(fails_on_cancel())
        await asyncio.sleep(0)
        await cancel_task(task)

    with pytest.raises(RuntimeError, match="on the way out"):
        asyncio.run(go())
