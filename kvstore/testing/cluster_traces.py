"""Traces for ``kvstore.testing.cluster_sim``: the Mooncake file, and generated multi-turn.

- ``load_mooncake``: the public Mooncake synthetic trace (one JSON object a
  line: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
  512-token blocks, equal ids meaning reusable prefix KV).
- ``rearrive``: the same requests in the same order at another load: times
  scaled, and for a seed other than 0 the gaps drawn again from an
  exponential of the same mean (the trace's arrivals are Poisson already).
- ``multi_turn``: the shape of bench/router.py's generated trace (30 system
  prompts of 1k-6k tokens with Zipf popularity; sessions of 1-12 turns, mean
  ~4; each turn adds 200-1500 user tokens; 100-600-token answers become part
  of the next prompt), with arrival times (``MultiTurnShape``) and session
  ids, cut into blocks the
  way a prefix-caching engine names them: a block's id stands for its whole
  prefix, a partial block gets a fresh id, and the full blocks an answer
  completes are the request's ``output_ids``.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path

from kvstore.testing.cluster_sim import TraceRequest


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            r = json.loads(line)
            out.append(
                TraceRequest(
                    float(r["timestamp"]),
                    int(r["input_length"]),
                    int(r["output_length"]),
                    tuple(r["hash_ids"]),
                )
            )
    return out


def rearrive(trace: Sequence[TraceRequest], scale: float, seed: int = 0) -> list[TraceRequest]:
    """Arrival times x ``scale``; seed > 0 redraws the gaps (same mean, same order)."""
    if seed == 0 or len(trace) < 2:
        return [replace(r, arrival_ms=r.arrival_ms * scale) for r in trace]
    rng = random.Random(seed)
    t0 = trace[0].arrival_ms
    mean_gap = (trace[-1].arrival_ms - t0) / (len(trace) - 1)
    out, t = [], t0
    for r in trace:
        out.append(replace(r, arrival_ms=t * scale))
        t += rng.expovariate(1 / mean_gap)
    return out


@dataclass(frozen=True)
class MultiTurnShape:
    """A session's next turn arrives after its answer has streamed (output tokens
    x ``decode_ms_per_token``, as if its first token came at once) and the user
    has thought (at least ``min_think_s``, mean ``think_s``). Load is set by
    ``session_rate_per_s``, not by compressing think time, so turns keep their
    order in time unless the cluster is slower than the user."""

    sessions: int = 3000
    session_rate_per_s: float = 3.0  # new sessions per second
    think_s: float = 10.0  # mean think time between an answer and the next turn
    min_think_s: float = 1.0
    decode_ms_per_token: float = 20.0
    block_tokens: int = 512
    systems: int = 30

    def gap_s(self, rng: random.Random, answer_tokens: int) -> float:
        think = self.min_think_s + rng.expovariate(1 / (self.think_s - self.min_think_s))
        return answer_tokens * self.decode_ms_per_token / 1e3 + think


@dataclass
class _Context:
    full_ids: list[int]
    tail_tokens: int


class _Ids:
    """Fresh block ids: one counter for the whole trace."""

    def __init__(self) -> None:
        self._next = count(1)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


def _turn(ctx: _Context, user: int, answer: int, block: int, ids: _Ids):
    """The prompt's block ids, the answer's completed blocks, the next context."""
    prompt_tokens = len(ctx.full_ids) * block + ctx.tail_tokens + user
    new = _blocks(ctx.tail_tokens + user, block)
    prompt_ids = ctx.full_ids + ids.fresh(new)
    kept = prompt_tokens // block  # full blocks of the prompt
    done = (prompt_tokens + answer) // block
    output_ids = ids.fresh(done - kept)
    nxt = _Context(prompt_ids[:kept] + output_ids, (prompt_tokens + answer) % block)
    return prompt_tokens, prompt_ids, output_ids, nxt


def multi_turn(shape: MultiTurnShape, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = _Ids()
    block = shape.block_tokens
    sys_tokens = [rng.randint(1000, 6000) for _ in range(shape.systems)]
    systems = [_Context(ids.fresh(t // block), t % block) for t in sys_tokens]
    weights = [1 / (k + 1) ** 1.1 for k in range(shape.systems)]
    span = shape.sessions / shape.session_rate_per_s
    arrivals = []
    for s in range(shape.sessions):
        turns = min(12, 1 + int(rng.expovariate(1 / 3)))
        arrivals.append((rng.uniform(0, span), s, turns))
    heapq.heapify(arrivals)
    contexts: dict[int, _Context] = {}
    trace = []
    while arrivals:
        t, s, turns_left = heapq.heappop(arrivals)
        ctx = contexts.pop(s, None) or systems[rng.choices(range(shape.systems), weights)[0]]
        user, answer = rng.randint(200, 1500), rng.randint(100, 600)
        tokens, prompt_ids, output_ids, contexts[s] = _turn(ctx, user, answer, block, ids)
        trace.append(TraceRequest(t * 1e3, tokens, answer, tuple(prompt_ids), s, tuple(output_ids)))
        if turns_left > 1:
            heapq.heappush(arrivals, (t + shape.gap_s(rng, answer), s, turns_left - 1))
        else:
            del contexts[s]
    return trace
