"""A real store server in its own process, whose file descriptors and address space a
test can run short, as an operator's limits would (``resource.setrlimit`` inside it).

The server runs on loopback in a spawned child (``ServerThread`` there); the test
process is a worker of another pid, as in production. Commands travel over a pipe:
``starve_files(free)`` leaves exactly ``free`` descriptors the server may still open,
``limit_memory(headroom)`` caps its address space ``headroom`` bytes above what it
maps now, ``restore()`` undoes both (what the store's operator does).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import resource
import traceback

CONFIG = {"pool_size": 64 << 20, "device": "cpu", "slab_bytes": 4 << 20, "transfer": False}


def reply(conn, timeout_s: float, who: str):
    """The value a helper process sent back as ("ok", value); its traceback
    (anything else) raised as RuntimeError."""
    assert conn.poll(timeout_s), f"{who} did not answer"
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(value)
    return value


class _Limits:
    """The child's side: descriptors held open and the limits to put back."""

    def __init__(self):
        self.held: list[int] = []
        self.saved = {
            r: resource.getrlimit(r) for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS)
        }

    def starve_files(self, free: int) -> None:
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        _, hard = self.saved[resource.RLIMIT_NOFILE]
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 64, hard))  # a short table to fill
        while True:
            try:
                self.held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                break
        for _ in range(free):
            os.close(self.held.pop())

    def limit_memory(self, headroom: int) -> None:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        _, hard = self.saved[resource.RLIMIT_AS]
        resource.setrlimit(resource.RLIMIT_AS, ((kib << 10) + headroom, hard))

    def restore(self) -> None:
        for rlimit, value in self.saved.items():
            resource.setrlimit(rlimit, value)
        while self.held:
            os.close(self.held.pop())


def _serve(conn) -> None:
    from tests.conftest import ServerThread

    server = ServerThread(**CONFIG)
    limits = _Limits()
    conn.send(("ok", server.address))
    while True:
        op, args = conn.recv()
        try:
            result = server.stop() if op == "stop" else getattr(limits, op)(*args)
            conn.send(("ok", result))
        except Exception as exc:  # the test sees it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if op == "stop":
            return


class StoreProcess:
    """The parent's side: the server's address and pid, and the commands above."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        self.address = self._reply()

    def _reply(self):
        return reply(self.conn, 120, "store process")

    def _do(self, op: str, *args):
        self.conn.send((op, args))
        return self._reply()

    def starve_files(self, free: int = 0) -> None:
        self._do("starve_files", free)

    def limit_memory(self, headroom: int) -> None:
        self._do("limit_memory", headroom)

    def restore(self) -> None:
        self._do("restore")

    def maps(self, shm_name: str) -> bool:
        """Whether the server has ``/dev/shm/<shm_name>`` mapped."""
        with open(f"/proc/{self.proc.pid}/maps") as f:
            return any(line.rstrip().endswith(f"/dev/shm/{shm_name}") for line in f)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.restore()
            self._do("stop")
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
