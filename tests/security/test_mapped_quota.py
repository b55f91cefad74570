"""A certificate's registrations map at most MAX_MAPPED_BYTES_PER_PRINCIPAL of worker
memory together: a sparse memfd costs its worker nothing, and without the bound one
tenant registering memfds of 64 TiB, 32 TiB, ... took the server's whole address
space, every other tenant's registration then refused.

A real TLS store server, tenants with their own certificates, and a real worker
process whose memfds (sparse: no page is touched) they register by ``host_fd``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import StoreClient
from kvstore.testing.raw_client import one_rank_request, register_raw
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import MAX_MAPPED_BYTES_PER_PRINCIPAL
from tests.security.conftest import ADMIN
from tests.service.store_process import reply

BLOCK = 64 << 10
TIB = 1 << 40


def _holder(conn, sizes: list[int]) -> None:
    """A worker process holding one sparse memfd of each size until told to stop."""
    fds = []
    for size in sizes:
        fd = os.memfd_create("kvstore-test-sparse", 0)
        os.ftruncate(fd, size)
        fds.append(fd)
    conn.send(("ok", {"pid": os.getpid(), "fds": fds}))
    conn.recv()
    conn.send(("ok", None))


def _request(instance: str, namespace: str, pid: int, fd: int, size: int):
    """One layer of one block at the end of the memfd: the whole file is mapped."""
    layer = pb.LayerSpec(
        name="layer.0",
        dtype="float16",
        bytes_per_block=BLOCK,
        segments=1,
        kv_layout="NHD",
        layout_kind=pb.BLOCKS_FIRST,
        num_blocks=1,
        block_stride=BLOCK,
        segment_stride=0,
        memory=pb.MemoryHandle(host_fd=pb.HostFd(pid=pid, fd=fd, size=size, offset=size - BLOCK)),
    )
    return one_rank_request(instance, namespace, [layer])


@pytest.fixture
def sparse_memfds():
    """Sparse memfds in another process: 8 TiB, 8 TiB, 4 GiB, 4 GiB, 4 GiB."""
    sizes = [8 * TIB, 8 * TIB, 4 << 30, 4 << 30, 4 << 30]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, sizes), daemon=True)
    proc.start()
    held = reply(conn, 60, "memfd holder")
    yield held["pid"], list(zip(held["fds"], sizes, strict=True))
    conn.send("stop")
    reply(conn, 10, "memfd holder")
    proc.join(10)


def test_one_certificate_maps_at_most_its_quota_others_are_unaffected(
    pki, tls_store, sparse_memfds
):
    assert 16 * TIB == MAX_MAPPED_BYTES_PER_PRINCIPAL
    pid, (big1, big2, small_a, small_b, small_admin) = sparse_memfds
    a = StoreClient(tls_store.address, tls=pki.issue("tenant-a"), timeout=30)
    b = StoreClient(tls_store.address, tls=pki.issue("tenant-b"), timeout=30)
    admin = StoreClient(tls_store.address, tls=pki.issue(ADMIN), timeout=30)
    sessions = []
    try:
        for i, (fd, size) in enumerate((big1, big2)):  # 16 TiB: the whole quota
            sessions.append(register_raw(a, _request(f"a{i}", "tenant-a", pid, fd, size)))
            sessions[-1].wait_sealed(10)
        with pytest.raises(KVError) as refused:
            register_raw(a, _request("a2", "tenant-a", pid, *small_a)).wait_sealed(10)
        assert refused.value.code is Code.RESOURCE_EXHAUSTED
        assert "16 TiB" in refused.value.message and "'tenant-a'" in refused.value.message
        # another tenant, and an admin, register as before
        sessions.append(register_raw(b, _request("b0", "tenant-b", pid, *small_b)))
        sessions[-1].wait_sealed(10)
        sessions.append(register_raw(admin, _request("ops0", "ops", pid, *small_admin)))
        sessions[-1].wait_sealed(10)
        # a rank that leaves gives its bytes back (once the server has seen it go)
        sessions.pop(0).close()
        deadline = time.monotonic() + 15
        while True:
            try:
                sessions.append(register_raw(a, _request("a3", "tenant-a", pid, *small_a)))
                sessions[-1].wait_sealed(10)
                break
            except KVError as e:
                if e.code is not Code.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        for session in sessions:
            session.close()
        for client in (a, b, admin):
            client.close()
