"""Host memory a rank names is checked against the node's user behind its socket.

The store opens a /dev/shm object, or a worker's descriptor through /proc, with
its own rights (root's here). Before the check, a process running as uid 65534
registered root's 0600 shared memory by name, Saved its bytes into the pool and
Loaded them into its own memory; a Load the other way overwrote it.

A real store server on a loopback port (this process, root); the other user is
a stdlib TCP relay run as uid 65534 (``nobody``) between this test's client and
the store, so the store sees a connection whose socket that user owns, exactly
what it sees of a worker process of that user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.client.shared_memory import host_fd_of
from kvstore.integrations.sglang.layers import MemfdKVLayer
from kvstore.service.peer_cred import peer_uid
from kvstore.store.local_user import CallerUser
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread

NOBODY = 65534
NB, BS, HEADS, HD = 4, 16, 2, 64
HASHES = itertools.count(0xAB)
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by every user, unlike a venv under /work

RELAY = r"""
import socket, sys, threading
target = (sys.argv[1], int(sys.argv[2]))
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)

def pump(src, dst):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

while True:
    client, _ = listener.accept()
    upstream = socket.create_connection(target)
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""


AS_NOBODY = {"user": NOBODY, "group": NOBODY, "extra_groups": []}  # Popen's arguments


def _python(script: str, *args: str, **popen) -> subprocess.Popen:
    """``script`` run by the system's python (``popen``: further Popen arguments, e.g.
    AS_NOBODY), its stdout a pipe to read what it prints."""
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", script, *args], stdout=subprocess.PIPE, cwd="/", **popen
    )


def _can_run_as_nobody() -> str | None:
    if os.geteuid() != 0:
        return "running a process as another user needs root"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing"
    return None


@pytest.fixture
def store():
    s = ServerThread(pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, transfer=False)
    yield s
    s.stop()


@contextlib.contextmanager
def _relay_to(store: ServerThread) -> Iterator[str]:
    """``store``'s address as uid 65534 reaches it: a relay that user runs."""
    if reason := _can_run_as_nobody():
        pytest.skip(reason)
    host, port = store.address.rsplit(":", 1)
    proc = _python(RELAY, host, port, **AS_NOBODY)
    try:
        yield f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture
def relay(store):
    with _relay_to(store) as address:
        yield address


@pytest.fixture
def shm():
    made = kv_cache_shm("kv_first", NB, BS, HEADS, HD)
    yield made
    made.close()


def _layer(shm) -> KVLayer:
    return KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)


def _refused(address: str, layers: list) -> KVError:
    with contextlib.closing(StoreClient(address)) as client, pytest.raises(KVError) as info:
        client.register("engine", "llama", layers, block_size=BS).wait_sealed(10)
    return info.value


def _seals_and_moves_bytes(address: str, shm) -> None:
    with contextlib.closing(StoreClient(address)) as client:
        session = client.register("engine", "llama", [_layer(shm)], block_size=BS)
        try:
            session.wait_sealed(10)
            block_hash = next(HASHES)  # a block not stored yet by an earlier call
            shm.tensor[:, 1].fill_(block_hash % 100)
            assert session.save([(block_hash, 1)]).sealed == 1
            shm.tensor[:, 2].zero_()
            session.load([(block_hash, 2)])
            assert torch.equal(shm.tensor[:, 2], shm.tensor[:, 1])
        finally:
            session.close()


def test_another_users_rank_cannot_register_roots_private_shared_memory(store, relay, shm):
    path = f"/dev/shm/{shm.name}"
    os.chmod(path, 0o600)
    err = _refused(relay, [_layer(shm)])
    assert err.code is Code.PERMISSION_DENIED, err
    for words in (".name", shm.name, "uid 0", "uid 65534", "mode 600"):
        assert words in err.message, err.message
    with contextlib.closing(StoreClient(store.address)) as client:
        assert client.stats().instances == 0
    _seals_and_moves_bytes(store.address, shm)  # its owner (root, directly) may


def test_a_rank_registers_shared_memory_its_user_owns_or_every_user_may_write(store, relay, shm):
    path = f"/dev/shm/{shm.name}"
    os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)
    _seals_and_moves_bytes(relay, shm)
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)
    _seals_and_moves_bytes(relay, shm)
    os.chmod(path, 0o644)  # readable by all is not enough: a Load writes into it
    assert _refused(relay, [_layer(shm)]).code is Code.PERMISSION_DENIED


