"""Choosing a worker: the one with the lowest expected time to first token.

For each candidate the router knows three prefix lengths of the request:

    gpu     blocks on the worker's own GPU (its vLLM events)
    store   blocks in its node's store (or its own offload tier)
    remote  blocks a peer store of the same final namespace holds

and the worker's load (load.py): prefill tokens queued ahead of the request
and requests running (decoding). Cached blocks are credited by tier: a GPU
hit saves its whole prefill, a store or remote hit saves its prefill less
the transfer, which the tier weights stand for. So, in tokens (block_size
each):

    cached   = block_size * (w_gpu*gpu + w_store*max(0, store-gpu)
                             + w_remote*max(0, remote-max(gpu, store)))
    uncached = prompt tokens - cached
    ttft_ms  = (queued + uncached) * prefill_ms_per_token
               + running * decode_interference_ms

With ``recompute_weight`` w > 0 the worker is chosen by

    score_ms = ttft_ms + w * uncached * prefill_ms_per_token

which also charges the prefill this choice adds to the worker's queue for
the requests that will wait behind it (w: about how many will). The default
is 1: under heavy load a greedy ttft (w = 0) gives up cached prefixes for
short queues and the recompute it causes fills every queue; in the trace
replay (bench/router_trace.py) w = 1 helps at heavy load and is neutral at
light load.

A running request costs a waiting prefill what it adds to the engine steps
the prefill shares with it (its KV reads and its one token per step), not
its blocks: a decoding request's blocks are never prefilled again, and
counting them as prefill would send requests away from a worker whose
longer prefix saves more than its decodes cost. The request's own output
length does not change its first token, so it is not in the cost.

Defaults, the order of magnitude of an 8B model on one H100 (flags):
prefill_ms_per_token 0.04 is 2 x 8e9 FLOP per token at ~40% of the H100's
989 dense bf16 TFLOP/s (~25k prompt tokens/s); decode_interference_ms 1.0 is
~0.1 ms per engine step for one decoding request (its ~2k-token KV cache,
128 KiB per token for Llama-3-8B, read at ~3 TB/s, plus one token of compute)
over the ~10 engine steps a queued prefill waits and runs alongside it.

Temperature 0 takes the lowest score (the ttft when recompute_weight is 0);
ties go to the fewest queued tokens, then to a seeded random draw (never to
a name, which would load one worker more than its equals). A positive
temperature samples from softmax(-score / (temperature * max score)), which
spreads load when the estimates are close.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from kvstore.router.admission import WorkerRef
from kvstore.router.load import IDLE, WorkerLoad


@dataclass
class ScoringConfig:
    prefill_ms_per_token: float = 0.04
    decode_interference_ms: float = 1.0
    recompute_weight: float = 1.0
    temperature: float = 0.0
    gpu_weight: float = 1.0
    store_weight: float = 0.75
    remote_weight: float = 0.5
    load_staleness_s: float = 2.0  # a worker's load report older than this is ignored
    request_timeout_s: float = 600.0  # a tracked request never reported finished is freed
    seed: int | None = None


@dataclass(frozen=True)
class TtftEstimate:
    """One worker's expected time to first token for a request, and its parts."""

    ttft_ms: float
    queued_tokens: int
    uncached_tokens: int
    running_requests: int
    prefill_ms_per_token: float
    decode_interference_ms: float
    report_age_s: float | None = None  # None: the router's own accounting of its load
    recompute_ms: float = 0.0  # recompute_weight x uncached x prefill_ms_per_token

    @property
    def score_ms(self) -> float:
        """What the choice ranks: the ttft, plus the recompute charge when weighted."""
        return self.ttft_ms + self.recompute_ms

    def formula(self) -> str:
        text = (
            f"ttft {self.ttft_ms:.1f} ms = ({self.queued_tokens} queued + "
            f"{self.uncached_tokens} uncached) x {self.prefill_ms_per_token:g} ms/token + "
            f"{self.running_requests} decoding x {self.decode_interference_ms:g} ms"
        )
        if self.recompute_ms:
            text += f"; score {self.score_ms:.1f} ms with {self.recompute_ms:.1f} ms recompute"
        return text


