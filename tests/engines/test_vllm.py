"""kvstore behind real vLLM (CPU build, tiny Llama, greedy): every claim against a baseline.

Each engine is a fresh process; stores are real ``kvstore serve`` processes.
Token ids and logprobs are compared with an engine that has no connector.
"""

from __future__ import annotations

import random
import time

import pytest

from kvstore.testing.engines import Engine, StoreProcess
from tests.engines.conftest import BAD_EXTRA_CONFIG

BLOCK = 32
MAX_TOKENS = 8


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


SHARED = prompt(0, 160)
PROMPTS = {
    "p": SHARED + prompt(1, 40),  # 200 tokens: 6 claimable blocks
    "q": prompt(2, 150),
    "r": SHARED + prompt(3, 45),
}
HIT_P = (len(PROMPTS["p"]) - 1) // BLOCK * BLOCK  # 192


def spec(model: str, runs: list, connector: dict | None = None, **kw) -> dict:
    """An engine spec; a tp-1 engine runs in one process unless ``one_process=False``.

    One process halves an engine's start on two cores. vLLM's own split into
    processes (the connector's metadata crossing them) is kept by the tp-2 test
    and the store-killed test.
    """
    phases = [r if isinstance(r, dict) else {"run": [r]} for r in runs]
    kw.setdefault("one_process", kw.get("tp", 1) == 1)
    return {
        "model": model,
        "prompts": PROMPTS,
        "phases": phases,
        "connector": connector,
        "max_tokens": MAX_TOKENS,
        "block_size": BLOCK,
        "max_model_len": 512,
        **kw,
    }


def run(workdir, name, *args, **kw) -> list[dict]:
    return Engine(workdir, name, spec(*args, **kw)).wait()


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


@pytest.fixture(scope="module")
def baseline(models, workdir) -> dict[str, dict]:
    """m0 without a connector."""
    out = run(workdir, "baseline", models["m0"], ["p", "q", "r"])
    return {r["prompt"]: r for r in out}


@pytest.fixture(scope="module")
def store(workdir):
    s = StoreProcess(workdir, "a", transfer=True)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def seeded(models, workdir, store) -> list[dict]:
    """The store after a first m0 engine with the connector ran prompt p."""
    return run(workdir, "first", models["m0"], ["p"], {"address": store.address})


def test_fresh_engine_loads_the_prefix_another_engine_saved(
    models, workdir, baseline, store, seeded
):
    assert seeded[0]["num_cached_tokens"] == 0
    same_output(seeded[0], baseline["p"])
    assert store.stats().sealed_blocks >= HIT_P // BLOCK

    conn = {"address": store.address}
    # found by name through kvstore's vllm.general_plugins entry point
    second = run(workdir, "second", models["m0"], ["p", "r"], conn, connector_by_name=True)
    assert second[0]["num_cached_tokens"] == HIT_P  # vLLM reports the external hit
    same_output(second[0], baseline["p"])
    assert second[1]["num_cached_tokens"] >= len(SHARED) // BLOCK * BLOCK  # shared prefix
    same_output(second[1], baseline["r"])
    assert store.stats().hits >= HIT_P // BLOCK


def test_other_weights_or_layout_never_hit(models, workdir, baseline, store):
    """m1 has m0's architecture and other weights; a block size of 64 is another layout."""
    conn = {"address": store.address}
    other = run(workdir, "m1", models["m1"], ["p"], conn)
    assert other[0]["num_cached_tokens"] == 0
    assert other[0]["tokens"] != baseline["p"]["tokens"]
    wider = run(workdir, "bs64", models["m0"], ["p"], conn, block_size=64)
    assert wider[0]["num_cached_tokens"] == 0
    same_output(wider[0], baseline["p"])


def test_negative_control_foreign_bytes_change_the_output(models, workdir, baseline):
    """Forcing one namespace on two weights makes m0 load m1's KV: the loaded bytes are used."""
    s = StoreProcess(workdir, "neg")
    try:
        conn = {"address": s.address, "namespace": "forced-same"}
        run(workdir, "neg-m1", models["m1"], ["p"], conn)
        loaded = run(workdir, "neg-m0", models["m0"], ["p"], conn)
        assert loaded[0]["num_cached_tokens"] == HIT_P
        assert loaded[0]["tokens"] != baseline["p"]["tokens"]
    finally:
        s.kill()


def test_tensor_parallel_two_hits_give_the_tp2_baseline(models, workdir):
    s = StoreProcess(workdir, "tp2")
    try:
        base = run(workdir, "tp2-base", models["m0"], ["p"], tp=2)
        conn = {"address": s.address}
        out = run(workdir, "tp2", models["m0"], ["p", {"reset": True}, "p"], conn, tp=2)
        assert out[0]["num_cached_tokens"] == 0
        assert out[1]["num_cached_tokens"] == HIT_P
        same_output(out[0], base[0])
        same_output(out[1], base[0])
        assert s.stats().sealed_instances == 0  # both ranks left with the engine
    finally:
        s.kill()


def test_an_engine_on_another_store_gets_its_blocks_over_ucx(
    models, workdir, baseline, store, seeded
):
    """Store b knows store a as a peer; the engine on b prefetches a's blocks."""
    b = StoreProcess(workdir, "b", "--peer", f"127.0.0.1:{store.ucx_port}", transfer=True)
    try:
        out = run(workdir, "on-b", models["m0"], ["p"], {"address": b.address, "prefetch": True})
        assert out[0]["num_cached_tokens"] == HIT_P
        same_output(out[0], baseline["p"])
        assert b.stats().sealed_blocks >= HIT_P // BLOCK
    finally:
        b.kill()


