"""A digest of a model checkpoint: what tells two engines' weights apart.

Block hashes chain token ids but carry no model identity, and the layout
fingerprint covers shapes, not weights: two checkpoints of one architecture
(a fine-tune, another revision) would load each other's KV and silently
produce wrong output. Both connectors put this digest in their client
namespace. It covers the checkpoint's ``config.json``, revision and
quantisation, and for every weights file its name, size and three 1 MiB
samples (start, middle, end): a fine-tune changes every tensor, so it changes
the samples, and the digest of a 100 GB checkpoint still takes milliseconds.
A hub id with no local snapshot is digested by its name, revision and
quantisation only.
"""

from __future__ import annotations

from pathlib import Path

import blake3

SAMPLE = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_HEX = 16


def checkpoint_digest(
    model_path: str, revision: str | None = None, quantization: str | None = None
) -> str:
    """Hex digest of a checkpoint: config, revision, quantisation, sampled weights."""
    h = blake3.blake3()
    for part in (revision or "", quantization or ""):
        h.update(part.encode() + b"\0")
    root = Path(model_path)
    if not root.is_dir():  # a hub id without a local snapshot: name and revision only
        h.update(model_path.encode())
        return h.hexdigest()[:DIGEST_HEX]
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES or path.name.endswith(".index.json"):
            _sample(h, path)
    return h.hexdigest()[:DIGEST_HEX]


def _sample(h: blake3.blake3, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
            f.seek(at)
            h.update(f.read(SAMPLE))