@dataclass
class Candidate:
    """One worker's prefix lengths (blocks) and what they give it."""

    ref: WorkerRef
    gpu: int
    store: int
    remote: int
    estimate: TtftEstimate | None = None

    @property
    def overlap(self) -> int:
        return max(self.gpu, self.store, self.remote)

    @property
    def ttft_ms(self) -> float:
        return self.estimate.ttft_ms if self.estimate else 0.0

    @property
    def score_ms(self) -> float:
        return self.estimate.score_ms if self.estimate else 0.0

    @property
    def queued_tokens(self) -> int:
        return self.estimate.queued_tokens if self.estimate else 0


def cached_tokens(c: Candidate, block_size: int, cfg: ScoringConfig) -> int:
    """Prompt tokens the candidate's tiers save, each tier at its weight."""
    local = max(c.gpu, c.store)
    blocks = (
        cfg.gpu_weight * c.gpu
        + cfg.store_weight * max(0, c.store - c.gpu)
        + cfg.remote_weight * max(0, c.remote - local)
    )
    return round(blocks * block_size)


def estimate(prompt_tokens: int, cached: int, load: WorkerLoad, cfg: ScoringConfig) -> TtftEstimate:
    uncached = max(0, prompt_tokens - cached)
    ttft = (load.queued_tokens + uncached) * cfg.prefill_ms_per_token
    ttft += load.running_requests * cfg.decode_interference_ms
    recompute = cfg.recompute_weight * uncached * cfg.prefill_ms_per_token
    return TtftEstimate(
        ttft,
        load.queued_tokens,
        uncached,
        load.running_requests,
        cfg.prefill_ms_per_token,
        cfg.decode_interference_ms,
        load.report_age_s,
        recompute,
    )


class Candidates(Sequence[Candidate]):
    """Every member of a WorkerSet as a candidate, in member order: its prefix
    lengths as arrays and, once :func:`score_all` ran, every score.

    A route scores all members with a few array operations, not an object
    each; only the chosen one (:func:`choose`) becomes a :class:`Candidate`
    with its :class:`TtftEstimate`. Indexing gives one candidate (with its
    estimate once scored); iterating gives them all.
    """

    def __init__(
        self, refs: list[WorkerRef], gpu: np.ndarray, store: np.ndarray, remote: np.ndarray
    ):
        self.refs = refs
        self.gpu, self.store, self.remote = gpu, store, remote
        self.scores: Scores | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> Candidate:  # type: ignore[override]
        c = Candidate(self.refs[i], int(self.gpu[i]), int(self.store[i]), int(self.remote[i]))
        if self.scores is not None:
            c.estimate = self.scores.estimate(i, c)
        return c

    def __iter__(self) -> Iterator[Candidate]:
        if self.scores is not None:
            return map(self.__getitem__, range(len(self)))
        return map(
            Candidate, self.refs, self.gpu.tolist(), self.store.tolist(), self.remote.tolist()
        )


@dataclass
class Scores:
    """One route's scores of every candidate, in candidate order."""

    score_ms: np.ndarray  # float64: what the choice ranks
    ttft_ms: np.ndarray  # float64
    queued_tokens: np.ndarray  # int64: the tie-break
    loads: list[WorkerLoad]
    prompt_tokens: int
    block_size: int
    cfg: ScoringConfig

    def estimate(self, i: int, c: Candidate) -> TtftEstimate:
        """Candidate ``i``'s estimate: the numbers its entries of the arrays hold."""
        cached = cached_tokens(c, self.block_size, self.cfg)
        return estimate(self.prompt_tokens, cached, self.loads[i], self.cfg)

    def rank(self, i: int) -> tuple[float, int]:
        return (float(self.score_ms[i]), int(self.queued_tokens[i]))

    def lowest(self, skip: int | None = None) -> list[int]:
        """Indexes of the lowest (score, queued tokens), in candidate order,
        candidate ``skip`` left out."""
        keep = np.ones(len(self.score_ms), dtype=bool)
        if skip is not None:
            keep[skip] = False
        if not keep.any():
            return []
        low = keep & (self.score_ms == self.score_ms[keep].min())
        fewest = self.queued_tokens[low].min()
        return np.flatnonzero(low & (self.queued_tokens == fewest)).tolist()


