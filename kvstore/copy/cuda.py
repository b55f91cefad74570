"""GPU copy path: one CUDA launch per request moves every piece.

The kernel source ships inside the package (``kvstore/copy/kernels/``, also
reachable as the repository's top-level ``kernels/``) and is compiled at run
time by CuPy through NVRTC (cached by CuPy per device and source). CuPy is
imported lazily so the host path works without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvstore.copy.plan import Pieces, check_disjoint, split_pieces

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
KERNEL_FILE = KERNELS_DIR / "copy.cu"
KERNEL_NAME = "kvstore_copy_chunks"
MAX_GRID = 65535  # CUDA blocks stride over chunks beyond this


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


class CudaCopier:
    """Moves a plan's pieces between device memory ranges on one GPU.

    Pieces are cut into chunks of at most `chunk_bytes` (so a few huge pieces
    still spread over the whole GPU), uploaded as one table in one transfer,
    and copied by a single kernel launch on `stream` (per call, else the one
    given at construction, else CuPy's current stream). save/load return the
    bytes moved once the work is enqueued: synchronise the stream before
    relying on the data.
    """

    def __init__(
        self,
        device: int = 0,
        stream: Any | None = None,
        threads_per_block: int = 256,
        chunk_bytes: int = 64 << 10,
        check_overlap: bool = True,
    ) -> None:
        import cupy

        if chunk_bytes % 16:
            raise ValueError("chunk_bytes must be a multiple of 16 to keep 16-byte alignment")
        self._cp = cupy
        self.device = device
        self.stream = stream
        self.threads_per_block = threads_per_block
        self.chunk_bytes = chunk_bytes
        self.check_overlap = check_overlap
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
            self._kernel = module.get_function(KERNEL_NAME)

    def save(self, pieces: Pieces, stream: Any | None = None) -> int:
        """Paged KV -> slots (enqueued on the stream)."""
        return self._launch(pieces.paged_addr, pieces.slot_addr, pieces.nbytes, "slot", stream)

    def load(self, pieces: Pieces, stream: Any | None = None) -> int:
        """Slots -> paged KV (enqueued on the stream)."""
        return self._launch(pieces.slot_addr, pieces.paged_addr, pieces.nbytes, "paged", stream)

    def _launch(
        self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, side: str, stream: Any | None
    ) -> int:
        if len(nbytes) == 0:
            return 0
        if self.check_overlap:
            check_disjoint(dst, nbytes, side)
        total = int(nbytes.sum(dtype=np.uint64))
        src, dst, nbytes = split_pieces(src, dst, nbytes, self.chunk_bytes)
        table = np.ascontiguousarray(np.concatenate([src, dst, nbytes]), dtype=np.uint64)
        count = len(nbytes)
        cp = self._cp
        with cp.cuda.Device(self.device):
            s = self._pick_stream(stream)
            with s:  # the table's memory belongs to this stream, so reuse is stream-ordered
                d_table = cp.empty(table.size, dtype=cp.uint64)
                d_table.set(table, stream=s)
                grid = (min(count, MAX_GRID),)
                block = (self.threads_per_block,)
                self._kernel(grid, block, (d_table, np.uint64(count)), stream=s)
        return total

    def _pick_stream(self, stream: Any | None) -> Any:
        """The call's stream, else the copier's, else CuPy's current one."""
        if stream is not None:
            return stream
        if self.stream is not None:
            return self.stream
        return self._cp.cuda.get_current_stream()
