"""What a replay comes to: the numbers a reader compares, and two diagnostics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.testing.cluster_sim import Replay, TraceRequest


@dataclass(frozen=True)
class Summary:
    """One policy on one trace at one load: what a reader compares."""

    policy: str
    requests: int
    hit_rate: float  # cached / total prompt tokens
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    utilisation: float  # prefill-busy time / (workers x span)
    waited: float  # share of requests that queued behind another prefill
    shorter_prefix: float  # share of routes to a worker holding less than the best one
    max_over_mean_requests: float


def summarise(policy: str, run: Replay) -> Summary:
    recs = run.records
    ttft = np.asarray([r.ttft_ms for r in recs])
    p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99]))
    counts = np.bincount([r.worker for r in recs], minlength=len(run.busy_ms))
    return Summary(
        policy,
        len(recs),
        sum(r.cached_tokens for r in recs) / sum(r.input_tokens for r in recs),
        p50,
        p90,
        p99,
        float(ttft.mean()),
        sum(run.busy_ms) / (len(run.busy_ms) * run.span_ms),
        float(np.mean([r.queue_ms > 0 for r in recs])),
        float(np.mean([r.routed_prefix_blocks < r.best_prefix_blocks for r in recs])),
        float(counts.max() / counts.mean()),
    )


def early_turns(trace: Sequence[TraceRequest], run: Replay) -> float:
    """Share of turns that arrived before their session's previous answer ended
    (the open-loop trace outran a cluster slower than its users)."""
    done: dict[int, float] = {}
    early = 0
    for request, record in zip(trace, run.records, strict=True):
        early += request.arrival_ms < done.get(request.session, -1.0)
        done[request.session] = record.done_ms
    return early / len(trace)


def estimate_error(predicted: dict[str, float], run: Replay) -> dict:
    """How the router's TTFT forecast for its chosen worker compares with what happened."""
    pairs = [(predicted[r.request_id], r.ttft_ms) for r in run.records if r.request_id in predicted]
    err = np.asarray([actual - guess for guess, actual in pairs])
    within = [abs(actual - guess) <= 0.25 * actual for guess, actual in pairs]
    return {
        "median_error_ms": float(np.median(err)),  # actual - forecast
        "p90_abs_error_ms": float(np.percentile(np.abs(err), 90)),
        "within_25pct": float(np.mean(within)),
    }
