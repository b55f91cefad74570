"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

Plain Python (no SGLang import). The extra config is one JSON object shared
with SGLang's own keys, so a misspelt kvstore key (``"adress"``,
``"io_timeout"``) would otherwise be ignored and the backend run on its
default; and a value such as ``"timeout_s": "fast"`` failed with a message
that named no key. :func:`read_settings` refuses both with a ValueError
naming the key, which SGLang raises at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEFAULT_ADDRESS = "127.0.0.1:50051"

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
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")
KVSTORE_KEYS = frozenset(_TEXT) | frozenset(_SECONDS) | frozenset(_FLAGS)


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
    unknown = sorted(str(k) for k in extra if k not in KVSTORE_KEYS | SGLANG_KEYS)
    if unknown:
        raise ValueError(
            f"kvstore HiCache backend: unknown key(s) {', '.join(map(repr, unknown))} in "
            "--hicache-storage-backend-extra-config; kvstore reads "
            f"{', '.join(sorted(KVSTORE_KEYS))} (SGLang: {', '.join(sorted(SGLANG_KEYS))})"
        )
    values: dict[str, Any] = {}
    for key, default in _TEXT.items():
        values[key] = _text(key, extra.get(key, default))
    for key, default in _SECONDS.items():
        values[key] = _seconds(key, extra.get(key, default))
    for key, default in _FLAGS.items():
        values[key] = _flag(key, extra.get(key, default))
    return BackendSettings(**values)


def _text(key: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"kvstore HiCache backend: {key} must be a string, got {value!r}")
    return value


def _seconds(key: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"kvstore HiCache backend: {key} must be a number of seconds above 0, got {value!r}"
        )
    return seconds


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"kvstore HiCache backend: {key} must be true or false, got {value!r}")