@contextlib.contextmanager
def _memfd_held_by(**user) -> Iterator[MemfdKVLayer]:
    """A KV layer in a memfd that a sleeping child process holds (run as ``user``:
    Popen's user/group arguments), named by that child's pid and descriptor."""
    nbytes = 2 * NB * BS * HEADS * HD * 2
    fd = os.memfd_create("kvstore-test-kv", 0)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    tensor = torch.frombuffer(mm, dtype=torch.float16).view(2, NB, BS, HEADS, HD)
    child = _python("import time; time.sleep(120)", pass_fds=[fd], **user)
    try:
        held = dataclasses.replace(host_fd_of(tensor, [fd]), pid=child.pid)
        yield MemfdKVLayer("model.layers.0.self_attn", tensor, "kv_first", "NHD", host_fd=held)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        os.close(fd)  # the mapping goes with the last tensor on it (a failure's traceback)


def test_another_users_rank_cannot_name_a_descriptor_of_roots_process(store, relay):
    with _memfd_held_by() as kv:
        err = _refused(relay, [kv])
        assert err.code is Code.PERMISSION_DENIED, err
        pid = kv.host_fd.pid
        for words in ("host_fd.fd", f"process {pid} runs as uid 0", "uid 65534"):
            assert words in err.message, err.message
        _seals(store.address, [kv])  # root's own rank may


def test_a_rank_names_a_descriptor_of_its_own_users_process(store, relay):
    with _memfd_held_by(**AS_NOBODY) as kv:
        _seals(relay, [kv])


def _seals(address: str, layers: list) -> None:
    with contextlib.closing(StoreClient(address)) as client:
        client.register("engine", "llama", layers, block_size=BS).close()


def test_host_memory_any_maps_whatever_the_store_can_open(relay_any, shm):
    os.chmod(f"/dev/shm/{shm.name}", 0o600)
    _seals_and_moves_bytes(relay_any, shm)


@pytest.fixture
def relay_any():
    """A relay run as uid 65534 to a store started with ``--host-memory any``."""
    s = ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, transfer=False, host_memory_any=True
    )
    try:
        with _relay_to(s) as address:
            yield address
    finally:
        s.stop()


# ---------------------------------------------------------------- the lookup


@pytest.mark.parametrize("netlink", [True, False], ids=["sock_diag", "tables"])
def test_the_user_of_a_loopback_connection_is_read_off_its_socket(netlink):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            host, port = client.getsockname()
            assert peer_uid(f"ipv4:{host}:{port}", netlink=netlink) == os.geteuid()
            dual_stack = f"ipv6:[::ffff:{host}]:{port}"
            assert peer_uid(dual_stack, netlink=netlink) == os.geteuid()
            assert peer_uid(f"ipv4:127.0.0.2:{port}", netlink=netlink) is None  # no such end


@pytest.mark.parametrize("netlink", [True, False], ids=["sock_diag", "tables"])
def test_the_user_of_another_users_socket_is_that_user(netlink):
    """A connection whose client end belongs to uid 65534 (a child run as it)."""
    if reason := _can_run_as_nobody():
        pytest.skip(reason)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        code = (
            "import socket, sys, time; "
            f"s = socket.create_connection(('127.0.0.1', {listener.getsockname()[1]})); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)"
        )
        child = _python(code, **AS_NOBODY)
        try:
            accepted, _ = listener.accept()
            with accepted:
                port = int(child.stdout.readline())
                assert peer_uid(f"ipv4:127.0.0.1:{port}", netlink=netlink) == NOBODY
        finally:
            child.kill()
            child.wait()


def test_a_caller_not_on_this_node_has_no_user_here():
    for peer in ("ipv4:203.0.113.9:40000", "unix:/run/kv.sock", "ipv4:garbage", ""):
        assert peer_uid(peer) is None, peer
        assert peer_uid(peer, netlink=False) is None, peer


@pytest.mark.parametrize("netlink", [True, False], ids=["sock_diag", "tables"])
def test_ipv6_loopback_connection(netlink):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no ::1 here: {exc}")
    with listener:
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        with client, accepted:
            port = client.getsockname()[1]
            assert peer_uid(f"ipv6:[::1]:{port}", netlink=netlink) == os.geteuid()
            as_grpc_writes_it = f"ipv6:%5B::1%5D:{port}"
            assert peer_uid(as_grpc_writes_it, netlink=netlink) == os.geteuid()


def test_the_lookup_is_asked_once_and_a_shortage_is_the_stores():
    asked = []

    def short():
        asked.append(1)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    user = CallerUser(short)
    info = os.stat(sys.executable)
    with pytest.raises(KVError) as first:
        user.check_may_open(info, "layers[0].memory.name 'x'")
    assert first.value.code is Code.RESOURCE_EXHAUSTED, first.value
    assert "layers[0].memory.name 'x'" in first.value.message
    assert "ulimit -n" in first.value.message

    calls = []
    remote = CallerUser(lambda: calls.append(1))  # None: not on this node
    for _ in range(2):
        with pytest.raises(KVError) as info_:
            remote.check_may_open(info, "layers[0].memory.name 'x'")
        assert info_.value.code is Code.FAILED_PRECONDITION
        assert "--host-memory any" in info_.value.message
    assert len(calls) == 1
    CallerUser.unchecked().check_may_open(info, "unused")  # --host-memory any: no lookup


