"""Cross-node fetch: real store server processes, a real router, UCX on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import StoreClient, call
from kvstore.demo import free_port
from kvstore.testing.worker import WorkerGroup
from kvstore.wire.errors import Code, KVError
from tests.conftest import wait_for

pytest.importorskip("ucxx")

LAYOUT = dict(layers=4, heads=4, head_dim=32, block_size=4, num_blocks=32)


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstore", *args, "--log-level", "warning"])


def ready(address: str, proc: subprocess.Popen) -> StoreClient:
    client = StoreClient(address, timeout=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{address} exited with {proc.returncode}"
        try:
            client.stats()
            return client
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(address)


def wait_healthy(address: str, proc: subprocess.Popen) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{address} exited with {proc.returncode}"
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            return
        except grpc.RpcError:
            time.sleep(0.2)
    raise TimeoutError(address)


@pytest.fixture
def cluster():
    """A standalone router and three store servers advertising to it."""
    rport = free_port()
    procs = [spawn("router", "--port", str(rport))]
    stores = []
    try:
        wait_healthy(f"127.0.0.1:{rport}", procs[0])
        for i in range(3):
            port = free_port()
            procs.append(
                spawn(
                    "serve",
                    "--port",
                    str(port),
                    "--device",
                    "cpu",
                    "--pool-size",
                    "64MiB",
                    "--router",
                    f"127.0.0.1:{rport}",
                    "--node-id",
                    f"node{i}",
                    "--fetch-timeout",
                    "5",
                )
            )
            address = f"127.0.0.1:{port}"
            stores.append((address, ready(address, procs[-1]), procs[-1]))
        yield stores
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def instance(address, name, **kw):
    group = WorkerGroup(address, name, 2, **{**LAYOUT, **kw})
    return group, group.namespace


def test_fetch_from_peer_every_byte_and_other_layouts_never_asked(cluster):
    (a_addr, a, _), (b_addr, b, _), (c_addr, c, _) = cluster
    src, ns = instance(a_addr, "src")
    mtp, ns_mtp = instance(c_addr, "mtp", extra_layers=1)  # same hashes, other layout
    dst, ns_b = instance(b_addr, "dst")
    try:
        assert ns == ns_b != ns_mtp
        hashes = [7000 + i for i in range(12)]
        for group in (src, mtp):
            group.each("fill", [(h, i) for i, h in enumerate(hashes)])
            group.each("save", [(h, i) for i, h in enumerate(hashes)])
        assert wait_for(lambda: _router_knows(b_addr, ns, hashes), timeout=15)
        served = a.stats().served_blocks
        with pytest.raises(KVError) as err:  # one hash 8 times: refused before any peer is asked
            call(
                b.stub.Prefetch, pb.PrefetchRequest(namespace=ns, block_hashes=[hashes[1]] * 8), 10
            )
        assert err.value.code is Code.INVALID_ARGUMENT and "block_hashes" in err.value.message
        assert a.stats().served_blocks == served and b.stats().sealed_blocks == 1
        dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert dst.each("digest", list(range(16, 28))) == src.each("digest", list(range(12)))
        sb = b.stats()
        assert sb.fetched_blocks == 12 and sb.sealed_blocks == 12
        assert a.stats().served_blocks == 12
        assert c.stats().served_blocks == 0  # the other fingerprint was never asked
        assert b.query(ns, hashes).prefix_blocks == 12  # next load hits locally
    finally:
        for group in (src, mtp, dst):
            group.close()


def _router_knows(b_addr, ns, hashes) -> bool:
    client = StoreClient(b_addr)
    try:
        r = call(
            client.stub.Prefetch, pb.PrefetchRequest(namespace=ns, block_hashes=hashes[:1]), 10
        )
        return r.fetched_blocks + r.local_blocks == 1
    except Exception:
        return False


def test_dead_peer_fails_within_timeout_and_leaves_nothing(cluster):
    """A dead peer costs the load that asked it; the fetching store keeps fetching
    from the others (issue 11 item 6)."""
    (a_addr, _a, a_proc), (b_addr, b, _), (c_addr, c, _) = cluster
    src, _ns = instance(a_addr, "src")
    dst, ns = instance(b_addr, "dst")
    other = None
    try:
        hashes = [9000 + i for i in range(6)]
        src.each("fill", [(h, i) for i, h in enumerate(hashes)])
        src.each("save", [(h, i) for i, h in enumerate(hashes)])
        time.sleep(1.0)  # events reach the router
        a_proc.kill()
        a_proc.wait(timeout=10)
        used = b.stats().used_bytes
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED"):
            dst[0].call("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert time.monotonic() - t0 < 30
        stats = b.stats()
        assert stats.sealed_blocks == 0 and stats.inflight_blocks == 0
        assert stats.used_bytes == used

        # Another peer holds the same blocks: the next load fetches them from it.
        other, ns_c = instance(c_addr, "src2")
        assert ns_c == ns
        other.each("fill", [(h, i) for i, h in enumerate(hashes)])
        other.each("save", [(h, i) for i, h in enumerate(hashes)])
        assert wait_for(lambda: _router_knows(b_addr, ns, hashes), timeout=20)
        dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert dst.each("digest", list(range(16, 22))) == other.each("digest", list(range(6)))
        assert b.stats().fetched_blocks == 6 and c.stats().served_blocks == 6
    finally:
        for group in (src, dst, other):
            if group is not None:
                group.close()


@pytest.mark.gpu
def test_gpu_pools_fetch_gpu_to_gpu_every_byte():
    """Two servers with GPU pools and GPU workers, peers by --peer: the fetch goes
    pool to pool over UCX (CUDA IPC on one GPU), then into the worker by the CUDA kernel."""
    ports = [free_port() for _ in range(4)]
    a_addr, b_addr = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
    common = ("--device", "cuda:0", "--pool-size", "256MiB", "--fetch-timeout", "20")
    procs = [
        spawn("serve", "--port", str(ports[0]), "--ucx-port", str(ports[2]), *common),
        spawn(
            "serve",
            "--port",
            str(ports[1]),
            "--ucx-port",
            str(ports[3]),
            *common,
            "--peer",
            f"127.0.0.1:{ports[2]}",
        ),
    ]
    try:
        a, b = ready(a_addr, procs[0]), ready(b_addr, procs[1])
        src = WorkerGroup(a_addr, "gsrc", 2, device="cuda", **LAYOUT)
        dst = WorkerGroup(b_addr, "gdst", 2, device="cuda", **LAYOUT)
        try:
            hashes = [5000 + i for i in range(10)]
            src.each("fill", [(h, i) for i, h in enumerate(hashes)])
            src.each("save", [(h, i) for i, h in enumerate(hashes)])
            dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes)])
            assert dst.each("digest", list(range(16, 26))) == src.each("digest", list(range(10)))
            assert b.stats().fetched_blocks == 10 and a.stats().served_blocks == 10
        finally:
            src.close()
            dst.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
