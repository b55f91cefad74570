"""A Load's timeout never leaves the store writing into memory its caller reused.

A copy the store has begun cannot be stopped: its bytes land in the rank's
blocks whether or not anyone still waits. Before, the client's Load timeout was
the gRPC deadline: a copy slowed past it (a stalled store) was given up on, the
engine told the load failed, and it recomputed into those same blocks while the
store went on writing them. Now the timeout bounds when the store may begin a
copy (``start_within_ms``), and the client waits past it for one begun.

A real ``kvstore serve`` process, SIGSTOPped while it copies a Load into this
process's shared memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvstore.client import KVLayer, kv_cache_shm
from kvstore.demo import free_port
from kvstore.wire.errors import Code, KVError
from tests.service.test_peer_fetch import ready

BLOCKS = 256  # saved, then loaded into as many other blocks: 256 MiB a Load


@pytest.fixture
def store():
    port = free_port()
    args = ["serve", "--port", str(port), "--device", "cpu", "--pool-size", "320MiB"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *args, "--no-router", "--no-transfer"],
        stderr=subprocess.DEVNULL,
    )
    client = ready(f"127.0.0.1:{port}", proc)
    yield proc, client
    client.close()
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=10)


def test_a_load_stalled_past_its_timeout_is_waited_for_not_left_writing(store):
    proc, client = store
    shm = kv_cache_shm("kv_first", 2 * BLOCKS, 64, 32, 128)  # 1 MiB a block
    try:
        cache = shm.tensor
        cache[:, :BLOCKS].copy_(torch.randn_like(cache[:, :BLOCKS]))
        layer = KVLayer("model.layers.0.self_attn", cache, "kv_first", "NHD", shm)
        session = client.register("engine", "llama", [layer], block_size=64)
        session.wait_sealed(10)
        session.save([(1000 + i, i) for i in range(BLOCKS)], timeout=60)
        targets = [(1000 + i, BLOCKS + i) for i in range(BLOCKS)]
        with pytest.raises(KVError) as short:  # the store's refusal, not the call's deadline
            session.load(targets, timeout=0.001)
        assert "of the caller's deadline left" in short.value.message, short.value
        assert session.load(targets[:1], timeout=1e8)  # ms past the field's range: capped
        outcome: list = []

        def load() -> None:
            try:
                outcome.append(session.load(targets, timeout=1.0))
            except KVError as exc:
                outcome.append(exc)
            outcome.append(cache[:, BLOCKS:].clone())  # what the blocks hold on return

        caller = threading.Thread(target=load)
        caller.start()
        time.sleep(0.03)  # the store has the call and is copying (~0.1-0.3 s here)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.0)  # past the load's timeout
        os.kill(proc.pid, signal.SIGCONT)
        caller.join(60)
        answer, on_return = outcome
        time.sleep(0.5)  # a copy still going on would change them now
        assert torch.equal(cache[:, BLOCKS:], on_return), "bytes landed after the Load returned"
        if isinstance(answer, KVError):  # stopped before the copy began: refused, none copied
            assert answer.code is Code.DEADLINE_EXCEEDED, answer
            assert "deadline" in answer.message and not on_return.any()
        else:
            assert torch.equal(on_return, cache[:, :BLOCKS])
    finally:
        shm.close()
