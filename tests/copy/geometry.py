"""KV layout geometry for the copy tests: layer specs, the tensors and slot pools built from
them, and the hypothesis strategy that draws whole requests (docs/design.md §3).

The pieces path (test_copy) and the blocks path (test_blocks) draw from the same
`geometries()`, so a layout one path is proven on is a layout the other is proven on.
Tensors are views over raw uint8 buffers filled with random bytes, padding included, so
results are compared byte for byte on the buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st

FP8 = getattr(torch, "float8_e4m3fn", torch.uint8)

LAYOUTS = [
    ("kv_first", "NHD"),
    ("kv_first", "HND"),
    ("kv_first", "HND_view"),
    ("blocks_first", "NHD"),
    ("blocks_first", "HND"),
    ("blocks_first", "HND_view"),
    ("mla", "NHD"),
]
DTYPES = [torch.float16, torch.bfloat16, FP8]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class LayerSpec:
    """One layer's layout: kind, order inside a block, dtype and sizes."""

    kind: str  # kv_first | blocks_first | mla
    order: str  # NHD | HND (contiguous) | HND_view (vLLM: HND memory, NHD-shaped view)
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    offset: int = 0  # bytes before the tensor in its raw buffer (odd: unaligned base)

    @property
    def nbytes(self) -> int:
        lead = 2 if self.kind != "mla" else 1
        sizes = (lead, self.num_blocks, self.block_size, self.heads, self.head_dim)
        return math.prod(sizes) * element_size(self.dtype)

    def build(self, raw: torch.Tensor) -> torch.Tensor:
        """View of this layer over `raw` (a uint8 buffer of offset + nbytes bytes)."""
        flat = raw[self.offset : self.offset + self.nbytes].view(self.dtype)
        nb, bs, h, d = self.num_blocks, self.block_size, self.heads, self.head_dim
        if self.kind == "mla":
            return flat.view(nb, bs, h * d)
        inner = (bs, h, d) if self.order == "NHD" else (h, bs, d)
        outer = (2, nb) if self.kind == "kv_first" else (nb, 2)
        t = flat.view(*outer, *inner)
        return t.transpose(2, 3) if self.order == "HND_view" else t


def layer_spec(kind, order, dtype, *, num_blocks=24, bs=4, h=3, d=8, offset=0) -> LayerSpec:
    return LayerSpec(kind, order, dtype, num_blocks, bs, h, d, offset)


# one request over every kind and mixed dtypes, two of its layers odd-sized at unaligned bases
MIXED_SPECS = (
    layer_spec("kv_first", "HND_view", torch.bfloat16, num_blocks=16),
    layer_spec("mla", "NHD", torch.float16, num_blocks=16, h=1, d=36),
    layer_spec("blocks_first", "NHD", torch.uint8, num_blocks=16, bs=3, h=1, d=5, offset=1),
    layer_spec("blocks_first", "NHD", FP8, num_blocks=16, bs=2, h=3, d=7, offset=1),
)


class Layer(NamedTuple):
    """A layer's tensor and the raw buffer it is a view over."""

    tensor: torch.Tensor
    raw: torch.Tensor


class Layers(NamedTuple):
    """Several layers' tensors and raw buffers, in layer order."""

    tensors: list[torch.Tensor]
    raws: list[torch.Tensor]


def make_layer(spec: LayerSpec, rng: np.random.Generator, device: str = "cpu") -> Layer:
    """A layer with random bytes everywhere in its buffer, including padding."""
    raw = torch.from_numpy(rng.integers(0, 256, spec.offset + spec.nbytes + 7, dtype=np.uint8))
    raw = raw.to(device)
    return Layer(spec.build(raw), raw)


def make_layers(specs, rng: np.random.Generator, device: str = "cpu") -> Layers:
    layers = [make_layer(s, rng, device) for s in specs]
    return Layers([la.tensor for la in layers], [la.raw for la in layers])


# ---------------------------------------------------------------- slot pools


@dataclass
class SlotPool:
    """A uint8 buffer with one slot per (layer, block) at shuffled, possibly odd offsets."""

    buf: torch.Tensor
    offsets: np.ndarray  # (layers, blocks) byte offsets into buf

    @property
    def addrs(self) -> np.ndarray:
        return (self.buf.data_ptr() + self.offsets).astype(np.uint64)


def make_pool(
    slot_bytes: list[int],
    num_blocks: int,
    rng,
    *,
    gap: int = 0,
    shuffle=True,
    base: int = 0,
    device: str = "cpu",
) -> SlotPool:
    stride = max(slot_bytes) + gap
    n = len(slot_bytes) * num_blocks
    order = rng.permutation(n) if shuffle else np.arange(n)
    offsets = (base + order * stride).reshape(len(slot_bytes), num_blocks).astype(np.int64)
    buf = torch.from_numpy(rng.integers(0, 256, base + n * stride + 16, dtype=np.uint8)).to(device)
    return SlotPool(buf, offsets)


def expected_pool(pool: SlotPool, images: list[torch.Tensor]) -> torch.Tensor:
    """The pool's buffer once `images[layer][i]` has been written to slot (layer, i)."""
    want = pool.buf.clone()
    for layer, img in enumerate(images):
        for i in range(img.shape[0]):
            off = int(pool.offsets[layer, i])
            want[off : off + img.shape[1]] = img[i]
    return want


# ---------------------------------------------------------------- drawn requests


@dataclass(frozen=True)
class Geometry:
    """A drawn request: layers of any layout and dtype sharing a block count, the distinct
    block ids moved, and the pool's slot gap and base. `seed` fills every byte."""

    specs: tuple[LayerSpec, ...]
    block_ids: tuple[int, ...]
    pool_gap: int
    pool_base: int
    seed: int

    @property
    def kinds(self) -> list[str]:
        return [s.kind for s in self.specs]

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


# every dtype the copy tests name, plus a 1-byte one for odd sizes (FP8 is uint8 without it)
GEOMETRY_DTYPES = list(dict.fromkeys([*DTYPES, torch.uint8]))


@st.composite
def _layer_specs(draw, num_blocks: int) -> LayerSpec:
    kind, order = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(GEOMETRY_DTYPES))
    bs, h, d = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 9))
    offset = draw(st.integers(0, 2)) * element_size(dtype)  # unaligned base, whole elements
    return LayerSpec(kind, order, dtype, num_blocks, bs, h, d, offset)


@st.composite
def geometries(draw, max_layers: int = 4, max_ids: int = 12) -> Geometry:
    """1..max_layers layers, each block count a few above the 1..max_ids ids moved."""
    n = draw(st.integers(1, max_ids))
    num_blocks = n + draw(st.integers(0, 3))
    specs = draw(st.lists(_layer_specs(num_blocks), min_size=1, max_size=max_layers))
    ids = draw(st.permutations(range(num_blocks)))[:n]
    return Geometry(
        specs=tuple(specs),
        block_ids=tuple(ids),
        pool_gap=draw(st.integers(0, 16)),
        pool_base=draw(st.integers(0, 7)),
        seed=draw(st.integers(0, 2**31)),
    )
