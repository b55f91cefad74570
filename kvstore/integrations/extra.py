"""Values of an engine's extra config for kvstore (vLLM's kv_connector_extra_config,
SGLang's storage extra config): JSON or a command line gives them, so types vary."""

from __future__ import annotations

from typing import Any


def flag(value: Any) -> bool:
    """A boolean of the extra config: "false", "0", "no", "off" and "" are False."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)
