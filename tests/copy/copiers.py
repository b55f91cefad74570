"""The host copier's variants the copy tests run every case through: every code path of
HostCopier (Python loop, C memcpy, C streaming stores, threads splitting pieces).
Native ones need a C compiler and are left out without one."""

from __future__ import annotations

from kvstore.copy import HostCopier
from kvstore.copy.host import native_copy_function

HOST_MODES = {
    "python": {"backend": "python"},
    "python-threads": {"backend": "python", "num_threads": 3, "parallel_min_bytes": 0},
    "native": {"backend": "native", "streaming_min_bytes": 1 << 62},
    "native-streaming": {"backend": "native", "streaming_min_bytes": 0},
    "native-threads": {
        "backend": "native",
        "num_threads": 3,
        "parallel_min_bytes": 0,
        "streaming_min_bytes": 0,
    },
}
if native_copy_function() is None:
    HOST_MODES = {k: v for k, v in HOST_MODES.items() if not k.startswith("native")}


def host_copier(mode: str) -> HostCopier:
    return HostCopier(**HOST_MODES[mode])
