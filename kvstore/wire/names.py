"""What a valid name is: namespaces, final namespaces, tokens, printable names, u64.

One home for every rule a name on the wire must meet (``docs/design.md`` §1):
the registry, the router, the transfer wire format and the services import
these and never restate them.
"""

from __future__ import annotations

import re

from kvstore.wire import limits
from kvstore.wire.errors import invalid

U64_MAX = (1 << 64) - 1
FINGERPRINT_HEX = 16
# "<client namespace>.<16 hex fingerprint>"
MAX_FINAL_NAMESPACE_LEN = limits.MAX_NAMESPACE_LEN + 1 + FINGERPRINT_HEX

NAMESPACE_RE = re.compile(rf"[A-Za-z0-9_-]{{1,{limits.MAX_NAMESPACE_LEN}}}")
FINAL_NAMESPACE_RE = re.compile(
    rf"[A-Za-z0-9_-]{{1,{limits.MAX_NAMESPACE_LEN}}}\.[0-9a-f]{{{FINGERPRINT_HEX}}}"
)
TOKEN_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # roles, hash formats, needs


def final_namespace(client_namespace: str, fingerprint: str) -> str:
    """The namespace blocks of a sealed instance live in."""
    return f"{client_namespace}.{fingerprint}"


def client_namespace_of(final: str) -> str:
    """The client namespace a final namespace ``"<client>.<fingerprint>"`` belongs to."""
    return final.rpartition(".")[0]


def is_client_namespace(ns: str) -> bool:
    return NAMESPACE_RE.fullmatch(ns) is not None


def is_final_namespace(ns: str) -> bool:
    return FINAL_NAMESPACE_RE.fullmatch(ns) is not None


def check_final_namespace(where: str, ns: str) -> None:
    if not is_final_namespace(ns):
        raise invalid(f"{where}: {ns[:64]!r} is not '<client namespace>.<16 hex fingerprint>'")


def is_name(value: str) -> bool:
    """1..MAX_NAME_LEN printable characters."""
    return 0 < len(value) <= limits.MAX_NAME_LEN and value.isprintable()


def check_name(where: str, value: str) -> None:
    """INVALID_ARGUMENT naming ``where`` unless ``value`` :func:`is_name`."""
    if not is_name(value):
        raise invalid(
            f"{where}: must be 1-{limits.MAX_NAME_LEN} printable characters, got {value[:64]!r}"
        )


def check_token(where: str, value: str) -> None:
    if not TOKEN_RE.fullmatch(value):
        raise invalid(f"{where}: {value[:64]!r} does not match [A-Za-z0-9_.:-]{{1,64}}")


def is_u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX


def device_uuid(raw_uuid: object) -> str:
    """A CUDA device's UUID as the wire carries it: "GPU-" and the driver's UUID text.

    Workers send it with a CUDA IPC handle; the store opens the handle only on
    the local device whose UUID reads the same.
    """
    return f"GPU-{raw_uuid}"