# ------------------------------------------- a descriptor open read-only
#
# The store opens /proc/<pid>/fd/<fd> anew, O_RDWR, with its own (root's) rights:
# what that reopening may do is not what the descriptor may. A process of uid
# 65534 that holds root's 0644 /dev/shm object (or a memfd root handed it)
# read-only named that descriptor, and the store mapped it writable: a Load then
# overwrote root's memory. The descriptor itself must be open read-write.

READ_ONLY_HOLDER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print(fd, flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _read_only_descriptor_of_roots_shm() -> Iterator[MemfdKVLayer]:
    """Root's 0644 /dev/shm object, mapped here; a process of uid 65534 holds it
    open read-only and is named as the layer's host_fd."""
    if reason := _can_run_as_nobody():
        pytest.skip(reason)
    nbytes = 2 * NB * BS * HEADS * HD * 2
    path = f"/dev/shm/kvstore_test_ro_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        tensor = torch.frombuffer(mm, dtype=torch.float16).view(2, NB, BS, HEADS, HD)
        tensor.fill_(7)
        child = _python(READ_ONLY_HOLDER, path, **AS_NOBODY)
        try:
            child_fd = int(child.stdout.readline())
            held = dataclasses.replace(host_fd_of(tensor, [fd]), pid=child.pid, fd=child_fd)
            yield MemfdKVLayer("model.layers.0.self_attn", tensor, "kv_first", "NHD", host_fd=held)
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_descriptor_held_read_only_is_not_mapped_writable(store, relay):
    with _read_only_descriptor_of_roots_shm() as kv:
        err = _refused(relay, [kv])
        assert err.code is Code.PERMISSION_DENIED, err
        for words in ("host_fd.fd", "read-only", "uid 65534"):
            assert words in err.message, err.message
        with contextlib.closing(StoreClient(store.address)) as client:
            assert client.stats().instances == 0
        assert bool((kv.tensor == 7).all())  # root's bytes untouched


# A thread may run as another user than its process (per-thread credentials by
# a raw setresuid, as file servers do), while /proc/<tid>/fd is its process's
# descriptor table: the thread's user is not enough.

THREAD_AS_NOBODY = r"""
import ctypes, os, sys, threading, time
SETRESUID = {"x86_64": 117, "aarch64": 147}[os.uname().machine]
fd = os.memfd_create("roots-kv", 0)
os.ftruncate(fd, int(sys.argv[1]))
libc = ctypes.CDLL(None, use_errno=True)

def nobody():
    assert libc.syscall(SETRESUID, 65534, 65534, 65534) == 0, ctypes.get_errno()
    print(threading.get_native_id(), fd, flush=True)
    time.sleep(120)

threading.Thread(target=nobody, daemon=True).start()
time.sleep(120)
"""


def test_a_thread_of_roots_process_running_as_the_caller_does_not_lend_its_fds(store, relay):
    if reason := _can_run_as_nobody():
        pytest.skip(reason)
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("setresuid's syscall number is known here for x86_64 and aarch64 only")
    nbytes = 2 * NB * BS * HEADS * HD * 2
    root = _python(THREAD_AS_NOBODY, str(nbytes))
    try:
        tid, fd = map(int, root.stdout.readline().split())
        assert os.stat(f"/proc/{tid}").st_uid == NOBODY  # the thread runs as the caller
        with open(f"/proc/{root.pid}/fd/{fd}", "r+b") as memory:
            mm = mmap.mmap(memory.fileno(), nbytes, mmap.MAP_SHARED)
            tensor = torch.frombuffer(mm, dtype=torch.float16).view(2, NB, BS, HEADS, HD)
            held = dataclasses.replace(host_fd_of(tensor, [memory.fileno()]), pid=tid, fd=fd)
            kv = MemfdKVLayer("model.layers.0.self_attn", tensor, "kv_first", "NHD", host_fd=held)
            err = _refused(relay, [kv])
            del kv, tensor
        assert err.code is Code.PERMISSION_DENIED, err
        assert f"process {tid} runs as uid 0" in err.message, err.message
    finally:
        root.kill()
        root.wait()
        root.stdout.close()


# grpc writes an IPv6 peer percent-encoded (``ipv6:%5B::1%5D:PORT``): the
# lookup took it for no address, so a rank on ::1 ("localhost" resolving to
# it first) was refused host memory as if it ran on another node.


def test_a_rank_on_ipv6_loopback_registers_its_own_shared_memory(shm):
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as exc:
        pytest.skip(f"no ::1 here: {exc}")
    s = ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, transfer=False, host="::1"
    )
    try:
        _seals_and_moves_bytes(f"[::1]:{s.port}", shm)
    finally:
        s.stop()
