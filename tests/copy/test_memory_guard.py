"""The host copier survives memory that vanishes under it (SIGBUS is caught)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvstore.copy import HostCopier, MemoryFault, Pieces
from kvstore.copy.host import native_copy_function

pytestmark = pytest.mark.skipif(native_copy_function() is None, reason="no native host copier")


def test_copy_from_a_truncated_file_raises_memory_fault_and_the_next_copy_works(tmp_path):
    path = f"/dev/shm/kvstore-test-guard-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        src = np.frombuffer(mm, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        pieces = Pieces(
            paged_addr=np.array([src.ctypes.data], dtype=np.uint64),
            slot_addr=np.array([dst.ctypes.data], dtype=np.uint64),
            nbytes=np.array([1 << 20], dtype=np.uint64),
        )
        copier = HostCopier(num_threads=2, backend="native")
        src[:] = 7
        assert copier.save(pieces) == 1 << 20 and int(dst.min()) == 7

        os.ftruncate(fd, 0)  # every page behind src is gone
        with pytest.raises(MemoryFault):
            copier.save(pieces)

        os.ftruncate(fd, 1 << 20)  # pages come back (zero-filled): copies work again
        copier.save(pieces)
        assert int(dst.max()) == 0
        copier.close()
        del src
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
