"""Where memory lives: the host ("cpu") or one GPU ("cuda:N").

    Device.parse("cuda:1")   # Device(gpu=1); str() gives "cuda:1" back
    Device.parse("cuda")     # GPU 0, as torch reads it
    Device.parse("cpu")      # HOST

One parser for every room that is handed a device name: the copier, the copy
jobs, the one-sided transfer's regions and the store server's ``--device``
(which also takes ``auto``, and ``cuda`` for every GPU, before it comes here).
"""

from __future__ import annotations

from typing import NamedTuple


class Device(NamedTuple):
    """The host, or one GPU by its CUDA index."""

    gpu: int | None  # None: host memory

    @classmethod
    def parse(cls, text: str) -> Device:
        """``cpu``, ``cuda`` (GPU 0) or ``cuda:N``; ValueError names what came."""
        if text == "cpu":
            return HOST
        kind, sep, index = text.partition(":")
        if kind == "cuda" and not sep:
            return cls(0)
        if kind == "cuda" and index.isascii() and index.isdigit():
            return cls(int(index))
        raise ValueError(f"device {text!r}: expected cpu, cuda or cuda:N")

    @property
    def is_host(self) -> bool:
        return self.gpu is None

    def __str__(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"


HOST = Device(None)
