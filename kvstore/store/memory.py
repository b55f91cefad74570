"""Map the memory that workers share with the store server.

On the host a worker's KV tensors live in POSIX shared memory; on a GPU the
worker sends a CUDA IPC handle plus its device UUID. Either way the server
gets a base address it can hand to the copy engine. Nothing is pickled: a
handle is a name or 64 opaque bytes.

Host objects are opened through ``/dev/shm`` with plain ``mmap`` rather
than ``multiprocessing.shared_memory``: attaching with the latter registers
the object with Python's resource tracker, which unlinks the worker's memory
when the server exits.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import numpy as np
import torch

from kvstore.wire.errors import invalid, precondition
from kvstore.wire.limits import MAX_SHM_NAME_LEN

SHM_DIR = "/dev/shm"
SHM_NAME_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_SHM_NAME_LEN}}}")


@dataclass
class MappedRegion:
    """One mapped allocation; ``base`` stays valid until ``close``."""

    base: int
    size: int
    device: str  # "cpu" or "cuda:N"
    _keep: list = field(default_factory=list, repr=False)
    _close: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        self._keep.clear()
        for fn in self._close:
            fn()
        self._close.clear()


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
    region = MappedRegion(base=view.ctypes.data, size=size, device="cpu")
    region._keep.append(view)
    region._close.append(lambda: _close_mmap(region, mm))
    return region


def _close_mmap(region: MappedRegion, mm: mmap.mmap) -> None:
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
    region = MappedRegion(base=int(ptr), size=size, device=f"cuda:{index}")
    region._close.append(lambda: _close_ipc(index, ptr))
    return region


def _close_ipc(index: int, ptr: int) -> None:
    import cupy

    with cupy.cuda.Device(index):
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def cuda_device_index(device_uuid: str) -> int | None:
    """Index of the local CUDA device with this UUID ("GPU-..."), if any."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid_of(i) == device_uuid:
            return i
    return None


def device_uuid_of(index: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


# ----------------------------------------------------------------- client side


@dataclass
class ShmTensor:
    """A torch tensor whose storage is a named POSIX shared-memory object."""

    tensor: torch.Tensor
    shm: shared_memory.SharedMemory

    @property
    def name(self) -> str:
        return self.shm.name

    def close(self, unlink: bool = True) -> None:
        self.tensor = None  # drop the view before closing the buffer
        try:
            self.shm.close()
        except BufferError:
            pass
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def shm_empty(shape: tuple[int, ...], dtype: torch.dtype) -> ShmTensor:
    """Allocate a zeroed tensor in fresh shared memory (a worker's KV cache on the host)."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return ShmTensor(tensor=tensor, shm=shm)


def cuda_ipc_export(ptr: int, device: int) -> tuple[bytes, int, int]:
    """(IPC handle, base, size) of the CUDA allocation that holds ``ptr``.

    The handle comes from the CUDA runtime itself (64 bytes), not from a
    framework's private serialisation of it (torch prefixes its own bytes), and
    names the whole allocation: the caller sends ``ptr - base`` as the offset.
    """
    import cupy

    with cupy.cuda.Device(device):
        base, size = _allocation_range(ptr)
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    return handle, base, size


def _allocation_range(ptr: int) -> tuple[int, int]:
    """Base and size of the device allocation holding ``ptr`` (cuMemGetAddressRange)."""
    fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return base.value, size.value


# ------------------------------------------------------------ handle records


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
