"""A ``host_fd`` registration must not stall the store server's event loop.

The server opens a worker's descriptor through ``/proc/<pid>/fd/<fd>`` on its
event loop (``RegisterLayers`` maps memory synchronously). A worker that holds a
read lease (``F_SETLEASE F_RDLCK``) on its memfd makes an ``O_RDWR`` open block in
the kernel until the lease holder lets go or ``/proc/sys/fs/lease-break-time``
(45 s by default) passes: every tenant's Save, Load, Query and registration waits
that long, and the worker could do it again at once. Both ``map_host_shm`` and
``map_host_fd`` open with ``O_NONBLOCK``: a leased object fails the open at once
(EWOULDBLOCK) and the registration is refused FAILED_PRECONDITION naming the lease.

The worker here is a real process with a real memfd; the server a real one on
loopback.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

from kvstore.client.store_client import StoreClient
from kvstore.testing.raw_client import register_raw
from kvstore.wire.errors import Code, KVError
from tests.service.store_process import reply
from tests.service.test_memfd import FILE_BYTES, OFFSETS, _request

F_SETLEASE = 1024  # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 0)


def _leasing_worker(conn) -> None:
    """A worker whose KV memfd is held open read-only under a read lease."""
    try:
        signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break notice: ignored
        memfd = os.memfd_create("kvstore-test-leased", 0)
        os.ftruncate(memfd, FILE_BYTES)
        ro = os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY)
        os.close(memfd)  # only the read-only descriptor stays: a read lease needs that
        fcntl.fcntl(ro, F_SETLEASE, fcntl.F_RDLCK)
        conn.send(("ok", {"pid": os.getpid(), "memfd": ro, "size": FILE_BYTES,
                          "offsets": OFFSETS}))  # fmt: skip
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op = conn.recv()
        if op == "release":
            try:
                fcntl.fcntl(ro, F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass
            conn.send(("ok", None))
        elif op == "stop":
            conn.send(("ok", None))
            return


def test_a_leased_host_fd_does_not_block_the_server_loop(server):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_leasing_worker, args=(child,), daemon=True)
    proc.start()
    h = reply(conn, 60, "leasing worker")
    client = StoreClient(server.address)
    outcome: dict = {}

    def register() -> None:
        started = time.monotonic()
        try:
            outcome["session"] = register_raw(client, _request(h, "leased"))
        except Exception as exc:  # a refusal is the expected answer
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    caller = threading.Thread(target=register, daemon=True)
    try:
        caller.start()
        time.sleep(1.0)  # the registration reaches the server and opens the descriptor
        started = time.monotonic()
        try:
            server.run(_noop(), timeout=5)
            answered = time.monotonic() - started
        except TimeoutError:
            answered = None
        assert answered is not None, (
            "the store server's event loop did not run for 5 s while a worker's "
            "leased memfd was being opened (blocked in open(/proc/<pid>/fd/<fd>))"
        )
        caller.join(10)
        assert not caller.is_alive(), "RegisterLayers did not answer within 10 s"
        error = outcome.get("error")
        assert isinstance(error, KVError) and error.code is Code.FAILED_PRECONDITION, outcome
        assert "file lease" in error.message and "host_fd.fd" in error.message
    finally:
        conn.send("release")  # let a blocked open finish so the server can stop
        reply(conn, 10, "leasing worker")
        caller.join(60)
        if "session" in outcome:
            outcome["session"].close()
        client.close()
        conn.send("stop")
        proc.join(10)


async def _noop() -> None:
    return None
