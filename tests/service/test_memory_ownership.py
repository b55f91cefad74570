"""Memory the server may map (issue 12, item 3), over a real server.

Attacks reproduced: a /dev/shm name that is a symbolic link to a file the
client may not touch (the server, often root, followed it and wrote the
file); registering another instance's shared-memory object (by its name or by
a hard link to it) to read and overwrite that instance's live KV cache; and
names that are not shared memory at all (a FIFO, a directory).
"""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest
import torch

from kvstore.client.shared_memory import shm_empty
from kvstore.client.store_client import KVLayer, StoreClient
from kvstore.wire.errors import Code, KVError
from kvstore.wire.kv_layout import LayoutKind
from tests.conftest import wait_for

SHAPE = (8, 1, 32, 128)  # paged: 8 blocks of one head, 32 tokens, K+V 64 each
NBYTES = 8 * 32 * 128 * 2


def register(client, instance, name, size=NBYTES, tensor=None):
    t = tensor if tensor is not None else torch.zeros(SHAPE, dtype=torch.bfloat16)
    shm = SimpleNamespace(name=name, size=size, offset_of=lambda _t: 0)
    layer = KVLayer("model.layers.0.attn", t, LayoutKind.PAGED, "LBHNC/1", shm)
    return client.register(instance, "m", [layer], block_size=32, hash_format="h")


@pytest.fixture
def shm_name():
    name = f"kvstore-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        os.rmdir(f"/dev/shm/{name}")


def refused(client, instance, name, code, fragment):
    with pytest.raises(KVError) as err:
        register(client, instance, name)
    assert err.value.code is code, err.value
    assert fragment in str(err.value)
    assert client.stats().instances == 0


def test_a_symlink_is_never_followed(server, tmp_path, shm_name):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * NBYTES)
    os.symlink(secret, f"/dev/shm/{shm_name}")
    client = StoreClient(server.address)
    refused(client, "evil", shm_name, Code.INVALID_ARGUMENT, "symbolic link")
    assert secret.read_bytes() == b"s" * NBYTES


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_what_is_not_shared_memory_is_refused(server, shm_name, kind):
    path = f"/dev/shm/{shm_name}"
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    client = StoreClient(server.address)
    with pytest.raises(KVError) as err:
        register(client, "odd", shm_name)
    assert err.value.code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION)
    assert shm_name in str(err.value)
    assert client.stats().instances == 0


@pytest.mark.parametrize("alias", ["same name", "hard link"])
def test_one_instance_cannot_register_another_instances_memory(server, shm_name, alias):
    client = StoreClient(server.address)
    victim_buf = shm_empty((NBYTES,), torch.int8)
    victim_view = victim_buf.tensor.view(torch.bfloat16).view(SHAPE)
    victim = register(client, "victim", victim_buf.name, tensor=victim_view)
    try:
        victim.wait_sealed(10)
        victim_view.view(torch.int16).fill_(7)
        assert victim.save([(11, 0)]).sealed == 1
        name = victim_buf.name
        if alias == "hard link":
            os.link(f"/dev/shm/{victim_buf.name}", f"/dev/shm/{shm_name}")
            name = shm_name
        with pytest.raises(KVError) as err:
            register(client, "thief", name)
        assert err.value.code is Code.ALREADY_EXISTS
        assert "victim" in str(err.value)
        assert client.stats().instances == 1
        assert bool((victim_view.view(torch.int16) == 7).all())
        # the victim still works
        victim_view.view(torch.int16).zero_()
        assert victim.load([(11, 0)]).loaded == 1
        assert bool((victim_view[0].view(torch.int16) == 7).all())
    finally:
        victim.close()
    # once the victim is gone, its memory may be registered by a new owner
    assert wait_for(lambda: client.stats().instances == 0)
    again = register(client, "next", victim_buf.name)
    again.close()
    victim_buf.close()


def test_two_layers_on_the_same_bytes_are_refused_at_registration(server):
    """Two layer names for one tensor (a layer listed twice): before, the rank was
    registered and sealed, its Saves worked, and every Load was refused (its
    pieces overlap). Now INVALID_ARGUMENT naming both layers; nothing registered."""
    shm = shm_empty(SHAPE, torch.bfloat16)
    client = StoreClient(server.address)
    try:
        layers = [
            KVLayer(f"model.layers.{i}.attn", shm.tensor, LayoutKind.PAGED, "LBHNC/1", shm)
            for i in (0, 1)
        ]
        with pytest.raises(KVError) as err:
            client.register("twice", "m", layers, block_size=32, hash_format="h")
        assert err.value.code is Code.INVALID_ARGUMENT, err.value
        for words in ("model.layers.0.attn", "model.layers.1.attn", "share memory"):
            assert words in err.value.message, err.value.message
        assert client.stats().instances == 0
        half = shm.tensor.view(2, 4, *SHAPE[1:])  # two layers side by side: apart
        layers = [
            KVLayer(f"model.layers.{i}.attn", half[i], LayoutKind.PAGED, "LBHNC/1", shm)
            for i in (0, 1)
        ]
        client.register("apart", "m", layers, block_size=32, hash_format="h").close()
    finally:
        client.close()
        shm.close()
