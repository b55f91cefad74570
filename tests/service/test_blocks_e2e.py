"""Save / query / load through a real server with real worker processes."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.store_client import StoreClient, call
from kvstore.testing.worker import WorkerGroup
from kvstore.wire.errors import KVError
from kvstore.wire.events import StoreEvent
from tests.conftest import wait_for

LAYOUT = dict(layers=4, heads=4, head_dim=32, block_size=4, num_blocks=32)


def instance(server, name, tp_size=2, **kw):
    group = WorkerGroup(server.address, name, tp_size, **{**LAYOUT, **kw})
    return group, group.namespace


def collect_events(server, out: list, stop: threading.Event):
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(server.address))
    call = stub.Events(pb.EventsRequest())

    def reader():
        try:
            for ev in call:
                out.append(StoreEvent.decode(ev.payload))
        except grpc.RpcError:
            pass

    threading.Thread(target=reader, daemon=True).start()
    return call


def test_save_in_one_instance_load_in_another_every_byte(server):
    events: list[StoreEvent] = []
    sub = collect_events(server, events, threading.Event())
    a, ns = instance(server, "a")
    b, ns_b = instance(server, "b")
    try:
        assert ns == ns_b
        a.each("fill", [(1000 + i, i) for i in range(8)])
        saved = a.each("save", [(500 + i, i) for i in range(8)])
        assert [r["written"] for r in saved] == [8, 8]
        assert sum(r["sealed"] for r in saved) == 8
        client = StoreClient(server.address)
        hit = client.query(ns, [500 + i for i in range(10)], lease=True)
        assert hit.prefix_blocks == 8 and hit.lease_id
        b.each("load", [(500 + i, 16 + i) for i in range(8)])
        assert b.each("digest", list(range(16, 24))) == a.each("digest", list(range(8)))
        assert client.release(hit.lease_id) == 8
        stats = client.stats()
        assert stats.sealed_blocks == 8 and stats.hits == 8 and stats.misses == 2
        assert stats.bytes_saved == stats.bytes_loaded > 0
        assert wait_for(lambda: sum(len(e.block_hashes) for e in events) == 8)  # batched
        assert {e.type for e in events} == {"stored"} and events[0].namespace == ns
        assert sorted(h for e in events for h in e.block_hashes) == [500 + i for i in range(8)]
        stored = len(events)
        assert client.clear(ns) == 8
        assert client.query(ns, [500]).prefix_blocks == 0 and client.stats().used_bytes == 0
        assert wait_for(lambda: len(events) == stored + 1)
        assert events[-1].type == "cleared" and events[-1].namespace == ns
    finally:
        sub.cancel()
        a.close()
        b.close()


def test_rank_cannot_act_for_another_and_bad_ids_write_nothing(server):
    a, _ns = instance(server, "a")
    try:
        with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT.*block_id 99"):
            a[0].call("save", [(1, 99)])
        with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT.*twice"):
            a[0].call("save", [(1, 0), (1, 1)])
        client = StoreClient(server.address)
        session = a[0].session
        with pytest.raises(KVError, match="not the caller's"):
            call(
                client.stub.Save,
                pb.SaveRequest(
                    instance_id="a", rank=1, session=session, block_hashes=[1], block_ids=[0]
                ),
                5,
            )
        assert client.stats().used_bytes == 0
        a.each("save", [(1, 0), (2, 1)])  # a load into one block_id twice is refused
        with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT.*block_id 5 is the target"):
            a[0].call("load", [(1, 5), (2, 5)])
        assert client.stats().bytes_loaded == 0
    finally:
        a.close()


def test_killed_writer_leaves_nothing_visible(server):
    a, ns = instance(server, "a")
    try:
        a[0].call("save", [(7, 0), (8, 1)])
        client = StoreClient(server.address)
        assert client.stats().inflight_blocks == 2
        a[0].kill()
        assert wait_for(lambda: client.stats().inflight_blocks == 0)
        assert client.stats().used_bytes == 0
        assert client.query(ns, [7, 8]).prefix_blocks == 0
    finally:
        a.close()


def test_concurrent_instances_save_and_load_every_byte(server):
    insts = [instance(server, f"i{k}", num_blocks=48) for k in range(3)]
    try:
        # every instance saves its own blocks and one shared run of blocks at once
        for k, (ws, _) in enumerate(insts):
            for w in ws.workers:
                w.conn.send(
                    (
                        "fill",
                        [(9000 + j, j) for j in range(8)]
                        + [(k * 100 + j, 8 + j) for j in range(8)],
                    )
                )
        for ws, _ in insts:
            [w.reply() for w in ws]
        for k, (ws, _) in enumerate(insts):
            for w in ws.workers:
                w.conn.send(
                    (
                        "save",
                        [(9000 + j, j) for j in range(8)]
                        + [(k * 100 + j, 8 + j) for j in range(8)],
                    )
                )
        for ws, _ in insts:
            [w.reply() for w in ws]
        ns = insts[0][1]
        client = StoreClient(server.address)
        assert client.stats().sealed_blocks == 8 + 3 * 8
        # now every instance loads every other instance's blocks at once
        for k, (ws, _) in enumerate(insts):
            other = (k + 1) % 3
            for w in ws.workers:
                w.conn.send(
                    (
                        "load",
                        [(other * 100 + j, 24 + j) for j in range(8)]
                        + [(9000 + j, 32 + j) for j in range(8)],
                    )
                )
        for ws, _ in insts:
            [w.reply() for w in ws]
        for k, (ws, _) in enumerate(insts):
            other = insts[(k + 1) % 3][0]
            assert ws.each("digest", list(range(24, 32))) == other.each(
                "digest", list(range(8, 16))
            )
            assert ws.each("digest", list(range(32, 40))) == ws.each("digest", list(range(8)))
        assert client.query(ns, [9000 + j for j in range(8)]).prefix_blocks == 8
    finally:
        for ws, _ in insts:
            ws.close()


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_blocks", [False, True], ids=["pieces", "blocks"])
def test_gpu_save_and_load_through_cuda_ipc(gpu_blocks):
    """Workers with CUDA KV caches shared by IPC handle; the pool on the GPU; the
    copies by planned pieces and by blocks (``--gpu-copy``)."""
    from tests.conftest import ServerThread

    server = ServerThread(pool_size=256 << 20, device="cuda:0", gpu_blocks=gpu_blocks)
    try:
        a = WorkerGroup(server.address, "ga", 2, device="cuda", **LAYOUT)
        b = WorkerGroup(server.address, "gb", 2, device="cuda", **LAYOUT)
        try:
            a.each("fill", [(3000 + i, i) for i in range(8)])
            a.each("save", [(700 + i, i) for i in range(8)])
            b.each("load", [(700 + i, 20 + i) for i in range(8)])
            assert b.each("digest", list(range(20, 28))) == a.each("digest", list(range(8)))
        finally:
            a.close()
            b.close()
    finally:
        server.stop()
