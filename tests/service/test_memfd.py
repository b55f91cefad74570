"""The ``host_fd`` memory handle: a worker's memfd (or unlinked /dev/shm file) mapped by
the store server through /proc/<pid>/fd/<fd>, over a real server and real processes.

Workers run in their own processes (a descriptor of the server's own process is
refused), allocate their KV cache in a memfd at a non-zero offset with guard bytes
around it, register it through the product client (``MemfdKVLayer``), and answer
the parent's commands over a pipe.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from kvstore._proto import store_pb2 as pb
from kvstore.client.shared_memory import host_fd_of
from kvstore.client.store_client import StoreClient
from kvstore.integrations.sglang.layers import MemfdKVLayer
from kvstore.testing.raw_client import one_rank_request, register_raw
from kvstore.wire.errors import Code, KVError
from tests.service.store_process import reply

BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 6, 4, 2, 16
SHAPE = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)  # kv_first, float16
LAYER_BYTES = 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM * 2
OFFSETS = (4096 + 64, 4096 + 64 + LAYER_BYTES + 128)  # two layers, guard bytes around both
FILE_BYTES = OFFSETS[1] + LAYER_BYTES + 4096
GUARD = 0xA5


class MemfdRank:
    """A worker whose KV cache (two layers) lives in one shared-memory file it holds open."""

    def __init__(self, kind: str, fill_seed: int | None):
        if kind == "memfd":
            self.fd = os.memfd_create("kvstore-test-kv", os.MFD_CLOEXEC)
        else:  # SGLang's fallback: a /dev/shm file, unlinked at once, kept open
            path = f"/dev/shm/kvstore-test-{os.getpid()}"
            self.fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
            os.unlink(path)
        os.ftruncate(self.fd, FILE_BYTES)
        self.mm = mmap.mmap(self.fd, FILE_BYTES, mmap.MAP_SHARED)
        self.raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.raw.fill_(GUARD)
        self.tensors = [
            self.raw[o : o + LAYER_BYTES].view(torch.float16).view(SHAPE) for o in OFFSETS
        ]
        if fill_seed is not None:
            g = torch.Generator().manual_seed(fill_seed)
            for t in self.tensors:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        else:
            for t in self.tensors:
                t.zero_()
        self.pipe = os.pipe()
        self.disk = open(f"/tmp/kvstore-test-disk-{os.getpid()}", "w+b")  # noqa: SIM115
        self.disk.truncate(FILE_BYTES)
        self.client = self.session = None

    def handles(self) -> dict:
        """Descriptors of this process a registration may name."""
        return {
            "pid": os.getpid(),
            "memfd": self.fd,
            "pipe": self.pipe[0],
            "disk": self.disk.fileno(),
            "closed": 4000,  # above the default descriptor limit: never open
            "size": FILE_BYTES,
            "offsets": OFFSETS,
        }

    def register(self, address: str, instance: str, close_fd: bool) -> str:
        self.client = StoreClient(address)
        host_fd = host_fd_of(self.tensors[0])
        layers = [
            MemfdKVLayer(f"layer.{i}", t, "kv_first", "NHD", host_fd=host_fd)
            for i, t in enumerate(self.tensors)
        ]
        self.session = self.client.register(instance, "memfd", layers, block_size=BLOCK_SIZE)
        namespace = self.session.wait_sealed(20).final_namespace
        if close_fd:  # the server holds its own reference to the file now
            os.close(self.fd)
        return namespace

    def save(self, pairs):
        r = self.session.save(pairs)
        return r.written, r.sealed

    def load(self, pairs):
        return self.session.load(pairs).bytes

    def dump(self) -> bytes:
        return self.raw.numpy().tobytes()

    def close(self):
        if self.session is not None:
            self.session.close()
            self.client.close()
        self.disk.close()
        os.unlink(self.disk.name)


def _serve(conn, args) -> None:
    try:
        obj = MemfdRank(*args)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, call_args = conn.recv()
        try:
            conn.send(("ok", getattr(obj, op)(*call_args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if op == "close":
            return


class Worker:
    def __init__(self, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, args), daemon=True)
        self.proc.start()
        self._reply()

    def _reply(self):
        return reply(self.conn, 60, "worker")

    def __getattr__(self, op):
        def call(*args):
            self.conn.send((op, args))
            return self._reply()

        return call

    def stop(self):
        if self.proc.is_alive():
            self.close()
            self.proc.join(10)


@pytest.fixture
def workers():
    made: list[Worker] = []

    def make(*args) -> Worker:
        made.append(Worker(*args))
        return made[-1]

    yield make
    for w in made:
        w.stop()


@pytest.mark.parametrize("kind", ["memfd", "dev_shm_unlinked"])
def test_every_byte_round_trips_between_processes(server, workers, kind):
    a = workers(kind, 1)
    b = workers(kind, None)
    before_b = b.dump()
    ns_a = a.register(server.address, "a", True)  # a closes its descriptor after registering
    ns_b = b.register(server.address, "b", False)
    assert ns_a == ns_b and ns_a.startswith("memfd.")

    pairs = [(1000 + i, i) for i in range(BLOCKS)]
    assert a.save(pairs) == (BLOCKS, BLOCKS)
    shuffled = [(1000 + i, (i + 2) % BLOCKS) for i in range(BLOCKS)]  # other page ids
    assert b.load(shuffled) == 2 * LAYER_BYTES  # every block of both layers

    raw_a, raw_b = a.dump(), b.dump()
    for o in OFFSETS:
        seg_a = torch.frombuffer(bytearray(raw_a[o : o + LAYER_BYTES]), dtype=torch.uint8)
        seg_b = torch.frombuffer(bytearray(raw_b[o : o + LAYER_BYTES]), dtype=torch.uint8)
        seg_a, seg_b = seg_a.view(2, BLOCKS, -1), seg_b.view(2, BLOCKS, -1)
        assert seg_a.any()
        for i in range(BLOCKS):
            assert torch.equal(seg_b[:, (i + 2) % BLOCKS], seg_a[:, i]), (o, i)
    # nothing outside the two layers was written
    outside = [(0, OFFSETS[0]), (OFFSETS[0] + LAYER_BYTES, OFFSETS[1])]
    outside.append((OFFSETS[1] + LAYER_BYTES, FILE_BYTES))
    for lo, hi in outside:
        assert raw_b[lo:hi] == before_b[lo:hi] == bytes([GUARD]) * (hi - lo)


def _request(h: dict, instance: str, **memory) -> pb.RegisterLayersRequest:
    """Two layers in the worker's memfd, with ``memory`` fields of the handle changed."""
    layers = []
    for i, offset in enumerate(h["offsets"]):
        fields = {"pid": h["pid"], "fd": h["memfd"], "size": h["size"], "offset": offset}
        handle = pb.HostFd(**{**fields, **memory})
        layers.append(
            pb.LayerSpec(
                name=f"layer.{i}",
                dtype="float16",
                bytes_per_block=LAYER_BYTES // BLOCKS,
                segments=2,
                kv_layout="NHD",
                layout_kind=pb.KV_FIRST,
                num_blocks=BLOCKS,
                block_stride=LAYER_BYTES // BLOCKS // 2,
                segment_stride=LAYER_BYTES // 2,
                memory=pb.MemoryHandle(host_fd=handle),
            )
        )
    return one_rank_request(instance, "memfd", layers, BLOCK_SIZE)


