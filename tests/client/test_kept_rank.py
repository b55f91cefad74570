"""KeptRank against a real store server: which failures it retries and which end it.

A failure another attempt can cure (the store down or restarting) is retried
and logged once an outage, without a traceback per attempt; a refusal
(INVALID_ARGUMENT, FAILED_PRECONDITION, PERMISSION_DENIED from the store) is
logged once at ERROR with what to fix and raised by ``wait_ready`` instead of
a timeout, and still retried (a previous engine's ranks may leave); the
client's own check of its layers ends the attempts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.client.kept_rank import KeptRank
from kvstore.client.store_client import RankSpec
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.service.store_server import ServerConfig, StoreServer
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread, wait_for

NB, BS, HEADS, HD = 8, 16, 2, 128
RETRY_S = 0.05
LOGGER = "kvstore.client.kept_rank"
CONFIG = {"pool_size": 64 << 20, "device": "cpu", "slab_bytes": 4 << 20}


@pytest.fixture
def shms():
    made = []

    def make():
        made.append(kv_cache_shm("kv_first", NB, BS, HEADS, HD))
        return made[-1]

    yield make
    for shm in made:
        shm.close()


def layer(shm, i=0, tensor=None):
    t = shm.tensor if tensor is None else tensor
    return KVLayer(f"model.layers.{i}.self_attn", t, "kv_first", "NHD", shm)


def kept(
    address,
    layers,
    *,
    instance="engine-a",
    namespace="llama3-8b",
    rank=0,
    world=1,
    seal_timeout=5.0,
    tls=None,
):
    spec = RankSpec(instance, namespace, "kvstore-blake3-v1", BS, rank, world, rank, world)
    return KeptRank(
        StoreClient(address, timeout=2, tls=tls),
        spec,
        layers,
        seal_timeout=seal_timeout,
        retry_s=RETRY_S,
        engine="vLLM",
    )


def records(caplog, level=None):
    return [r for r in caplog.records if r.name == LOGGER and (level is None or r.levelno == level)]


def refusals_at_store(caplog):
    """Registrations the store refused: one per attempt that reached it."""
    return [
        r
        for r in caplog.records
        if "registration of" in r.getMessage() and "refused" in r.getMessage()
    ]


def test_a_layer_the_store_cannot_copy_ends_the_attempts_and_the_wait_raises(server, shms, caplog):
    """Before: the client's own geometry check (a ValueError from
    region_from_tensor) was taken for the store being down: a traceback every
    retry_s, forever, and wait_ready timed out with False."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    shm = shms()
    gappy = shm.tensor[..., : HD // 2]  # half of head_dim: a block is not one dense run
    rank = kept(server.address, [layer(shm, tensor=gappy)])
    try:
        rank.start()
        began = time.monotonic()
        with pytest.raises(KVError) as err:
            rank.wait_ready(3)
        assert time.monotonic() - began < 1  # raised at once, not waited out
        assert err.value.code is Code.INVALID_ARGUMENT
        text = str(err.value)
        assert "model.layers.0.self_attn" in text and "dense" in text  # the layer, the reason
        assert "restart the engine" in text  # what to do about it
        assert isinstance(err.value.__cause__, ValueError)
        time.sleep(20 * RETRY_S)  # time for many retries, were there any
        logged = records(caplog)
        assert [r.levelno for r in logged] == [logging.ERROR], [r.getMessage() for r in logged]
        assert logged[0].exc_info is None and "dense" in logged[0].getMessage()
        assert rank.refused is not None and rank.live() is None
        with pytest.raises(KVError):  # every later wait says it again
            rank.wait_ready(0)
        assert StoreClient(server.address).stats().instances == 0
    finally:
        rank.close()


def test_a_registration_the_store_refuses_is_one_error_and_the_wait_raises(server, shms, caplog):
    """A client namespace with a dot (the dot separates the fingerprint): the
    store refuses it INVALID_ARGUMENT. Before: a warning, wait_ready timed out
    with False. Now one ERROR naming the field, the wait raises; retried."""
    caplog.set_level(logging.DEBUG)
    rank = kept(server.address, [layer(shms())], namespace="llama3.1-8b")
    try:
        rank.start()
        with pytest.raises(KVError) as err:
            rank.wait_ready(3)
        assert err.value.code is Code.INVALID_ARGUMENT
        assert "client_namespace" in str(err.value)  # the store's own words
        time.sleep(20 * RETRY_S)
        assert len(refusals_at_store(caplog)) > 2  # retried
        logged = [r for r in records(caplog) if r.levelno >= logging.WARNING]
        assert [r.levelno for r in logged] == [logging.ERROR]  # once
        assert "client_namespace" in logged[0].getMessage()
        assert "retries every" in logged[0].getMessage()
    finally:
        rank.close()


def test_a_rank_that_would_leave_a_layer_without_owner_is_refused(server, shms, caplog):
    """Two tp ranks, rank 1 missing a layer rank 0 registered: the store refuses
    the completing rank FAILED_PRECONDITION. Rank 1's wait raises; rank 0,
    registered and waiting for a correct rank 1, keeps waiting (False)."""
    caplog.set_level(logging.DEBUG)
    rank0 = kept(server.address, [layer(shms(), 0), layer(shms(), 1)], world=2, seal_timeout=0.2)
    rank1 = kept(server.address, [layer(shms(), 0)], rank=1, world=2)
    try:
        rank0.start()
        rank1.start()
        with pytest.raises(KVError) as err:
            rank1.wait_ready(3)
        assert err.value.code is Code.FAILED_PRECONDITION
        assert "model.layers.1.self_attn" in str(err.value)
        time.sleep(20 * RETRY_S)
        assert rank0.wait_ready(0.2) is False and rank0.refused is None
        assert StoreClient(server.address).stats().instances == 1  # rank 0 still in
    finally:
        rank1.close()
        rank0.close()


def test_a_namespace_another_tenant_owns_is_refused(tmp_path, shms, caplog):
    """Over mutual TLS the first principal to register in a client namespace
    owns it for the store's life: another's registration there is
    PERMISSION_DENIED, raised by the wait, one ERROR."""
    from kvstore.testing.pki import Pki

    caplog.set_level(logging.DEBUG)
    pki = Pki(tmp_path)
    store = ServerThread(**CONFIG, transfer=False, tls=pki.server)
    owner = kept(store.address, [layer(shms())], tls=pki.issue("tenant-a"))
    other = kept(store.address, [layer(shms())], instance="engine-b", tls=pki.issue("tenant-b"))
    try:
        owner.start()
        assert owner.wait_ready(5)
        other.start()
        with pytest.raises(KVError) as err:
            other.wait_ready(3)
        assert err.value.code is Code.PERMISSION_DENIED
        assert "llama3-8b" in str(err.value)
        time.sleep(20 * RETRY_S)
        errors = [r for r in records(caplog, logging.ERROR) if "engine-b" in r.getMessage()]
        assert len(errors) == 1
        assert owner.live() is not None  # the owner is untouched
    finally:
        other.close()
        owner.close()
        store.stop()


def test_a_refusal_that_names_a_previous_engines_rank_clears_when_it_leaves(server, shms, caplog):
    """An engine restarted with another TP under the same instance id while the
    old engine's rank 1 is still held: the store refuses the new rank (its
    world_size disagrees). Once the old rank leaves, the next attempt seals,
    with no restart of the new engine (a reviewer showed the first version of
    this change refusing it for good)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    old = kept(server.address, [layer(shms())], rank=1, world=2, seal_timeout=0.1)
    new = kept(server.address, [layer(shms())], world=1)
    try:
        old.start()  # registered, waiting for its rank 0 forever
        new.start()
        with pytest.raises(KVError) as err:
            new.wait_ready(3)
        assert err.value.code is Code.INVALID_ARGUMENT and "world_size" in str(err.value)
        old.close()
        assert wait_for(lambda: new.live() is not None, timeout=10)  # retried, sealed
        assert new.wait_ready(0) and new.refused is None
        said = [r.getMessage() for r in records(caplog) if r.levelno >= logging.WARNING]
        assert sum("cannot register" in m for m in said) == 1, said
        assert any("after its refusal" in m for m in said), said
    finally:
        new.close()
        old.close()


def test_the_vllm_worker_wait_raises_the_refusal_and_its_steps_go_on(server, shms):
    """What the connector's caller sees: its wait raises; loads and saves of the
    rank that serves without the store neither raise nor call it."""
    spec = RankSpec("vllm-bad", "tiny", "kvstore-blake3-v1", BS)
    worker = WorkerSide(StoreClient(server.address), spec, seal_timeout=5, retry_s=RETRY_S)
    shm = shms()
    try:
        worker.register([layer(shm, tensor=shm.tensor[..., : HD // 2])])
        with pytest.raises(KVError, match="dense"):
            worker.wait_ready(3)
        worker.save([(1, 0)])
        assert StoreClient(server.address).stats().instances == 0
    finally:
        worker.close()


class StoreOnPort(ServerThread):
    """A store server on a given port: the store restarted where the rank looks."""

    def __init__(self, port: int):
        self.loop = asyncio.new_event_loop()
        self.server = StoreServer(ServerConfig(port=port, **CONFIG))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"


def test_a_store_restart_is_retried_and_logged_once_without_tracebacks(shms, caplog):
    """UNAVAILABLE while the store is down is retried until it is back; the
    outage is one warning for the loss, one for the failed attempts, one when
    sealed again."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    store = ServerThread(**CONFIG)
    rank = kept(store.address, [layer(shms())])
    try:
        rank.start()
        assert rank.wait_ready(5)
        store.stop()
        store = None
        assert wait_for(lambda: rank.live() is None, timeout=10)
        time.sleep(20 * RETRY_S)  # many attempts against a closed port
        assert rank.wait_ready(0) is False  # not refused: no raise
        store = StoreOnPort(int(rank.client.address.rsplit(":", 1)[1]))
        assert rank.wait_ready(10)
        warnings = [r.getMessage() for r in records(caplog, logging.WARNING)]
        assert len(warnings) == 3, warnings
        assert "lost" in warnings[0]
        assert "could not register" in warnings[1] and "UNAVAILABLE" in warnings[1]
        assert "sealed again" in warnings[2]
        assert not records(caplog, logging.ERROR)
        assert all(r.exc_info is None for r in records(caplog))
        failed = [r for r in records(caplog) if "could not register" in r.getMessage()]
        assert len(failed) > 2  # retried, the rest at debug
    finally:
        rank.close()
        if store is not None:
            store.stop()


def test_an_unexpected_exception_is_retried_with_one_traceback_an_outage(server, shms, caplog):
    """grpc's ValueError on a closed channel is no KVError and no fault of the
    layers: retried, its traceback logged once, not once per attempt (before:
    log.exception on every retry)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    rank = kept(server.address, [layer(shms())])
    rank.client.close()
    try:
        rank.start()
        time.sleep(20 * RETRY_S)
        assert rank.wait_ready(0) is False  # not refused: no raise
        failed = [r for r in records(caplog) if "could not register" in r.getMessage()]
        assert len(failed) > 2  # still retried
        traced = [r for r in records(caplog) if r.exc_info is not None]
        assert len(traced) == 1 and traced[0].levelno == logging.WARNING
        assert isinstance(traced[0].exc_info[1], ValueError)
        assert not records(caplog, logging.ERROR)
    finally:
        rank.close()


def test_a_store_out_of_file_descriptors_is_logged_as_the_stores_problem(shms, caplog):
    """The store (its own process) cannot open the rank's shared memory for want
    of descriptors: RESOURCE_EXHAUSTED. Before: the store said FAILED_PRECONDITION
    and the rank logged an ERROR telling its operator to make the store able to
    map this memory, and wait_ready raised it as the rank's refusal. Now one
    warning saying the store is short and its operator must raise its limit; not
    a refusal; retried, and sealed once the store's limit is raised."""
    from tests.service.store_process import StoreProcess

    caplog.set_level(logging.DEBUG, logger=LOGGER)
    store = StoreProcess()
    rank = kept(store.address, [layer(shms())])
    try:
        rank.client.stats()  # connected before the store runs short
        store.starve_files(free=0)
        rank.start()  # its first attempt fails before start returns
        assert rank.wait_ready(0) is False and rank.refused is None  # not a refusal
        assert not records(caplog, logging.ERROR)
        warned = [r.getMessage() for r in records(caplog, logging.WARNING)]
        assert len(warned) == 1, warned
        for words in ("RESOURCE_EXHAUSTED", "ulimit -n", "short of its own resources"):
            assert words in warned[0], warned[0]
        store.restore()
        assert rank.wait_ready(10)
        assert not records(caplog, logging.ERROR)
    finally:
        rank.close()
        store.stop()
