"""Which failures to open or map a worker's memory are the store's own shortage.

A store out of descriptors or memory answers RESOURCE_EXHAUSTED (the node's file
table full: UNAVAILABLE, it clears as other processes close files), naming what
ran out and what the store's operator can do; a failure the caller causes (a
missing object, a permission, a bad CUDA handle) keeps its own code. The errnos a
test can produce for real (EMFILE, ENOMEM) are exercised on a real store in
``tests/service/test_store_resources.py``; these are the rest: the node-wide
ENFILE, and CUDA's errors, which need a GPU short of memory.
"""

from __future__ import annotations

import errno
import os

import pytest

from kvstore.store.memory import cuda_shortage, os_shortage
from kvstore.wire.errors import Code

DOING = "layer 'model.layers.0.self_attn' of instance 'a' rank 0 (tp_rank 0) memory.name"


def os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize(
    "code,status,words",
    [
        (errno.EMFILE, Code.RESOURCE_EXHAUSTED, "ulimit -n"),
        (errno.ENFILE, Code.UNAVAILABLE, "fs.file-max"),
        (errno.ENOMEM, Code.RESOURCE_EXHAUSTED, "vm.max_map_count"),
    ],
)
def test_the_stores_own_shortage_names_the_field_and_the_fix(code, status, words):
    err = os_shortage(os_error(code), DOING)
    assert err is not None and err.code is status
    for word in (DOING, os.strerror(code), "not at fault", words):
        assert word in err.message, err.message


@pytest.mark.parametrize("code", [errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENXIO])
def test_a_failure_the_caller_causes_is_no_shortage(code):
    assert os_shortage(os_error(code), DOING) is None


def test_cuda_out_of_memory_is_the_stores_shortage_and_a_bad_handle_is_not():
    runtime = pytest.importorskip("cupy_backends.cuda.api.runtime")
    err = cuda_shortage(runtime.CUDARuntimeError(2), f"{DOING[:-5]}.handle")  # out of memory
    assert err is not None and err.code is Code.RESOURCE_EXHAUSTED
    for word in (".handle", "cudaErrorMemoryAllocation", "memory on its GPU", "--pool-size"):
        assert word in err.message, err.message
    assert cuda_shortage(runtime.CUDARuntimeError(400), DOING) is None  # invalid handle
    assert cuda_shortage(RuntimeError("no status"), DOING) is None


def test_a_file_that_shrank_after_its_size_was_checked_is_a_precondition_not_unknown():
    """The size is checked (fstat) before the map; a worker truncating its memfd
    between the two made mmap raise ValueError, answered UNKNOWN. Now it is
    FAILED_PRECONDITION naming the field, as a shrink under a copy is."""
    from kvstore.store.memory import _map_file
    from kvstore.wire.errors import KVError

    fd = os.memfd_create("kv")
    try:
        os.ftruncate(fd, 1 << 16)
        checked = os.fstat(fd)  # what the size check saw
        os.ftruncate(fd, 1 << 12)  # ... then the worker shrank it
        with pytest.raises(KVError) as err:
            _map_file(fd, 1 << 16, checked, DOING)
        assert err.value.code is Code.FAILED_PRECONDITION
        assert DOING in err.value.message and "shrank below 65536 bytes" in err.value.message
        _map_file(fd, 1 << 12, os.fstat(fd), DOING).release()  # what it holds still maps
    finally:
        os.close(fd)
