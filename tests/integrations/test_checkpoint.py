"""The checkpoint digest that puts an engine's weights into its client namespace:
every byte of every weights file (kept per file in this user's private cache),
and the engine settings that change weights or KV without changing files."""

from __future__ import annotations

import json
import os

import pytest

from kvstore.integrations.checkpoint import (
    CACHE_SUBDIR,
    checkpoint_digest,
    file_digest,
    variant_of,
)

MiB = 1 << 20
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(path))
    return path / CACHE_SUBDIR


def entries(cache_dir):
    return [p for p in cache_dir.iterdir() if p.suffix != ".lock"]


def checkpoint(root, tweak_at: int | None = None):
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    weights = bytearray(b"\x11" * (8 * MiB))
    if tweak_at is not None:  # a layer a partial fine-tune trained
        weights[tweak_at : tweak_at + 64] = b"\x22" * 64
    (root / SHARD).write_bytes(bytes(weights))
    return root


def test_a_fine_tune_of_a_few_bytes_anywhere_is_another_checkpoint(tmp_path):
    """Before: each file gave its name, size and three 1 MiB samples (start,
    middle, end): a fine-tune that kept those bytes (frozen embeddings and
    layers) had the base model's digest, and engines serving the two shared KV
    (found by review: 8 MiB shards differing at MiB 2)."""
    base = checkpoint_digest(str(checkpoint(tmp_path / "base")))
    for i, at in enumerate((2 * MiB, 5 * MiB + 17, 8 * MiB - 64)):
        tuned = checkpoint_digest(str(checkpoint(tmp_path / f"tuned{i}", at)))
        assert tuned != base, at


def test_a_files_digest_is_read_once_and_again_when_the_file_changes(
    tmp_path, cache_dir, monkeypatch
):
    from kvstore.integrations import checkpoint as module

    root = checkpoint(tmp_path / "m")
    reads, real = [], module._read_digest
    monkeypatch.setattr(module, "_read_digest", lambda *a: reads.append(a) or real(*a))
    first = checkpoint_digest(str(root))
    assert checkpoint_digest(str(root)) == first and len(reads) == 1  # kept
    (entry,) = entries(cache_dir)
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    shard = root / SHARD
    st = shard.stat()
    with shard.open("r+b") as f:  # rewritten in place, size and mtime kept (a copy -p)
        f.seek(3 * MiB)
        f.write(b"\x33" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checkpoint_digest(str(root)) != first and len(reads) == 2  # its ctime moved


def test_a_single_file_checkpoint_is_digested_by_content(tmp_path):
    """A model path that is one GGUF file was digested by its path alone (found by
    review): a re-quantised file at the same path shared the old one's KV."""
    one = tmp_path / "m.gguf"
    one.write_bytes(b"\x11" * MiB)
    before = checkpoint_digest(str(one))
    one.write_bytes(b"\x11" * (MiB - 1) + b"\x22")
    assert checkpoint_digest(str(one)) != before


def test_odd_entries_named_like_weights_do_not_stop_the_digest(tmp_path):
    """A directory named like a weights file, or a link to a pruned blob, made the
    digest raise and the engine fail to start (found by review)."""
    root = checkpoint(tmp_path / "m")
    plain = checkpoint_digest(str(root))
    (root / "optimizer.pt").mkdir()
    (root / "pruned.safetensors").symlink_to(tmp_path / "gone")
    assert checkpoint_digest(str(root)) == plain


def test_a_cache_entry_others_could_write_is_not_believed(tmp_path, cache_dir):
    """A digest another user could have written would put other weights in this
    checkpoint's namespace: such an entry is ignored and the file read."""
    root = checkpoint(tmp_path / "m")
    true = file_digest(root / SHARD)
    (entry,) = entries(cache_dir)
    entry.write_bytes(b"\0" * len(true))
    entry.chmod(0o666)
    assert file_digest(root / SHARD) == true


@pytest.mark.parametrize(
    "settings, changes",
    [
        ({"load_format": "dummy"}, True),  # random weights
        ({"overrides": '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'}, True),
        ({"overrides": {"rope_scaling": {"factor": 4.0, "rope_type": "yarn"}}}, True),
        ({"dtype": "float16"}, True),
        ({"load_format": "safetensors"}, False),  # the same weights
        ({"load_format": "auto", "overrides": "{}", "dtype": "auto"}, False),  # the defaults
    ],
)
def test_engine_settings_that_change_weights_or_kv_change_the_digest(tmp_path, settings, changes):
    """Before: an engine on --load-format dummy, or with a RoPE scaling override,
    over the production engine's checkpoint had its namespace and shared pages
    of other KV (found by review)."""
    root = str(checkpoint(tmp_path / "m"))
    plain = checkpoint_digest(root)
    assert (checkpoint_digest(root, variant=variant_of(**settings)) != plain) is changes


def test_overrides_are_digested_canonically():
    a = variant_of(overrides='{"b": 1, "a": {"y": 2, "x": 1}}')
    assert a == variant_of(overrides={"a": {"x": 1, "y": 2}, "b": 1})


def test_a_function_among_the_overrides_is_digested_by_its_name():
    """vLLM's hf_overrides may be a function: its repr holds an address, which
    would give each rank of one engine another namespace (never sealed)."""

    def patch(config):
        return config

    assert variant_of(overrides=patch) == [f'overrides="{__name__}.{patch.__qualname__}"']


def test_ranks_starting_together_read_a_file_once(tmp_path, monkeypatch):
    """An engine's ranks digest the checkpoint at once: one reads each file, the
    others wait for its digest (eight ranks reading a 140 GB checkpoint each)."""
    import threading

    from kvstore.integrations import checkpoint as module

    root = checkpoint(tmp_path / "m")
    reads, real = [], module._read_digest
    monkeypatch.setattr(module, "_read_digest", lambda *a: reads.append(a) or real(*a))
    start = threading.Barrier(4)
    found = []

    def rank():
        start.wait()
        found.append(file_digest(root / SHARD))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(set(found)) == 1 and len(found) == 4
