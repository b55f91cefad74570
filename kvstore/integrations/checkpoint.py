"""A digest of a model checkpoint: what tells two engines' weights apart.

Block hashes chain token ids but carry no model identity, and the layout
fingerprint covers shapes, not weights: two checkpoints of one architecture
(a fine-tune, another revision) would load each other's KV and silently
produce wrong output. Both connectors put this digest in their client
namespace. It covers the checkpoint's ``config.json``, revision and
quantisation, the engine settings that change the weights or the KV without
changing the files (``variant``: random "dummy" weights, config overrides such
as a RoPE scaling, the compute dtype), and every byte of every weights file.

Every byte, because a fine-tune need not touch every tensor (frozen
embeddings or layers, an abliterated or merged model keep names, sizes and
most bytes), so samples could miss it. Reading a large checkpoint takes time
(disk speed; blake3 hashes on every core), so a file's digest is kept in this
user's private cache directory (:mod:`kvstore.private_dir`), keyed by the
file's path, device, inode, size, modification and change times: an engine
reads the checkpoint once a host, and a file changed in any of those is read
again. A model path that is one file (a GGUF) is digested by its content; a
hub id (no local path) by its name, revision, quantisation and variant only,
so pin a revision or serve a local snapshot: the snapshot a hub id resolves
to may be downloaded after the digest is taken, and every rank must agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import blake3

from kvstore.private_dir import is_private, private_cache_dir

log = logging.getLogger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_HEX = 16
FILE_DIGEST_BYTES = 32
CACHE_SUBDIR = "checkpoint-digests"


def checkpoint_digest(
    model_path: str,
    revision: str | None = None,
    quantization: str | None = None,
    variant: Sequence[str] = (),
) -> str:
    """Hex digest of a checkpoint: config, revision, quantisation, ``variant``
    (engine settings that change weights or KV, as ``name=value`` strings),
    and the content of every weights file."""
    h = blake3.blake3()
    for part in (revision or "", quantization or "", *variant):
        h.update(part.encode() + b"\0")
    root = Path(model_path)
    if root.is_file():  # one weights file (a GGUF): its content
        h.update(f"{root.name}\0".encode() + file_digest(root))
        return h.hexdigest()[:DIGEST_HEX]
    if not root.is_dir():  # a hub id: its name (pin a revision, or give a local path)
        h.update(model_path.encode())
        return h.hexdigest()[:DIGEST_HEX]
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.iterdir()):
        weights = path.suffix in WEIGHT_SUFFIXES or path.name.endswith(".index.json")
        if weights and path.is_file():  # not a directory so named, nor a dangling link
            h.update(f"{path.name}\0".encode() + file_digest(path))
    return h.hexdigest()[:DIGEST_HEX]


def variant_of(
    load_format: object = None, overrides: object = None, dtype: object = None
) -> list[str]:
    """The ``variant`` of :func:`checkpoint_digest` from an engine's settings:
    random ("dummy") weights, model config overrides (canonical JSON; a RoPE
    scaling changes every K), and the compute dtype when it is set. Other load
    formats read the same weights and change nothing."""
    parts = []
    if str(load_format or "").lower() == "dummy":
        parts.append("load_format=dummy")
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError:
            pass  # digested as written
    if overrides:  # {} (the engines' default) overrides nothing
        parts.append("overrides=" + json.dumps(overrides, sort_keys=True, default=_stable))
    if dtype and str(dtype) != "auto":
        parts.append(f"dtype={str(dtype).removeprefix('torch.')}")
    return parts


def _stable(value: object) -> str:
    """A value JSON cannot write, as every process of an engine writes it (a
    function by its qualified name: its repr holds an address, and ranks whose
    namespaces disagree never seal)."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return str(value)


def file_digest(path: Path) -> bytes:
    """blake3 of ``path``'s content, from the private cache when the file's
    identity (path, device, inode, size, mtime, ctime) is unchanged since it was read.
    One process of the host reads a file at a time (a lock beside its entry):
    an engine's ranks start together, and the others then take its digest."""
    st = path.stat()
    identity = (  # ctime too: no user sets it (an mtime may be kept by a copy)
        f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
        f"\0{st.st_ctime_ns}"
    )
    entry = _cache_entry(identity)
    if entry is None:
        return _read_digest(path, st.st_size)
    digest = _kept(entry)
    if digest is not None:
        return digest
    with _locked(entry.with_suffix(".lock")):
        digest = _kept(entry)  # another process may have read it meanwhile
        if digest is None:
            digest = _read_digest(path, st.st_size)
            _keep(entry, digest)
    return digest


def _read_digest(path: Path, size: int) -> bytes:
    started = time.monotonic()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if size:
        h.update_mmap(path)
    elapsed = time.monotonic() - started
    if elapsed > 1.0:
        log.info(
            "kvstore: read %s (%.1f GB) in %.1f s to digest it; kept until it changes",
            path,
            size / 1e9,
            elapsed,
        )
    return h.digest()


def _kept(entry: Path) -> bytes | None:
    """The digest kept at ``entry``, if this user alone could have written it."""
    try:
        if is_private(entry, directory=False):
            digest = entry.read_bytes()
            if len(digest) == FILE_DIGEST_BYTES:
                return digest
    except OSError:
        pass  # absent or unreadable: the file is read
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between processes (none when it cannot be made)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # e.g. ENOLCK on an NFS without lockd: read unlocked
            log.debug("kvstore: no lock on %s: %s", path, err)
        yield
    finally:
        os.close(fd)


def _cache_entry(identity: str) -> Path | None:
    """Where the digest of the file ``identity`` is kept (None: no private cache)."""
    try:
        root = private_cache_dir("checkpoint digests") / CACHE_SUBDIR
        root.mkdir(mode=0o700, exist_ok=True)
        if not is_private(root, directory=True):
            return None
    except OSError as err:
        log.warning("kvstore: checkpoint digests are not cached: %s", err)
        return None
    return root / blake3.blake3(identity.encode()).hexdigest()


def _keep(entry: Path, digest: bytes) -> None:
    """Write ``digest`` to ``entry`` whole (a temporary file renamed over it)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=entry.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(digest)
        os.replace(tmp, entry)
    except OSError as err:
        log.warning("kvstore: checkpoint digest not cached at %s: %s", entry, err)