def score_all(
    cands: Candidates,
    prompt_tokens: int,
    block_size: int,
    loads: dict[WorkerRef, WorkerLoad],
    cfg: ScoringConfig,
) -> None:
    """Score every candidate (``cands.scores``): :func:`cached_tokens` and
    :func:`estimate` over arrays, the same operations in the same order, so
    each score is exactly the one ``estimate`` gives that candidate."""
    each = list(map(loads.get, cands.refs, repeat(IDLE)))
    columns = list(zip(*each, strict=True)) or [(), ()]
    queued, running = columns[0], columns[1]
    local = np.maximum(cands.gpu, cands.store)
    blocks = (
        cfg.gpu_weight * cands.gpu
        + cfg.store_weight * np.maximum(0, cands.store - cands.gpu)
        + cfg.remote_weight * np.maximum(0, cands.remote - local)
    )
    cached = np.rint(blocks * block_size).astype(np.int64)  # round(): half to even
    uncached = np.maximum(0, prompt_tokens - cached)
    # int64 sums, floats only after, as in estimate() (loads are bounded far below 2**53).
    queued = np.array(queued, dtype=np.int64)
    ttft = (queued + uncached) * cfg.prefill_ms_per_token
    ttft = ttft + np.array(running, dtype=np.float64) * cfg.decode_interference_ms
    recompute = cfg.recompute_weight * uncached * cfg.prefill_ms_per_token
    cands.scores = Scores(ttft + recompute, ttft, queued, each, prompt_tokens, block_size, cfg)


def choose(cands: Candidates, cfg: ScoringConfig, rng: random.Random) -> Candidate:
    """The lowest score (ties: fewest queued tokens, then random), or a softmax draw."""
    scores = cands.scores
    if cfg.temperature > 0 and len(cands) > 1:
        top = float(scores.score_ms.max()) or 1.0
        lo = float(scores.score_ms.min())
        exponents = -(scores.score_ms - lo) / (cfg.temperature * top)
        weights = list(map(math.exp, exponents.tolist()))
        return cands[rng.choices(range(len(cands)), weights=weights, k=1)[0]]
    tied = scores.lowest()
    return cands[tied[0] if len(tied) == 1 else rng.choice(tied)]


def explain(best: Candidate, cands: Candidates, total: int, cfg: ScoringConfig) -> str:
    """Why ``best`` won, in one line: its ttft formula, its tiers, and the runner-up."""
    est = best.estimate
    source = (
        "own accounting of routed requests"
        if est.report_age_s is None
        else f"load reported {est.report_age_s:.1f} s ago"
    )
    text = (
        f"{best.ref.name}: {est.formula()}; {best.overlap}/{total} blocks cached "
        f"(gpu {best.gpu}, store {best.store}, remote {best.remote}); {source}"
    )
    scores = cands.scores
    mine = cands.refs.index(best.ref)
    others = scores.lowest(skip=mine)
    if not others:
        return text
    runner = others[0]
    if cfg.temperature > 0:
        how = f"sampled at temperature {cfg.temperature:g}"
    elif scores.rank(runner) == scores.rank(mine):
        how = "tied on ttft and queue, drawn at random"
    else:
        how = "lowest score" if cfg.recompute_weight else "lowest ttft"
    runner_up = f"next {cands.refs[runner].name} ttft {float(scores.ttft_ms[runner]):.1f} ms"
    if cfg.recompute_weight:
        runner_up += f" (score {float(scores.score_ms[runner]):.1f} ms)"
    return f"{text}; {how} of {len(cands)} workers, {runner_up}"