def _server_thread() -> int:
    """A thread id of this process (the server runs in it) other than its pid."""
    return next(int(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid())


def _pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


BAD = {
    "pid unset": (lambda h: {"pid": 0}, "host_fd.pid is not set"),
    "no such pid": (lambda h: {"pid": _pid_max()}, "host_fd.pid"),
    "server's own pid": (lambda h: {"pid": os.getpid()}, "is the store server itself"),
    "a thread of the server": (lambda h: {"pid": _server_thread()}, "is the store server itself"),
    "fd not open": (lambda h: {"fd": h["closed"]}, "host_fd.fd 4000 is not open"),
    "fd is a pipe": (lambda h: {"fd": h["pipe"]}, "not shared memory"),
    "fd is a disk file": (lambda h: {"fd": h["disk"]}, "not shared memory"),
    "size past the file": (lambda h: {"size": h["size"] + 1}, "host_fd.size"),
    "size zero": (lambda h: {"size": 0}, "host_fd.size 0"),
    "offset past the file": (lambda h: {"offset": h["size"] - 64}, "offset"),
}


def test_bad_host_fd_is_invalid_argument_naming_the_field(server, workers):
    w = workers("memfd", 1)
    h = w.handles()
    client = StoreClient(server.address)
    try:
        for case, (change, words) in BAD.items():
            with pytest.raises(KVError) as info:
                register_raw(client, _request(h, "bad", **change(h)))
            assert info.value.code is Code.INVALID_ARGUMENT, (case, info.value)
            assert words in info.value.message, (case, info.value.message)
            assert "layer 'layer.0'" in info.value.message, (case, info.value.message)
            assert server.call(lambda: server.server.registry.instances.get("bad")) is None
        session = register_raw(client, _request(h, "bad"))  # the corrected request seals
        assert session.wait_sealed(10).final_namespace.startswith("memfd.")
        session.close()
    finally:
        client.close()
