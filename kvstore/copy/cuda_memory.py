"""Facts about CUDA allocations from the driver itself (no framework in between)."""

from __future__ import annotations

import ctypes


def allocation_range(ptr: int) -> tuple[int, int]:
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
