"""SGLang's HiCache host pool as kvstore layers: one store block is one host page.

No SGLang import: this reads the pool's ``kv_buffer`` tensor, ``layout``,
``page_size``, ``size``, ``start_layer`` and ``allocator`` as SGLang's
``HostKVCache`` classes define them (0.5.23, ``mem_cache/pool_host``).

SGLang lays its host pools out as (``size`` = pages * page_size tokens):

    MHA layer_first        [2, L, size, H, D]           K/V, then layer, then token
    MHA page_first         [2, size, L, H, D]           a page is one run per K and V
    MHA page_first_direct  [2, pages, L, page, H, D]    likewise
    MHA page_head          [2, pages, H, page, L, D]    likewise
    MLA layer_first        [L, size, 1, D]
    MLA page_first         [size, L, 1, D]              a page is one run
    MLA page_first_direct  [pages, L, page, 1, D]       likewise

Page-major layouts register as one layer whose block is the page's bytes as
they lie (MHA: ``kv_first``, segment 0 the K run, segment 1 the V run; MLA:
one ``mla`` segment); ``layer_first`` registers one layer per model layer.
Layer names carry the SGLang layout and layer range
(``sglang.mha.page_first.layers.0-27``), so they, and with them the layout
fingerprint, differ between layouts and pipeline stages; ``kv_layout`` is
nominal (``NHD``, ``HND`` for ``page_head``, ``MLA``). Not supported: pools
whose K and V are separate tensors (``head_dim != v_head_dim``),
``page_unified``, ``page_first_kv_split``, logical-only anchors (DeepSeek
V4) and hybrid pool groups.

The pool must be in shared memory: with ``"allocator": "shm"`` in the
dynamic backend's extra config SGLang allocates it with ``memfd_create`` and
keeps the descriptors open (``allocator.fds``); the store server maps them
through ``/proc/<pid>/fd/<fd>`` (the ``host_fd`` memory handle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore._proto import store_pb2 as pb
from kvstore.client.shared_memory import HostFd, host_fd_of
from kvstore.client.store_client import KVLayer
from kvstore.wire.kv_layout import LayoutKind

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# where the layer count sits in kv_buffer's shape, per (is_mla, layout)
_LAYER_DIM = {
    (False, "layer_first"): 1,
    (False, "page_first"): 2,
    (False, "page_first_direct"): 2,
    (False, "page_head"): 4,
    (True, "layer_first"): 0,
    (True, "page_first"): 1,
    (True, "page_first_direct"): 1,
}

SHM_HINT = (
    'add "allocator": "shm" to --hicache-storage-backend-extra-config so SGLang '
    "allocates its host KV pool in shared memory (memfd) the store can map; give the "
    "extra config as inline JSON, not @file (SGLang 0.5.23 reads the allocator only there)"
)


class UnsupportedPool(ValueError):
    """The host pool cannot be registered; the message says why and what to change."""


@dataclass
class MemfdKVLayer(KVLayer):
    """A KVLayer whose host tensor lives in a shared-memory file this process holds open."""

    host_fd: HostFd | None = None

    def _host_memory(self) -> pb.MemoryHandle:
        if self.host_fd is None:
            return super()._host_memory()
        h = self.host_fd
        return pb.MemoryHandle(
            host_fd=pb.HostFd(pid=h.pid, fd=h.fd, size=h.size, offset=h.offset_of(self.tensor))
        )


def kv_format(pool, kv_cache_dtype: Callable[[], str | None]) -> str:
    """The layers' dtype where the pool's tensor does not tell it ("" where it does).

    SGLang keeps fp8 KV of every variant in uint8 pools, so the tensor's dtype
    cannot keep fp8_e4m3 and fp8_e5m2 engines apart; SGLang's
    ``--kv-cache-dtype`` does, which ``kv_cache_dtype()`` tells (asked only for
    a uint8 pool). A uint8 pool without it is refused: an engine must never
    load pages of another fp8 format.
    """
    buf = getattr(pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
        return ""
    named = kv_cache_dtype()
    if not named or named == "auto":
        raise UnsupportedPool(
            "SGLang keeps fp8 KV in uint8 pools and this backend cannot tell which fp8 "
            'format: add "kv_cache_dtype" (SGLang\'s --kv-cache-dtype, e.g. fp8_e4m3) to '
            "--hicache-storage-backend-extra-config, so engines of another format never "
            "share its pages"
        )
    return named


def pool_layers(pool, is_mla: bool, kv_dtype: str = "") -> list[MemfdKVLayer]:
    """The kvstore layers of an SGLang host pool (see the module docstring);
    ``kv_dtype``: their dtype where the tensor's is not it (:func:`kv_format`).

    Raises :class:`UnsupportedPool` for a layout or pool kind this backend
    cannot register, or a pool that is not in shared memory.
    """
    layout, buf = getattr(pool, "layout", None), getattr(pool, "kv_buffer", None)
    kind = "MLA" if is_mla else "MHA"
    supported = MLA_LAYOUTS if is_mla else MHA_LAYOUTS
    if layout not in supported:
        raise UnsupportedPool(
            f"SGLang {kind} host layout {layout!r} is not supported by kvstore; use "
            f"--hicache-mem-layout {' or '.join(supported)}"
        )
    if not isinstance(buf, torch.Tensor):
        raise UnsupportedPool(
            f"SGLang host pool {type(pool).__name__} has no single KV tensor "
            f"(kv_buffer is {type(buf).__name__}): split K/V, logical or hybrid pools "
            "are not supported by kvstore"
        )
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise UnsupportedPool(f"SGLang host KV tensor must be contiguous CPU memory: {buf.device}")
    pages = int(pool.size) // int(pool.page_size)
    views = _views(buf, is_mla, layout, pages, int(getattr(pool, "start_layer", 0) or 0))
    host_fd = _host_fd(buf, pool)
    return [
        MemfdKVLayer(
            name,
            view,
            LayoutKind.MLA if is_mla else LayoutKind.KV_FIRST,
            "MLA" if is_mla else ("HND" if layout == "page_head" else "NHD"),
            replicated=is_mla,
            kv_dtype=kv_dtype,
            host_fd=host_fd,
        )
        for name, view in views
    ]


def _views(
    buf: torch.Tensor, is_mla: bool, layout: str, pages: int, start: int
) -> list[tuple[str, torch.Tensor]]:
    """(name, view) per registered layer: a block is one host page."""
    kind = "mla" if is_mla else "mha"
    expected_kv = () if is_mla else (2,)
    if tuple(buf.shape[: len(expected_kv)]) != expected_kv:
        raise UnsupportedPool(f"SGLang {kind} host KV tensor of shape {tuple(buf.shape)}")
    layers = int(buf.shape[_LAYER_DIM[(is_mla, layout)]])
    try:
        if layout == "layer_first":
            per_layer = [buf[:, i] if not is_mla else buf[i] for i in range(layers)]
            return [
                (f"sglang.{kind}.layer_first.layers.{start + i}", _page_view(t, is_mla, pages))
                for i, t in enumerate(per_layer)
            ]
        name = f"sglang.{kind}.{layout}.layers.{start}-{start + layers - 1}"
        return [(name, _page_view(buf, is_mla, pages))]
    except RuntimeError as err:  # torch: the shape does not split into whole pages
        raise UnsupportedPool(
            f"SGLang {kind} {layout} host KV tensor of shape {tuple(buf.shape)} does not "
            f"split into {pages} pages: {err}"
        ) from None


def _page_view(t: torch.Tensor, is_mla: bool, pages: int) -> torch.Tensor:
    """``t`` (one layer, or the whole page-major pool) as [(2,) pages, 1, (1,) bytes-of-a-page]."""
    if is_mla:
        return t.view(pages, 1, -1)
    return t.view(2, pages, 1, 1, -1)


def _host_fd(buf: torch.Tensor, pool) -> HostFd:
    fds = getattr(getattr(pool, "allocator", None), "fds", None)
    try:
        return host_fd_of(buf, fds if fds else None)
    except ValueError as err:
        raise UnsupportedPool(
            f"SGLang's host KV pool is not in shared memory ({err}): {SHM_HINT}"
        ) from None
