"""Cross-node fetch: real store server processes, a real router, UCX on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import StoreClient, call
from kvstore.demo import free_ports
from kvstore.testing.worker import WorkerGroup
from kvstore.wire.errors import Code, KVError
from tests.conftest import need_nixl, wait_for

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
    rport, *store_ports = free_ports(4)
    procs = [spawn("router", "--port", str(rport))]
    stores = []
    try:
        wait_healthy(f"127.0.0.1:{rport}", procs[0])
        for i, port in enumerate(store_ports):
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
            stores.append((f"127.0.0.1:{port}", procs[-1]))  # the three start at once
        yield [(address, ready(address, proc), proc) for address, proc in stores]
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
    """Two servers with GPU pools and GPU workers, peers by --peer, two-sided: the fetch
    goes pool to pool over UCX (CUDA IPC on one GPU), then into the worker by the CUDA
    kernel."""
    ports = free_ports(4)
    a_addr, b_addr = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
    common = ("--device", "cuda:0", "--pool-size", "256MiB", "--fetch-timeout", "20", "--no-rma")
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


# ---- one-sided reads (NIXL) between real store servers ---------------------------------


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def pair():
    """``pair(a_flags, b_flags, device)``: stores a (serving) and b (fetching from a by
    --peer), pools on ``device``, each with /metrics; returns ((address, client, metrics
    port), ...) for both."""
    procs, argv = [], []

    def start(a_flags=(), b_flags=(), device="cpu"):
        ports = free_ports(6)
        for i, flags in enumerate((a_flags, b_flags)):  # both start at once
            args = ["serve", "--port", str(ports[i]), "--ucx-port", str(ports[2 + i])]
            args += ["--metrics-port", str(ports[4 + i]), "--device", device]
            args += ["--pool-size", "64MiB", "--fetch-timeout", "5", *flags]
            if i == 1:
                args += ["--peer", f"127.0.0.1:{ports[2]}"]
            procs.append(spawn(*args))
            argv.append(args)
        addresses = [f"127.0.0.1:{ports[i]}" for i in range(2)]
        return [
            (a, ready(a, p), ports[4 + i]) for i, (a, p) in enumerate(zip(addresses, procs[-2:]))
        ]

    def restart(i: int) -> StoreClient:
        """Kill store ``i`` and start it again on the same ports."""
        procs[i].kill()
        procs[i].wait(timeout=10)
        procs[i] = spawn(*argv[i])
        return ready(f"127.0.0.1:{argv[i][2]}", procs[i])

    start.restart = restart
    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _fetch_and_compare(a_addr, b_addr, name, hashes, **layout) -> None:
    src = WorkerGroup(a_addr, name, 2, **{**LAYOUT, **layout})
    dst = WorkerGroup(b_addr, name, 2, **{**LAYOUT, **layout})
    try:
        src.each("fill", [(h, i) for i, h in enumerate(hashes)])
        src.each("save", [(h, i) for i, h in enumerate(hashes)])
        n = len(hashes)
        dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert dst.each("digest", list(range(16, 16 + n))) == src.each("digest", list(range(n)))
    finally:
        src.close()
        dst.close()


def test_one_sided_fetch_between_stores_every_byte(pair):
    """Slots of 1, 4 and 16 KiB read one-sided; each lease RELEASEd (pins back to 0)."""
    need_nixl()
    (a_addr, a, a_metrics), (b_addr, _b, b_metrics) = pair()
    shapes = [dict(head_dim=32), dict(head_dim=128), dict(head_dim=128, block_size=16)]
    for k, shape in enumerate(shapes):
        _fetch_and_compare(a_addr, b_addr, f"m{k}", [100 * k + i for i in range(10)], **shape)
    mb, ma = scrape(b_metrics), scrape(a_metrics)
    assert mb["kvstore_store_fetcher_fetches_rma_total"] == 3
    assert mb["kvstore_store_fetcher_fetches_failed_rma_total"] == 0
    assert mb["kvstore_store_fetcher_fetched_blocks_total"] == 30
    assert ma["kvstore_peer_port_rma_leases_total"] == 3
    assert ma["kvstore_peer_port_rma_leases_expired_total"] == 0
    assert ma["kvstore_peer_port_pinned_blocks"] == 0
    assert a.stats().served_blocks == 30


@pytest.mark.gpu
def test_gpu_pools_fetch_one_sided_every_byte(pair):
    """GPU pools registered with NIXL as VRAM: the fetch reads pool to pool one-sided
    (CUDA IPC on one GPU), then into the workers by the CUDA kernel."""
    need_nixl()
    (a_addr, a, a_metrics), (b_addr, _b, b_metrics) = pair(device="cuda:0")
    _fetch_and_compare(a_addr, b_addr, "g", [700 + i for i in range(10)], device="cuda")
    mb, ma = scrape(b_metrics), scrape(a_metrics)
    assert mb["kvstore_store_fetcher_fetches_rma_total"] == 1
    assert mb["kvstore_store_fetcher_fetches_failed_rma_total"] == 0
    assert ma["kvstore_peer_port_rma_leases_total"] == 1
    assert ma["kvstore_peer_port_pinned_blocks"] == 0
    assert a.stats().served_blocks == 10


def test_peer_restarted_at_the_same_address_is_read_one_sided_at_once(pair):
    """The fetching store cached the peer's card; the peer restarts on the same
    ports with a new NIXL agent. The next fetch's new connection asks for the
    card again, sees it changed, loads it: no failed one-sided read."""
    need_nixl()
    (a_addr, _a, _), (b_addr, _b, b_metrics) = pair()
    _fetch_and_compare(a_addr, b_addr, "m0", [400 + i for i in range(4)])
    pair.restart(0)
    _fetch_and_compare(a_addr, b_addr, "m1", [500 + i for i in range(4)])
    mb = scrape(b_metrics)
    assert mb["kvstore_store_fetcher_fetches_failed_rma_total"] == 0
    assert mb["kvstore_store_fetcher_fetches_rma_total"] == 2
    assert mb["kvstore_store_fetcher_fetched_blocks_total"] == 8


@pytest.mark.parametrize("side", ["serving", "fetching"])
def test_no_rma_on_either_side_fetches_two_sided(pair, side):
    flags = ("--no-rma",)
    (a_addr, _a, a_metrics), (b_addr, b, b_metrics) = (
        pair(a_flags=flags) if side == "serving" else pair(b_flags=flags)
    )
    _fetch_and_compare(a_addr, b_addr, "m", [300 + i for i in range(6)])
    mb, ma = scrape(b_metrics), scrape(a_metrics)
    assert mb["kvstore_store_fetcher_fetches_rma_total"] == 0
    assert mb["kvstore_store_fetcher_fetched_blocks_total"] == 6
    assert ma["kvstore_peer_port_rma_leases_total"] == 0
    assert b.stats().fetched_blocks == 6


@pytest.mark.parametrize("flags", [(), ("--no-rma",)], ids=["one-sided", "two-sided"])
def test_peer_with_a_shorter_prefix_leaves_no_slot_reserved(pair, flags):
    """The peer (a --peer: what it holds is not known) holds 4 of 10 asked: 4 are
    fetched and the store holds exactly their slots, nothing else reserved."""
    (a_addr, a, _), (b_addr, b, _) = pair(b_flags=flags)
    hashes = [900 + i for i in range(10)]
    src = WorkerGroup(a_addr, "short", 2, **LAYOUT)
    dst = WorkerGroup(b_addr, "short", 2, **LAYOUT)
    try:
        src.each("fill", [(h, i) for i, h in enumerate(hashes[:4])])
        src.each("save", [(h, i) for i, h in enumerate(hashes[:4])])
        reply = b.prefetch(dst.namespace, hashes)
        assert (reply.local_blocks, reply.fetched_blocks) == (0, 4)
        stats = b.stats()
        assert stats.sealed_blocks == 4 and stats.inflight_blocks == 0
        assert stats.used_bytes == a.stats().used_bytes > 0  # the same 4 blocks, no more
        assert b.query(dst.namespace, hashes).prefix_blocks == 4
        dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes[:4])])
        assert dst.each("digest", list(range(16, 20))) == src.each("digest", list(range(4)))
    finally:
        src.close()
        dst.close()
