"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

Plain Python (no SGLang import). The extra config is one JSON object shared
with SGLang's own keys, so a misspelt kvstore key (``"adress"``,
``"io_timeout"``) would otherwise be ignored and the backend run on its
default; and a value such as ``"timeout_s": "fast"`` failed with a message
that named no key. :func:`read_settings` refuses both with a ValueError
naming the key, which SGLang raises at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.integrations.extra import DEFAULT_ADDRESS, read_extra

OWNER = "kvstore HiCache backend"  # what the engine's log shows refusing a key

# Keys SGLang itself reads from, or leaves in, a dynamic backend's extra config
# (0.5.23: the factory, the shm allocator, the zero-copy switch, the prefetch
# knobs its controller pops before the backend sees them).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "allocator",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
# kvstore's keys: name -> default; numbers are seconds, finite and above 0
_TEXT = {
    "address": DEFAULT_ADDRESS,
    "namespace": "",
    "model_digest": "",
    "instance_id": "",
    "kv_cache_dtype": "",
    "tls_ca": "",
    "tls_cert": "",
    "tls_key": "",
}
_SECONDS = {"seal_timeout_s": 60.0, "retry_s": 5.0, "timeout_s": 5.0, "io_timeout_s": 60.0}
_FLAGS = {"prefetch": False}


@dataclass(frozen=True)
class BackendSettings:
    """kvstore's part of the extra config (README, "Extra config keys")."""

    address: str
    namespace: str  # "" : <model>-<digest>-<layout>
    model_digest: str  # "" : the checkpoint's digest
    instance_id: str  # "" : from the parent pid
    kv_cache_dtype: str  # "" : SGLang's --kv-cache-dtype, where its context tells it
    tls_ca: str
    tls_cert: str
    tls_key: str
    seal_timeout_s: float
    retry_s: float
    timeout_s: float
    io_timeout_s: float
    prefetch: bool


def read_settings(extra: dict[str, Any]) -> BackendSettings:
    """kvstore's settings of ``extra``; ValueError naming the key for a key neither
    kvstore nor SGLang reads, or a value of the wrong kind."""
    return BackendSettings(**read_extra(OWNER, extra, _TEXT, _SECONDS, _FLAGS, others=SGLANG_KEYS))
