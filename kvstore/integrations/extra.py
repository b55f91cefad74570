"""Values of an engine's extra config for kvstore (vLLM's kv_connector_extra_config,
SGLang's storage extra config): JSON or a command line gives them, so types vary.

Each reader takes the value as given (or its default) and returns it typed, or
raises a ValueError naming ``owner`` (what reads the config, as the engine's
log will show it) and the key: a misspelt key or a value of the wrong kind is
refused at start, never run on a default in silence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")
DEFAULT_ADDRESS = "127.0.0.1:50051"  # the store an engine calls unless told (serve's port)
NONE: Mapping[str, Any] = MappingProxyType({})


def read_extra(
    owner: str,
    extra: Mapping[str, Any],
    texts: Mapping[str, str],
    times: Mapping[str, float],
    flags: Mapping[str, bool],
    counts: Mapping[str, int] = NONE,
    others: Iterable[str] = (),
) -> dict[str, Any]:
    """kvstore's keys of ``extra``, each read as its kind (``texts`` by
    :func:`text`, ``times`` by :func:`seconds`, ...; each mapping gives its keys'
    defaults), after :func:`check_keys` (``others``: the engine's own keys)."""
    kinds = ((texts, text), (times, seconds), (flags, flag), (counts, count))
    check_keys(owner, extra, [key for keys, _ in kinds for key in keys], others)
    return {
        key: read(owner, key, extra.get(key, default))
        for defaults, read in kinds
        for key, default in defaults.items()
    }


def check_keys(
    owner: str, extra: Mapping[str, Any], known: Iterable[str], others: Iterable[str] = ()
) -> None:
    """ValueError naming every key of ``extra`` that neither kvstore (``known``) nor
    the engine itself (``others``) reads."""
    known, others = sorted(known), sorted(others)
    unknown = sorted(str(k) for k in extra if k not in known and k not in others)
    if not unknown:
        return
    engine = f" (the engine's own: {', '.join(others)})" if others else ""
    raise ValueError(
        f"{owner}: unknown key(s) {', '.join(map(repr, unknown))} in its extra config; "
        f"kvstore reads {', '.join(known)}{engine}"
    )


def text(owner: str, key: str, value: Any) -> str:
    """A string (None: empty)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{owner}: {key} must be a string, got {value!r}")
    return value


def seconds(owner: str, key: str, value: Any) -> float:
    """A finite number of seconds above 0 (a number or its text)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{owner}: {key} must be a number of seconds above 0, got {value!r}")
    return number


def count(owner: str, key: str, value: Any, most: int | None = None) -> int:
    """A whole number above 0 (a number or its text), at most ``most`` when given."""
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        number = 0
    if number <= 0 or (most is not None and number > most):
        bound = "" if most is None else f" and at most {most}"
        raise ValueError(f"{owner}: {key} must be a whole number above 0{bound}, got {value!r}")
    return number


def flag(owner: str, key: str, value: Any) -> bool:
    """true or false: a boolean, 0 or 1, or their words (``"flase"`` is refused)."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f"{owner}: {key} must be true or false, got {value!r}")
