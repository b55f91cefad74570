"""Map the memory that workers share with the store server (docs/design.md §1).

A registration names each layer's memory by a handle record: a POSIX
shared-memory object on the host (:class:`HostShmRef`), an open
shared-memory file descriptor of a worker process (:class:`HostFdRef`: a
``memfd_create`` object, as SGLang allocates its HiCache host pools), or a
CUDA IPC handle plus the device UUID on a GPU (:class:`CudaIpcRef`). Opening a record maps it
into this process as a :class:`MappedRegion`, whose base address the copy
engine uses directly. Nothing is pickled: a handle is a name or 64 opaque
bytes. The worker's half (allocating and exporting that memory) is
``kvstore.client.shared_memory``; binding a registration's layers to mapped
regions is ``kvstore.store.attach``.

Host objects are opened through ``/dev/shm`` with plain ``mmap`` rather
than ``multiprocessing.shared_memory``: attaching with the latter registers
the object with Python's resource tracker, which unlinks the worker's memory
when the server exits.

A handle the store cannot open or map refuses the registration with the
caller's code (INVALID_ARGUMENT, FAILED_PRECONDITION) unless the store itself
ran short (out of file descriptors, address space, GPU memory): then
RESOURCE_EXHAUSTED (UNAVAILABLE for the node's file table) names the field,
what ran out and what the store's operator can raise.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstore.copy.cuda_memory import allocation_range
from kvstore.wire import names
from kvstore.wire.errors import KVError, exhausted, invalid, precondition, unavailable
from kvstore.wire.limits import MAX_SHM_NAME_LEN

if TYPE_CHECKING:
    from kvstore.store.local_user import CallerUser

SHM_DIR = "/dev/shm"
# fstatfs f_type of the file systems shared memory lives on (linux/magic.h):
# memfd_create and /dev/shm are tmpfs (shmem), MFD_HUGETLB memfds hugetlbfs.
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
SHM_FS_TYPES = (TMPFS_MAGIC, HUGETLBFS_MAGIC)
SHM_LINK_PREFIXES = ("/memfd:", SHM_DIR + "/")  # where /proc/<pid>/fd/<fd> may point
SHM_NAME_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_SHM_NAME_LEN}}}")

# Failures that are the store's own shortage, not the request's: opening or
# mapping a worker's memory ran out of something this server or its node holds.
# By errno of open/mmap: (code, what ran out, what the store's operator can do).
# ENFILE is the node's table, filled by every process on it: UNAVAILABLE, it
# clears as they close files. Any other errno (a missing object, a permission)
# is the caller's and keeps its own code.
_OS_SHORTAGES = {
    errno.EMFILE: (
        exhausted,
        "file descriptors (its RLIMIT_NOFILE)",
        "raise the store server's open-file limit (`ulimit -n`, systemd LimitNOFILE=)",
    ),
    errno.ENFILE: (
        unavailable,
        "file descriptors of the whole node (fs.file-max)",
        "close files elsewhere on the node or raise sysctl fs.file-max",
    ),
    errno.ENOMEM: (
        exhausted,
        "memory or address space (RLIMIT_AS, vm.max_map_count)",
        "raise the store server's `ulimit -v` or sysctl vm.max_map_count, or free memory",
    ),
}
# The same for opening a CUDA IPC handle, by cudaError_t.
_CUDA_SHORTAGES = {
    2: (  # cudaErrorMemoryAllocation
        exhausted,
        "memory on its GPU",
        "leave the store room on the device (a smaller --pool-size, fewer processes on it)",
    ),
    711: (  # cudaErrorTooManyPeers
        exhausted,
        "CUDA peer mappings",
        "register the ranks of fewer devices with this store",
    ),
}


@dataclass
class MappedRegion:
    """One mapped allocation; ``base`` stays valid until ``close``.

    ``release`` unmaps it (called once, by ``close``); ``keep_alive`` holds
    what must outlive ``base`` and is dropped just before ``release`` runs.
    """

    base: int
    size: int
    device: str  # "cpu" or "cuda:N"
    release: Callable[[], None] | None = field(default=None, repr=False)
    # what the memory is, whatever name reached it: (st_dev, st_ino) of a host
    # object, ("cuda", device, base) of an allocation; one registration owns it
    identity: tuple | None = None
    keep_alive: object = field(default=None, repr=False)

    def close(self) -> None:
        self.keep_alive = None
        release, self.release = self.release, None
        if release is not None:
            release()


@dataclass(frozen=True)
class HostShmRef:
    """A layer tensor inside ``/dev/shm/<name>`` at ``offset``."""

    name: str
    size: int
    offset: int

    def key(self) -> tuple:
        return ("shm", self.name)

    def open(self, where: str, reach: int, user: CallerUser) -> MappedRegion:
        return map_host_shm(self.name, self.size, where, reach, user)


@dataclass(frozen=True)
class HostFdRef:
    """A layer tensor inside the shared-memory file open as ``fd`` in process ``pid``."""

    pid: int
    fd: int
    size: int
    offset: int

    def key(self) -> tuple:
        return ("fd", self.pid, self.fd)

    def open(self, where: str, reach: int, user: CallerUser) -> MappedRegion:
        return map_host_fd(self.pid, self.fd, self.size, where, reach, user)


@dataclass(frozen=True)
class CudaIpcRef:
    """A layer tensor inside a CUDA allocation shared by IPC handle."""

    handle: bytes
    device_uuid: str
    size: int
    offset: int

    def key(self) -> tuple:
        return ("cuda", self.handle)

    def open(self, where: str, reach: int, user: CallerUser) -> MappedRegion:
        del reach, user  # IPC maps the whole allocation; its handle is the capability
        return map_cuda_ipc(self.handle, self.device_uuid, self.size, where)


def map_host_shm(
    name: str, size: int, where: str, reach: int | None, user: CallerUser
) -> MappedRegion:
    """Map ``/dev/shm/<name>`` read-write, its first ``size`` bytes or only the
    first ``reach`` of them (what the layers use), for a caller whose ``user``
    may open it read-write itself; ``where`` names the field in errors."""
    if not SHM_NAME_RE.fullmatch(name) or name.startswith("."):
        raise invalid(f"{where}.name {name[:64]!r} is not a valid shared-memory name")
    path = os.path.join(SHM_DIR, name)
    try:  # never through a link: /dev/shm/x -> /etc/... would map a file as root
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except BlockingIOError:  # O_NONBLOCK: leased, not waited for on the event loop
        raise precondition(
            f"{where}.name {name!r} is under a file lease (F_SETLEASE): release it to "
            "register this memory"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise invalid(f"{where}.name {name!r} is a symbolic link, not shared memory") from exc
        doing = f"{where}.name: cannot open shared memory {name!r}"
        raise os_shortage(exc, doing) or precondition(f"{doing}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or _fs_type(fd) not in (*SHM_FS_TYPES, None):
            raise invalid(f"{where}.name {name!r} is not a shared-memory object")
        user.check_may_open(info, f"{where}.name {name!r}")
        actual = info.st_size
        if size == 0 or size > actual:
            raise invalid(
                f"{where}.size {size} does not fit shared memory {name!r} of {actual} bytes"
            )
        return _map_file(fd, _mapped_bytes(size, reach), info, f"{where}.name {name!r}")
    finally:
        os.close(fd)


def map_host_fd(
    pid: int, fd: int, size: int, where: str, reach: int | None, user: CallerUser
) -> MappedRegion:
    """Map the shared-memory file open as ``fd`` in process ``pid`` read-write,
    for a caller whose ``user`` runs that process (or is root).

    Opened through ``/proc/<pid>/fd/<fd>`` (the caller's descriptor stays its
    own). Only shared memory is accepted: a regular file on tmpfs or hugetlbfs
    that ``/proc`` names ``/memfd:...`` or ``/dev/shm/...``; never a file on
    disk, a socket or pipe, or this server's own memory. ``where`` names the
    field in errors (``<where>.host_fd.pid``, ``.fd``, ``.size``).
    """
    field_ = f"{where}.host_fd"
    if pid == 0:
        raise invalid(f"{field_}.pid is not set")
    if pid == os.getpid():
        raise invalid(f"{field_}.pid {pid} is the store server itself")
    if not os.path.isdir(f"/proc/{pid}"):
        raise invalid(f"{field_}.pid {pid}: no such process on this node")
    if thread_group(pid) == os.getpid():  # /proc/<tid>/fd is the server's own fd table
        raise invalid(f"{field_}.pid {pid} is the store server itself (one of its threads)")
    what = f"{field_}.fd {fd} of process {pid}"
    try:  # /proc/<pid> as a directory: that process's, even if the pid is reused after
        proc = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise invalid(f"{field_}.pid {pid}: no such process on this node") from None
    except OSError as exc:
        doing = f"{what} cannot be opened (/proc/{pid})"
        raise os_shortage(exc, doing) or invalid(f"{doing}: {exc.strerror}") from exc
    try:
        user.check_process(proc, pid, what)
        target, handle = _open_descriptor(proc, pid, fd, field_)
        try:
            user.check_descriptor(proc, fd, handle, what)
        except BaseException:
            os.close(handle)
            raise
    finally:
        os.close(proc)
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or not target.startswith(SHM_LINK_PREFIXES):
            raise invalid(
                f"{field_}.fd {fd} of process {pid} is {target!r}, not shared memory "
                "(a memfd or a /dev/shm file)"
            )
        fs_type = _fs_type(handle)
        if fs_type is not None and fs_type not in SHM_FS_TYPES:
            raise invalid(
                f"{field_}.fd {fd} of process {pid} ({target!r}) is not on tmpfs or "
                f"hugetlbfs (file system type {fs_type:#x})"
            )
        if size == 0 or size > info.st_size:
            raise invalid(
                f"{field_}.size {size} does not fit fd {fd} of process {pid} "
                f"({target!r}, {info.st_size} bytes)"
            )
        what = f"{field_}.fd {fd} of process {pid}"
        return _map_file(handle, _mapped_bytes(size, reach), info, what)
    finally:
        os.close(handle)


def _open_descriptor(proc: int, pid: int, fd: int, field_: str) -> tuple[str, int]:
    """``fd/<fd>`` under ``proc`` (``/proc/<pid>`` open as a directory): where its
    link points, and the file opened read-write with the store's own rights."""
    try:
        target = os.readlink(f"fd/{fd}", dir_fd=proc)
        # O_NONBLOCK: a file lease (F_SETLEASE) the worker holds fails the open at once
        # instead of blocking the event loop until the kernel breaks it (45 s)
        handle = os.open(f"fd/{fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=proc)
    except FileNotFoundError:
        raise invalid(f"{field_}.fd {fd} is not open in process {pid}") from None
    except PermissionError as exc:
        raise precondition(
            f"{field_}: cannot open fd {fd} of process {pid} ({exc.strerror}); the "
            "server must run as the same user as the worker"
        ) from exc
    except BlockingIOError:
        raise precondition(
            f"{field_}.fd {fd} of process {pid} is under a file lease (F_SETLEASE): "
            "release it to register this memory"
        ) from None
    except OSError as exc:
        doing = f"{field_}.fd {fd} of process {pid} cannot be opened"
        raise os_shortage(exc, doing) or invalid(f"{doing}: {exc.strerror}") from exc
    return target, handle


def thread_group(pid: int, proc: int | None = None) -> int:
    """The process whose thread ``pid`` is (``pid`` itself for a process, or when
    ``/proc`` does not say); ``proc``: ``/proc/<pid>`` open as a directory, read
    through it (a pid reused meanwhile is not read). A thread may run as another
    user than its process (per-thread credentials, set by raw syscalls), while
    its ``fd`` directory is the process's."""
    path, dir_fd = (f"/proc/{pid}/status", None) if proc is None else ("status", proc)
    try:
        with open(path, opener=lambda p, f: os.open(p, f | os.O_CLOEXEC, dir_fd=dir_fd)) as st:
            for line in st:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return pid


def _mapped_bytes(size: int, reach: int | None) -> int:
    """What to map of a ``size``-byte handle whose layers reach ``reach`` bytes: no
    more (a handle far larger than its layers, a sparse file, maps what is used;
    a layer past ``size`` is refused by the caller, against the mapping)."""
    return size if reach is None else max(1, min(size, reach))


def _map_file(fd: int, size: int, info: os.stat_result, what: str) -> MappedRegion:
    """Map the first ``size`` bytes of the open shared-memory file ``fd`` read-write;
    ``what`` names the field and object in errors."""
    try:  # mmap.mmap also dups ``fd``: a descriptor as well as address space
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        doing = f"{what}: cannot map {size} bytes"
        raise os_shortage(exc, doing) or precondition(f"{doing}: {exc.strerror}") from exc
    except ValueError:  # mmap checks the size again: the file shrank since it was checked
        raise precondition(
            f"{what}: shrank below {size} bytes while it was being mapped; the worker "
            "must keep its KV-cache memory while registered (re-register it)"
        ) from None
    view = np.frombuffer(mm, dtype=np.uint8)
    return MappedRegion(
        base=view.ctypes.data,
        size=size,
        device="cpu",
        release=functools.partial(_close_mmap, mm),
        keep_alive=view,
        identity=(info.st_dev, info.st_ino),
    )


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's symbols, from the process itself: dlopen(NULL) opens no
    file (find_library runs ldconfig in a child, which a store short of file
    descriptors cannot start, and a None cached then would stay for good)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fs_type(fd: int) -> int | None:
    """``f_type`` of the file system holding ``fd`` (fstatfs), or None if unknown.

    ``struct statfs`` starts with ``f_type`` (a C long on Linux); the buffer is
    larger than the whole struct on every architecture.
    """
    libc = _libc()
    if libc is None:
        return None
    buf = ctypes.create_string_buffer(512)
    if libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def os_shortage(exc: OSError, doing: str) -> KVError | None:
    """The KVError of ``exc`` when it is the store's own shortage (``_OS_SHORTAGES``),
    else None (the caller's fault, refused as such). ``doing`` names the field."""
    return _shortage(_OS_SHORTAGES.get(exc.errno), doing, exc.strerror)


def cuda_shortage(exc: Exception, doing: str) -> KVError | None:
    """Like :func:`os_shortage` for a CUDA runtime error (cupy's, with ``status``)."""
    return _shortage(_CUDA_SHORTAGES.get(getattr(exc, "status", None)), doing, str(exc))


def _shortage(entry: tuple | None, doing: str, detail: str) -> KVError | None:
    if entry is None:
        return None
    make, resource, fix = entry
    return make(
        f"{doing}: {detail}: the store server is out of {resource}; the request is "
        f"not at fault: the store's operator can {fix}"
    )


def _close_mmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere; the OS frees it with the process
        pass


def map_cuda_ipc(handle: bytes, device_uuid: str, size: int, where: str) -> MappedRegion:
    """Open a CUDA IPC handle on the local device whose UUID matches."""
    if len(handle) != 64:
        raise invalid(f"{where}.handle must be 64 bytes, got {len(handle)}")
    index = cuda_device_index(device_uuid)
    if index is None:
        raise precondition(f"{where}.device_uuid {device_uuid[:64]!r} is not a device of this node")
    import cupy

    with cupy.cuda.Device(index):
        try:
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        except Exception as exc:
            doing = f"{where}.handle: cannot open CUDA IPC handle"
            raise cuda_shortage(exc, doing) or precondition(f"{doing}: {exc}") from exc
        try:  # bounds come from the allocation itself, never from the size a client claims
            base, actual = allocation_range(int(ptr))
        except BaseException:
            _close_ipc(index, ptr)
            raise
    if size == 0 or base != int(ptr) or size > actual:
        _close_ipc(index, ptr)
        raise invalid(f"{where}.size {size} does not fit the {actual}-byte CUDA allocation")
    return MappedRegion(
        base=int(ptr),
        size=size,
        device=f"cuda:{index}",
        release=functools.partial(_close_ipc, index, ptr),
        identity=("cuda", index, int(ptr)),
    )


def _close_ipc(index: int, ptr: int) -> None:
    import cupy

    with cupy.cuda.Device(index):
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def cuda_device_index(uuid: str) -> int | None:
    """Index of the local CUDA device with this UUID ("GPU-..."), if any.

    Both sides spell the UUID with ``kvstore.wire.names.device_uuid``, so
    they cannot disagree on the format.
    """
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if names.device_uuid(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None
