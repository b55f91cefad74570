"""The store short of its own resources while mapping a rank's memory: RESOURCE_EXHAUSTED
naming the field and what ran out and what the store's operator can do, never the
caller's INVALID_ARGUMENT or FAILED_PRECONDITION; nothing stays registered or mapped,
and the same registration seals once the operator raised the limit.

A real store server in its own process (``store_process``), its descriptors or
address space run short by ``setrlimit`` there; this process is the worker, with its
KV cache in real shared memory (a /dev/shm object, a memfd).
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import pytest
import torch

from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.client.shared_memory import ShmTensor, host_fd_of
from kvstore.integrations.sglang.layers import MemfdKVLayer
from kvstore.wire.errors import Code, KVError
from tests.conftest import wait_for
from tests.service.store_process import StoreProcess

NB, BS, HEADS, HD = 8, 16, 2, 128


@pytest.fixture
def store():
    s = StoreProcess()
    yield s
    s.stop()


@pytest.fixture
def client(store):
    """A client of ``store`` that has served one rank (its connection open, the
    server's lazily loaded libraries loaded) before any limit is lowered."""
    c = StoreClient(store.address)
    shm = kv_cache_shm("kv_first", NB, BS, HEADS, HD)
    c.register("warm-up", "llama", [layer(shm)], block_size=BS).close()
    assert wait_for(lambda: c.stats().instances == 0)
    shm.close()
    yield c
    c.close()


@pytest.fixture
def shms():
    made = []

    def make(num_blocks=NB):
        made.append(kv_cache_shm("kv_first", num_blocks, BS, HEADS, HD))
        return made[-1]

    yield make
    for shm in made:
        shm.close()


def layer(shm, i=0):
    return KVLayer(f"model.layers.{i}.self_attn", shm.tensor, "kv_first", "NHD", shm)


def exhausted_then_sealed(store, client, layers, *words) -> KVError:
    """Registering ``layers`` is RESOURCE_EXHAUSTED naming ``words``, leaves nothing
    registered, and seals as it is once the store's limits are back."""
    with pytest.raises(KVError) as info:
        client.register("engine", "llama", layers, block_size=BS)
    err = info.value
    assert err.code is Code.RESOURCE_EXHAUSTED, err
    for word in ("not at fault", "store's operator", *words):
        assert word in err.message, err.message
    assert client.stats().instances == 0
    store.restore()
    session = client.register("engine", "llama", layers, block_size=BS)  # not ALREADY_EXISTS
    try:
        assert session.wait_sealed(10).final_namespace.startswith("llama.")
    finally:
        session.close()
    return err


def test_no_descriptor_to_open_shared_memory_is_the_stores_shortage(store, client, shms):
    """Before: FAILED_PRECONDITION "cannot open shared memory ...: Too many open
    files", as if the worker had named memory the store may not open."""
    store.starve_files(free=0)
    exhausted_then_sealed(
        store,
        client,
        [layer(shms())],
        "model.layers.0.self_attn",
        ".name",
        "file descriptors",
        "ulimit -n",
    )


def test_no_descriptor_left_for_the_second_layer_unmaps_the_first(store, client, shms):
    """Two descriptors free: the first layer is opened and mapped (mmap keeps a
    dup of the descriptor), the second layer's map finds none. Before: the raw
    OSError reached the client as UNKNOWN. Now RESOURCE_EXHAUSTED naming the
    second layer, and the first layer's mapping is gone too."""
    first, second = shms(), shms()
    store.starve_files(free=2)
    with pytest.raises(KVError) as info:
        client.register("engine", "llama", [layer(first, 0), layer(second, 1)], block_size=BS)
    err = info.value
    assert err.code is Code.RESOURCE_EXHAUSTED, err
    for word in ("model.layers.1.self_attn", "cannot map", "file descriptors", "ulimit -n"):
        assert word in err.message, err.message
    assert not store.maps(first.name) and not store.maps(second.name)
    assert client.stats().instances == 0


def test_no_descriptor_to_open_a_workers_memfd_is_the_stores_shortage(store, client):
    """A memfd of this process (the worker), opened by the store through /proc.
    Before: INVALID_ARGUMENT "host_fd.fd ... cannot be opened", as if the worker
    had named a descriptor it does not hold."""
    nbytes = 2 * NB * BS * HEADS * HD * 2
    fd = os.memfd_create("kvstore-test-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    tensor = torch.frombuffer(mm, dtype=torch.float16).view(2, NB, BS, HEADS, HD)
    kv = MemfdKVLayer(
        "model.layers.0.self_attn", tensor, "kv_first", "NHD", host_fd=host_fd_of(tensor)
    )
    try:
        store.starve_files(free=0)
        exhausted_then_sealed(
            store, client, [kv], "model.layers.0.self_attn", "host_fd.fd", "ulimit -n"
        )
    finally:  # the mapping goes with the last tensor on it (a failure's traceback holds one)
        os.close(fd)


def test_no_address_space_to_map_a_layer_is_the_stores_shortage(store, client, shms):
    """A 1 GiB layer (sparse shared memory) and a store allowed 256 MiB more address
    space. Before: mmap's ENOMEM reached the client as UNKNOWN."""
    big = shms(num_blocks=65536)
    store.limit_memory(256 << 20)
    exhausted_then_sealed(
        store, client, [layer(big)], "model.layers.0.self_attn", "cannot map", "address space"
    )


def test_a_handle_larger_than_its_layers_maps_only_what_they_use(store, client, shms):
    """A 1 GiB shared-memory object (sparse) whose one layer uses its first 256 KiB,
    and a store allowed 256 MiB more address space: the store maps what the layer
    reaches, so it registers. Before: the whole handle was mapped, and a handle
    far larger than its layers (2**50 bytes of a sparse file) came back as the
    store's shortage of address space, though only the request was at fault."""
    big = shms(num_blocks=65536)
    small = big.tensor.view(-1)[: 2 * NB * BS * HEADS * HD].view(2, NB, BS, HEADS, HD)
    store.limit_memory(256 << 20)
    session = client.register("engine", "llama", [layer_of(small, big)], block_size=BS)
    try:
        assert session.wait_sealed(10).final_namespace.startswith("llama.")
    finally:
        session.close()


def test_a_handle_beyond_the_largest_mapping_is_the_callers_fault(client, shms):
    """memory.size past MAX_MAPPING_BYTES (here 2**50) is INVALID_ARGUMENT naming
    the field, before anything is opened."""
    shm = shms()
    claimed = ClaimedSize(shm.tensor, shm.shm, 1 << 50)
    with pytest.raises(KVError) as info:
        client.register("engine", "llama", [layer_of(shm.tensor, claimed)], block_size=BS)
    assert info.value.code is Code.INVALID_ARGUMENT, info.value
    assert "memory.size 1125899906842624 is beyond" in info.value.message
    assert client.stats().instances == 0


@dataclasses.dataclass
class ClaimedSize(ShmTensor):
    """A shared-memory tensor whose object this worker claims is ``claimed`` bytes."""

    claimed: int = 0

    @property
    def size(self) -> int:
        return self.claimed


def layer_of(tensor, shm):
    return KVLayer("model.layers.0.self_attn", tensor, "kv_first", "NHD", shm)
