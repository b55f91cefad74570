"""A worker's side of shared KV memory: allocate it on the host, export it on a GPU.

The store server maps a worker's KV tensors instead of copying them
(docs/design.md §1, the ``memory`` field of a layer). On the host the tensor
must live in a named POSIX shared-memory object (:func:`shm_empty`); on a GPU
the worker sends a CUDA IPC handle of the allocation holding the tensor
(:func:`cuda_ipc_export`) and the UUID of its device (:func:`device_uuid_of`).
Nothing is pickled: a handle is a name or 64 opaque bytes. The server's half
(mapping those handles) is ``kvstore.store.memory``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

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
