"""The child process of :mod:`kvstore.transfer.card_vetting`: loads peers' cards
into a NIXL agent of its own, so that a card UCX cannot parse ends this process,
not the store.

    python -P kvstore/transfer/card_check.py NIXL_MODULE BACKEND

Run as a file, not as ``-m``: it imports the standard library and NIXL only (not
kvstore, whose transfer package starts ucxx); ``-P`` keeps this directory, whose
modules have names like ``wire`` and ``errors``, off ``sys.path``. Writes ``R`` on
stdout once its agent is up; then for each card on stdin (4-byte big-endian
length, then the agent metadata) one byte: 1 when NIXL loaded it (it is dropped
again at once), 0 when NIXL refused it. Everything else this process prints goes
to stderr. Ends at end of input.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import struct
import sys

LENGTH = struct.Struct(">I")
MAX_METADATA_BYTES = 256 << 10  # kvstore.transfer.rma's bound; a longer card is refused


def _read(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def main() -> None:
    module, backend = sys.argv[1], sys.argv[2]
    # the answers keep stdout's pipe to themselves: what UCX or NIXL print (UCX logs
    # to stdout, NIXL's Python half too) goes to stderr, never among the answers
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    nixl = importlib.import_module(module)
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[backend])
    agent = nixl.nixl_agent(f"kvstore-card-check-{os.getpid()}", config)
    inp = sys.stdin.buffer
    out.write(b"R")
    while (head := _read(inp, LENGTH.size)) is not None:
        (length,) = LENGTH.unpack(head)
        if length > MAX_METADATA_BYTES:
            return
        metadata = _read(inp, length)
        if metadata is None:
            return
        try:
            name = agent.add_remote_agent(metadata)
        except Exception:  # noqa: BLE001 - whatever NIXL raises, it refused the card
            verdict = b"\0"
        else:
            verdict = b"\1"
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
        out.write(verdict)


if __name__ == "__main__":
    main()