def test_store_killed_mid_run_engine_recomputes_then_reconnects(models, workdir, baseline):
    s = StoreProcess(workdir, "killed")
    signals = {k: workdir / f"kill-{k}" for k in ("saved", "killed", "served", "back")}
    phases = [
        "p",
        {"touch": str(signals["saved"])},
        {"wait_file": str(signals["killed"])},
        "q",
        {"touch": str(signals["served"])},
        {"wait_file": str(signals["back"])},
        "r",  # saved to the new store by the re-registered worker
        # the scheduler's channel finds the store within its reconnect backoff (1 s)
        {"until_cached": "r", "min_tokens": HIT_P - BLOCK, "timeout": 20},
    ]
    engine = Engine(
        workdir,
        "killed",
        spec(models["m0"], phases, {"address": s.address, "retry_s": 0.5}, one_process=False),
    )
    try:
        wait_file(signals["saved"], engine)
        s.kill()
        signals["killed"].touch()
        wait_file(signals["served"], engine)
        s.start()  # an empty store on the same port
        deadline = time.monotonic() + 30
        # the worker re-registers by itself; the store seals first, then the rank hears it
        while s.stats().sealed_instances < 1 or "sealed again" not in engine.log():
            assert time.monotonic() < deadline, "the engine never re-registered"
            time.sleep(0.2)
        signals["back"].touch()
        out = engine.wait()
    finally:
        s.kill()
    same_output(out[1], baseline["q"])  # served while the store was down
    assert out[3]["num_cached_tokens"] >= HIT_P - BLOCK  # saved to and loaded from the new store
    same_output(out[3], baseline["r"])
    log = engine.log()
    assert "unreachable" in log and "recomputed" in log
    assert "re-registering" in log and "is back" in log
    assert "kv_load_failure_policy 'fail' -> 'recompute'" in log  # vLLM's default, adopted


def wait_file(path, engine: Engine, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if engine.proc.poll() is not None:
            engine.wait()  # raises with the engine's log
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


def test_ranks_without_pythonhashseed_agree_on_one_unshared_hash_format(vllm_ready, monkeypatch):
    """A non-cryptographic hash without PYTHONHASHSEED: vLLM seeds NONE_HASH at
    random per process, so no two engines may share blocks. Every rank of one
    engine must still register one hash_format: a random seed per rank made
    them disagree, so the instance never sealed and startup waited out the
    seal timeout."""
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    from kvstore.integrations.vllm.identity import hash_format, none_hash_seed

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rank0, rank1 = (hash_format("xxhash", none_hash_seed("xxhash", "engine-1")) for _ in range(2))
    assert rank0 == rank1
    assert rank0 != hash_format("xxhash", none_hash_seed("xxhash", "engine-2"))
    assert none_hash_seed("sha256", "engine-1") == DEFAULT_NONE_HASH_SEED  # shared, as vLLM's
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash_seed("xxhash", "engine-1") == "7"


def _vllm_config(extra: dict | None = None):
    """The parts of a VllmConfig the connector's Settings read."""
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        data_parallel_size=1,
        data_parallel_rank=0,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}, engine_id="e"),
        model_config=SimpleNamespace(
            served_model_name="m",
            model="/nonexistent/m",
            revision=None,
            quantization=None,
            hf_overrides={},
            dtype="bfloat16",
        ),
        load_config=SimpleNamespace(load_format="auto"),
        parallel_config=parallel,
        cache_config=SimpleNamespace(block_size=32, prefix_caching_hash_algo="sha256"),
    )


@pytest.mark.parametrize(
    "option", ["decode_context_parallel_size", "prefill_context_parallel_size"]
)
def test_context_parallelism_is_refused_at_start_naming_it(vllm_ready, option):
    """With context parallelism vLLM's scheduler blocks span several cache blocks:
    the connector loaded blocks at positions off by that factor (silently wrong
    output). It now refuses to start, naming the setting."""
    from kvstore.integrations.vllm.connector import Settings

    config = _vllm_config({"namespace": "m.0123456789abcdef"})
    assert Settings.from_vllm(config).block_size == 32
    setattr(config.parallel_config, option, 2)
    with pytest.raises(ValueError, match=option):
        Settings.from_vllm(config)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        *BAD_EXTRA_CONFIG,
        ({"lease_ms": 1.5}, "lease_ms must be a whole number"),
        # past the store's bound every leased Query was refused; past 2^32 protobuf raised
        ({"lease_ms": 600_001}, "lease_ms must be a whole number above 0 and at most 600000"),
        ({"lease_ms": 1 << 32}, "at most 600000"),
    ],
)
def test_a_bad_extra_config_key_is_refused_at_start_naming_it(vllm_ready, extra, named):
    """Before: the connector read its keys with ``extra.get`` and ignored the
    rest, so a misspelt key ran the engine on the default (another store, a
    minute's deadline) without a word, ``"prefetch": "flase"`` turned prefetch
    on, and a non-number failed naming no key (found by the SGLang review, which
    fixed the same there). Now a ValueError naming the key, at start; every
    kvstore key is accepted."""
    from kvstore.integrations.vllm.connector import Settings

    with pytest.raises(ValueError, match=named):
        Settings.from_vllm(_vllm_config({"namespace": "m.0123456789abcdef", **extra}))
    good = {
        "address": "127.0.0.1:1",
        "namespace": "m.0123456789abcdef",
        "lease_ms": "30000",
        "prefetch": "on",
        "seal_timeout_s": "30",
        "retry_s": 0.5,
        "io_timeout_s": 10,
        "recompute_failed_loads": False,
    }
    settings = Settings.from_vllm(_vllm_config(good))
    assert (settings.address, settings.lease_ms, settings.prefetch) == ("127.0.0.1:1", 30000, True)
    assert settings.seal_timeout_s == 30 and settings.retry_s == 0.5
    assert settings.recompute_failed_loads is False
