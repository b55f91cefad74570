"""Map the memory that workers share with the store server (docs/design.md §1).

A registration names each layer's memory by a handle record: a POSIX
shared-memory object on the host (:class:`HostShmRef`) or a CUDA IPC handle
plus the device UUID on a GPU (:class:`CudaIpcRef`). Opening a record maps it
into this process as a :class:`MappedRegion`, whose base address the copy
engine uses directly. Nothing is pickled: a handle is a name or 64 opaque
bytes. The worker's half (allocating and exporting that memory) is
``kvstore.client.shared_memory``; binding a registration's layers to mapped
regions is ``kvstore.store.attach``.

Host objects are opened through ``/dev/shm`` with plain ``mmap`` rather
than ``multiprocessing.shared_memory``: attaching with the latter registers
the object with Python's resource tracker, which unlinks the worker's memory
when the server exits.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.wire import names
from kvstore.wire.errors import invalid, precondition
from kvstore.wire.limits import MAX_SHM_NAME_LEN

SHM_DIR = "/dev/shm"
SHM_NAME_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_SHM_NAME_LEN}}}")


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

    def open(self, where: str) -> MappedRegion:
        return map_host_shm(self.name, self.size, where)


@dataclass(frozen=True)
class CudaIpcRef:
    """A layer tensor inside a CUDA allocation shared by IPC handle."""

    handle: bytes
    device_uuid: str
    size: int
    offset: int

    def key(self) -> tuple:
        return ("cuda", self.handle)

    def open(self, where: str) -> MappedRegion:
        return map_cuda_ipc(self.handle, self.device_uuid, self.size, where)


def map_host_shm(name: str, size: int, where: str) -> MappedRegion:
    """Map ``/dev/shm/<name>`` read-write; ``where`` names the field in errors."""
    if not SHM_NAME_RE.fullmatch(name) or name.startswith("."):
        raise invalid(f"{where}.name {name!r} is not a valid shared-memory name")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise precondition(f"{where}: cannot open shared memory {name!r}: {exc.strerror}") from exc
    try:
        actual = os.fstat(fd).st_size
        if size == 0 or size > actual:
            raise invalid(
                f"{where}.size {size} does not fit shared memory {name!r} of {actual} bytes"
            )
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = np.frombuffer(mm, dtype=np.uint8)
    return MappedRegion(
        base=view.ctypes.data,
        size=size,
        device="cpu",
        release=functools.partial(_close_mmap, mm),
        keep_alive=view,
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
        raise precondition(f"{where}.device_uuid {device_uuid!r} is not a device of this node")
    import cupy

    with cupy.cuda.Device(index):
        try:
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        except Exception as exc:
            raise precondition(f"{where}: cannot open CUDA IPC handle: {exc}") from exc
    return MappedRegion(
        base=int(ptr),
        size=size,
        device=f"cuda:{index}",
        release=functools.partial(_close_ipc, index, ptr),
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
