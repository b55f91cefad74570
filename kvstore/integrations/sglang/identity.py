"""Who an SGLang rank is in the store, and what its pages are keyed by.

Plain Python (no SGLang import), so it is tested without the engine.

**Keys.** SGLang names each host page by a chained SHA-256 hex string (64
hex digits; the chain is seeded with the request's extra key and cache salt,
so those are part of the key). kvstore keys a block by a u64: the first 16
hex digits read as an unsigned integer (:func:`page_key`). SGLang's KV events
publish the same 64 bits as a signed int64, so ``event_hash & (2**64 - 1)``
is the store's key. The registration's ``hash_format`` is
``sglang-sha256-hex16`` (:data:`kvstore.wire.hashing.SGLANG_HASH_FORMAT`).

**Namespace.** Pages are shared only between engines that would compute
the same bytes. The client namespace is SGLang's storage model name (the
served model name, tagged by SGLang with the host pool's page format when it
has its own), an 8-digit digest of that exact name and of the checkpoint
(sanitising may merge two names; the checkpoint digest,
:mod:`kvstore.integrations.checkpoint`, keeps two engines serving other
weights under one name apart), and SGLang's host layout:
``<model>-<digest>-<layout>``. The store then adds the layout fingerprint
(layer names, which carry the SGLang layout and layer range; dtype; bytes
per page; page size; TP size for MHA), so another layout, dtype, page size,
TP degree or layer split lands in another namespace.

**Ranks.** MHA pools are sharded by head: each TP rank registers its own
shard as ``tp_rank`` of ``tp_size`` and the store keeps one slot per (layer,
tp_rank), so a block is whole (sealed) once every rank saved it and a rank
only ever loads its own shard. MLA pools are replicated: every rank
registers the same cells as ``tp_rank 0 of 1`` with ``replicated`` layers;
SGLang lets only its storage writer (TP rank 0) save, and every rank loads
that one copy. Pipeline stages register their own layers: ``rank = pp_rank *
tp_size + tp_rank`` of ``world_size = pp_size * tp_size``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import blake3

from kvstore.client.store_client import RankSpec
from kvstore.wire.hashing import SGLANG_HASH_FORMAT

U64 = (1 << 64) - 1
HEX_KEY = re.compile(r"[0-9a-fA-F]{16,}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_.:-]+")
MAX_MODEL = 80


def page_key(key: str) -> int:
    """kvstore's u64 key of one SGLang page key: its first 16 hex digits.

    ValueError for a key that is not all hex digits, at least 16 of them
    (SGLang's page keys are 64). Keys of other schemes (suffixed sidecar keys,
    the unified ``<hash>_<digest>_L..`` scheme) are refused rather than
    truncated onto the page they start with.
    """
    if not isinstance(key, str) or not HEX_KEY.fullmatch(key):
        raise ValueError(
            f"SGLang page key {str(key)[:80]!r} is not a hex digest of at least 16 digits"
        )
    return int(key[:16], 16)


def client_namespace(
    model_name: str | None,
    layout: str,
    override: str | None = None,
    model_digest: str | None = None,
) -> str:
    """``<model>-<8 hex digest of the model name and the checkpoint>-<layout>``
    (see the module docstring); ``model_digest``: the checkpoint's digest (None:
    unknown, the name alone)."""
    if override:
        return override
    raw = model_name or ""
    name = _UNSAFE.sub("-", raw).strip("-")[:MAX_MODEL] or "model"
    named = raw if model_digest is None else f"{raw}\0{model_digest}"
    digest = blake3.blake3(named.encode()).hexdigest()[:8]
    return f"{name}-{digest}-{_UNSAFE.sub('-', layout)}"


def instance_id(
    pool: str,
    *,
    dp_rank: int = 0,
    replica: int | None = None,
    override: str | None = None,
    engine_port: int | None = None,
) -> str:
    """The id every rank of one SGLang engine (one DP replica, one attention-DP
    group) computes alike without talking to the others.

    SGLang starts all scheduler processes of an engine (or of all replicas of
    a DP controller) from one parent process, so the parent's pid on this host
    names the engine; ``replica`` (SGLang's data-parallel rank, None without a
    DP controller) and ``dp_rank`` (the attention-DP group) tell its parts
    apart, and ``pool`` (e.g. ``mha-page_first``) the host pools of one
    process. ``engine_port`` (the engine's NCCL port, where SGLang's runtime
    context tells it) keeps apart two engines one process started, and two
    containers whose hostname and launcher pid agree. ``override`` (extra
    config ``instance_id``, one string SGLang hands every scheduler process)
    replaces the host, pid, port and pool, but keeps the replica and
    attention-DP suffixes: those groups' ranks number from 0 alike, and under
    one id the second group's ranks were refused for good (ALREADY_EXISTS).
    """
    if override:
        return override + _groups(replica, dp_rank)
    host = _UNSAFE_ID.sub("-", socket.gethostname())[:64] or "host"
    value = f"sglang-{host}-{os.getppid()}"
    if engine_port:
        value += f"-p{engine_port}"
    return f"{value}{_groups(replica, dp_rank)}-{_UNSAFE_ID.sub('-', pool)}"


def _groups(replica: int | None, dp_rank: int) -> str:
    """The id's suffix naming a DP replica and an attention-DP group ('' for neither)."""
    value = ""
    if replica is not None:
        value += f"-r{replica}"
    if dp_rank:
        value += f"-adp{dp_rank}"
    return value


@dataclass(frozen=True)
class RankIdentity:
    """One SGLang rank as the store sees it (see the module docstring, Ranks)."""

    instance_id: str
    client_namespace: str
    block_size: int  # tokens per page
    tp_rank: int
    tp_size: int
    rank: int
    world_size: int
    replicated: bool  # MLA: the cells are shared by every rank
    writer: bool  # this rank saves (False: an MLA replica that only loads)

    @property
    def spec(self) -> RankSpec:
        """What the store's RegisterLayers needs of this rank."""
        return RankSpec(
            instance_id=self.instance_id,
            client_namespace=self.client_namespace,
            hash_format=SGLANG_HASH_FORMAT,
            block_size=self.block_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            rank=self.rank,
            world_size=self.world_size,
        )


def rank_identity(
    *,
    instance: str,
    namespace: str,
    page_size: int,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    is_mla: bool,
    writer: bool,
) -> RankIdentity:
    """The registration fields of one rank of an MHA (sharded) or MLA (replicated) pool."""
    return RankIdentity(
        instance_id=instance,
        client_namespace=namespace,
        block_size=page_size,
        tp_rank=0 if is_mla else tp_rank,
        tp_size=1 if is_mla else tp_size,
        rank=pp_rank * tp_size + tp_rank,
        world_size=pp_size * tp_size,
        replicated=is_mla,
        writer=writer,
    )
