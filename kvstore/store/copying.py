"""Moving one request's bytes between a worker's paged cache and the pool.

A :class:`CopyJob` is planned on the event loop (which slots, which block
ids) and run by :func:`run_job`: in a worker thread (:func:`copy_in_thread`),
or on the loop itself when it is a host copy of at most ``INLINE_MAX_BYTES``. By blocks (always on
the host; on a GPU with ``kvstore serve --gpu-copy blocks``) it goes through the
registration's :class:`~kvstore.copy.RegionTable`: descriptors built once, per
request only block ids and slot addresses, on the copier's own stream. By
pieces (GPUs by default, until the blocks kernel has been measured on one) it
plans every piece and gets a stream per request (:func:`run_copy`;
docs/design.md §3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.copy import DeviceFault, cuda_errors, plan
from kvstore.wire.devices import Device

if TYPE_CHECKING:
    from kvstore.copy import RegionTable

SAVE = "save"  # paged cache -> slots
LOAD = "load"  # slots -> paged cache
# A host copy this small runs on the event loop: it holds the loop ~50 us at
# 10 GB/s, where a hop to a worker thread and back costs ~120 us on a 2-core host
# (a 1-block Save, 128 KiB, in process: 535 -> 195 us p50).
INLINE_MAX_BYTES = 512 << 10


@dataclass(frozen=True)
class CopyJob:
    """One request's copy: the caller's layers, its block ids, the slots' addresses."""

    op: str  # SAVE or LOAD
    device: str
    by_blocks: bool  # the RegionTable path; else planned pieces
    table: RegionTable  # the caller's layers, in registration order
    block_ids: np.ndarray  # int64, one per block, in the caller's cache
    addresses: np.ndarray  # uint64 (layers, blocks): each block's slot of each layer
    nbytes: int

    def run(self, copier: Any) -> None:
        """Copy; returns once the bytes are in place. A CUDA call failing under a GPU
        copy raises :class:`~kvstore.copy.DeviceFault` naming CUDA's error."""
        if self.device == "cpu":
            self._move(copier)
            return
        try:
            self._move(copier)
        except cuda_errors() as err:
            raise DeviceFault(f"{type(err).__name__}: {err}") from err

    def _move(self, copier: Any) -> None:
        if self.by_blocks:
            copy = getattr(copier, f"{self.op}_blocks")
            copy(self.table, self.block_ids, self.addresses, wait=True)
            return
        pieces = plan(list(self.table.regions), self.block_ids, self.addresses)
        run_copy(copier, self.device, self.op, pieces)


async def run_job(job: CopyJob, copier: Any) -> None:
    """Run ``job`` with ``copier``: a small host copy at once, on the loop (no
    other request runs meanwhile, so none sees it half done); any other in a
    worker thread."""
    if job.device == "cpu" and job.nbytes <= INLINE_MAX_BYTES:
        job.run(copier)
        return
    await copy_in_thread(job.run, copier)


async def copy_in_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run a copy off the event loop; a cancelled caller still waits for it.

    Bytes already moving cannot be stopped: freeing their slots or unmapping
    their worker memory before the thread is done would corrupt other blocks
    or crash the server. So cancellation is deferred until the copy lands.
    """
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result()  # the copy's own error wins
                cancelled = True
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def run_copy(copier: Any, device: str, op: str, pieces: Any) -> None:
    """Run ``copier.save``/``load`` and return only once the bytes are in place.

    The CUDA copier only enqueues; each call gets its own stream on its device
    so concurrent requests overlap and each waits for just its own copy.
    """
    gpu = Device.parse(device).gpu
    if gpu is None:
        getattr(copier, op)(pieces)
        return
    import cupy

    with cupy.cuda.Device(gpu):
        stream = cupy.cuda.Stream(non_blocking=True)
        getattr(copier, op)(pieces, stream)
        stream.synchronize()
