"""What an engine's blocks are keyed by: the model's identity and vLLM's hash scheme.

vLLM's block hashes chain token ids (and LoRA, multimodal and salt keys) but
carry no model identity, and kvstore's layout fingerprint covers shapes, not
weights: two checkpoints of one architecture (a fine-tune, another revision)
would load each other's KV and silently produce wrong output. So the client
namespace a connector registers names the weights:

    <served model name>-<16 hex digits of a digest of the checkpoint>

The digest (:mod:`kvstore.integrations.checkpoint`) covers the checkpoint's
config, revision, quantisation, every weights file's content, and the engine
settings that change weights or KV without changing files (dummy weights,
``hf_overrides``, the compute dtype).
``kv_connector_extra_config`` may set ``namespace`` (the whole client
namespace) or ``model_digest`` (the part after the name) instead.

``hash_format`` names vLLM's scheme: algorithm, the low 64 bits kvstore keys
by (as vLLM's KV events publish them), and a digest of the NONE_HASH seed, so
engines whose hashes differ never share blocks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import blake3

from kvstore.integrations.checkpoint import DIGEST_HEX, checkpoint_digest

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
MAX_NAME = 64


def block_key(block_hash: bytes | int) -> int:
    """kvstore's key of one vLLM block hash: its low 64 bits, big-endian."""
    if isinstance(block_hash, int):
        return block_hash & (2**64 - 1)
    return int.from_bytes(bytes(block_hash), "big") & (2**64 - 1)


def hash_format(algo: str, none_hash_seed: str) -> str:
    """``vllm-<algo>-lo64-<12 hex digits of the seed>``, e.g. ``vllm-sha256-lo64-3f2a...``."""
    seed = blake3.blake3(none_hash_seed.encode()).hexdigest()[:12]
    return f"vllm-{algo}-lo64-{seed}"


def client_namespace(
    model_name: str,
    model_path: str,
    *,
    revision: str | None = None,
    quantization: str | None = None,
    override: str | None = None,
    model_digest: str | None = None,
    variant: Sequence[str] = (),
) -> str:
    """The client namespace of a model's blocks (see the module docstring);
    ``variant``: :func:`kvstore.integrations.checkpoint.variant_of`."""
    if override:
        return override
    name = _UNSAFE.sub("-", model_name.rsplit("/", 1)[-1]).strip("-")[:MAX_NAME] or "model"
    digest = model_digest or checkpoint_digest(model_path, revision, quantization, variant)
    return f"{name}-{_UNSAFE.sub('-', digest)[:DIGEST_HEX]}"


def none_hash_seed(algo: str, instance_id: str) -> str:
    """The seed vLLM derives NONE_HASH from, as a worker process can know it.

    The scheduler process knows the real one (``get_none_hash_seed``); a worker
    sees PYTHONHASHSEED or, for cryptographic algorithms, vLLM's fixed default.
    A non-cryptographic algorithm without PYTHONHASHSEED gets a random seed per
    process in vLLM, so its blocks are never shared: this returns a seed of
    the engine's ``instance_id`` alone, the same for every rank (a random one
    per rank made them disagree, so the instance never sealed and startup
    waited out the seal timeout), which the scheduler's random one never
    matches, so the cache stays off, as it must.
    """
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    if (seed := os.environ.get("PYTHONHASHSEED")) is not None:
        return seed
    if algo.startswith("sha256"):
        return DEFAULT_NONE_HASH_SEED
    return f"unshared:{instance_id}"
