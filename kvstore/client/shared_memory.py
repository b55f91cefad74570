"""A worker's side of shared KV memory: allocate it on the host, export it on a GPU.

The store server maps a worker's KV tensors instead of copying them
(docs/design.md §1, the ``memory`` field of a layer). On the host the tensor
must live in a named POSIX shared-memory object (:func:`shm_empty`) or in a
shared-memory file the process holds open (a ``memfd_create`` object, as
SGLang allocates its host pools: :func:`host_fd_of` finds the descriptor and
the server opens it through ``/proc/<pid>/fd/<fd>``); on a GPU the worker
sends a CUDA IPC handle of the allocation holding the tensor
(:func:`cuda_ipc_export`) and the UUID of its device (:func:`device_uuid_of`).
Nothing is pickled: a handle is a name, a (pid, fd) pair or 64 opaque bytes. The server's half
(mapping those handles) is ``kvstore.store.memory``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

from kvstore.copy.cuda_memory import allocation_range
from kvstore.wire.names import device_uuid


@dataclass
class ShmTensor:
    """A torch tensor whose storage is a named POSIX shared-memory object."""

    tensor: torch.Tensor
    shm: shared_memory.SharedMemory

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def size(self) -> int:
        """Bytes of the shared-memory object (the tensor may start past its first byte)."""
        return self.shm.size

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element inside the shared-memory object."""
        base = torch.frombuffer(self.shm.buf, dtype=torch.uint8).data_ptr()
        return tensor.data_ptr() - base

    def close(self, unlink: bool = True) -> None:
        self.tensor = None  # drop the view before closing the buffer
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the OS frees it with the process
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


def device_uuid_of(index: int) -> str:
    """The UUID of local CUDA device ``index`` as the wire carries it ("GPU-...")."""
    return device_uuid(torch.cuda.get_device_properties(index).uuid)


def cuda_ipc_export(ptr: int, device: int) -> tuple[bytes, int, int]:
    """(IPC handle, base, size) of the CUDA allocation that holds ``ptr``.

    The handle comes from the CUDA runtime itself (64 bytes), not from a
    framework's private serialisation of it (torch prefixes its own bytes), and
    names the whole allocation: the caller sends ``ptr - base`` as the offset.
    """
    import cupy

    with cupy.cuda.Device(device):
        base, size = allocation_range(ptr)
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    return handle, base, size


@dataclass(frozen=True)
class HostFd:
    """A shared-memory file this process holds open as ``fd``, and where it is mapped.

    ``base`` is the address byte 0 of the file has in this process, so a tensor
    inside the mapping starts at ``tensor.data_ptr() - base`` in the file.
    """

    pid: int
    fd: int
    size: int  # bytes of the file
    base: int

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the file; ValueError when
        any of its bytes lies outside the file."""
        offset = tensor.data_ptr() - self.base
        end = offset + _extent(tensor)
        if offset < 0 or end > self.size:
            raise ValueError(
                f"tensor bytes [{offset}, {end}) are outside fd {self.fd} ({self.size} bytes)"
            )
        return offset


def host_fd_of(tensor: torch.Tensor, fds: Iterable[int] | None = None) -> HostFd:
    """The open shared-memory descriptor of this process that maps ``tensor``.

    The mapping holding the tensor's first byte is looked up in
    ``/proc/self/maps``; the descriptor is the one among ``fds`` (default: every
    open descriptor) whose file is that mapping's file. ValueError when the
    tensor is not in a file mapping (anonymous memory: ``torch.empty``,
    ``MAP_ANONYMOUS``) or no descriptor of that file is open, with the reason.
    """
    ptr = tensor.data_ptr()
    mapping = _mapping_of(ptr)
    if mapping is None:
        raise ValueError(f"address {ptr:#x} is not mapped in this process")
    start, file_offset, dev, inode, path = mapping
    if inode == 0:
        raise ValueError(
            f"the tensor at {ptr:#x} is in anonymous memory ({path or 'no file'}), not in a "
            "shared-memory file the store can open"
        )
    candidates = fds if fds is not None else _open_fds()
    for fd in candidates:
        try:
            info = os.fstat(fd)
        except OSError:
            continue
        if (
            stat.S_ISREG(info.st_mode)
            and info.st_ino == inode
            and (os.major(info.st_dev), os.minor(info.st_dev)) == dev
        ):
            return HostFd(os.getpid(), fd, info.st_size, start - file_offset)
    raise ValueError(
        f"the tensor at {ptr:#x} is in {path!r}, but no open descriptor of that file "
        "was found (it must stay open for the store to map it)"
    )


def _open_fds() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc/self/fd") if name.isdigit())


def _mapping_of(ptr: int) -> tuple[int, int, tuple[int, int], int, str] | None:
    """(start, file offset, (major, minor), inode, path) of the mapping holding ``ptr``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                path = fields[5].strip() if len(fields) > 5 else ""
                return lo, int(fields[2], 16), (major, minor), int(fields[4]), path
    return None


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (any strides >= 0)."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()
