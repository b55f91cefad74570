"""Router trace replay: TTFT and hit rate of routing policies on a simulated cluster.

    python bench/router_trace.py            # full run (a few minutes on 2 cores)
    python bench/router_trace.py --quick    # under a minute

Writes bench/results/router_trace.json and bench/results/router_trace.png.

The public Mooncake synthetic trace (../shared/traces/, 3,993 requests,
512-token blocks, Poisson arrivals) and a generated multi-turn trace are
replayed through ``kvstore.testing.cluster_sim`` (N workers, LRU prefix caches
smaller than the trace, a FIFO prefill queue each, decode interference; the
cost model is in that module's docstring) at a light and a heavy load. Every
policy sees the same arrivals: the kvstore Router (fed the workers' cache
changes as vLLM events ``--event-lag-ms`` late), round-robin, random,
least-loaded, prefix-affinity hashing on the first one and two blocks,
session affinity (generated trace), and an oracle that picks the lowest exact
TTFT from the simulated queues and caches. Each case runs with several
seeds: seed 0 replays the trace's own arrival times, other seeds redraw the
Poisson gaps (Mooncake) or the whole trace (generated).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvstore.testing import cluster_policies as pol
from kvstore.testing.cluster_metrics import early_turns, estimate_error, summarise
from kvstore.testing.cluster_sim import CostModel, replay
from kvstore.testing.cluster_traces import (
    MultiTurnShape,
    load_mooncake,
    multi_turn,
    rearrive,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"  # --trace
SIMPLE = ("round_robin", "random", "least_loaded", "prefix_hash_1", "prefix_hash_2")
SIMPLE_MT = (*SIMPLE, "session_affinity")
PERCENTILES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")


@dataclass(frozen=True)
class Case:
    """One trace at one load with one seed: every policy replays it."""

    trace: str  # "mooncake" | "multi_turn"
    load: str  # "light" | "heavy"
    knob: float  # mooncake: arrival times x knob; multi_turn: new sessions per second
    seed: int
    workers: int
    model: CostModel
    event_lag_ms: float
    report_every_ms: float
    limit: int | None  # first requests of the trace only (--quick)
    path: str = str(MOONCAKE)


def build_trace(case: Case):
    if case.trace == "mooncake":
        return rearrive(load_mooncake(case.path, case.limit), case.knob, case.seed)
    shape = MultiTurnShape(
        sessions=case.limit or 3000,
        session_rate_per_s=case.knob,
        decode_ms_per_token=case.model.decode_ms_per_token,
        block_tokens=case.model.block_tokens,
    )
    return multi_turn(shape, seed=3 + case.seed)


def policies(case: Case) -> list:
    """Every policy of the case; "router" is the one the ratios are about, its
    variants show what event lag and load reports change."""
    m, w, s, lag, every = (
        case.model,
        case.workers,
        case.seed,
        case.event_lag_ms,
        case.report_every_ms,
    )
    out = [
        pol.KvRouterPolicy(w, m, lag, every, seed=s),
        pol.KvRouterPolicy(w, m, 0.0, every, seed=s, name="router_lag_0"),
        pol.KvRouterPolicy(w, m, 10 * lag, every, seed=s, name=f"router_lag_{10 * lag:g}ms"),
        pol.KvRouterPolicy(w, m, lag, 0.0, seed=s, name="router_no_reports"),
        pol.RoundRobin(),
        pol.RandomPolicy(seed=s),
        pol.LeastLoaded(seed=s),
        pol.PrefixHash(depth=1),
        pol.PrefixHash(depth=2),
        pol.OraclePolicy(seed=s),
    ]
    if case.trace == "multi_turn":
        out.insert(-1, pol.SessionAffinity())
    return out


def run_case(case: Case) -> list[dict]:
    trace = build_trace(case)
    rows = []
    for p in policies(case):
        t0 = time.perf_counter()
        run = replay(trace, p, case.model, case.workers)
        row = {"trace": case.trace, "load": case.load, "seed": case.seed}
        row.update(asdict(summarise(p.name, run)))
        row["load_api"] = bool(getattr(p, "load_report", None))
        if case.trace == "multi_turn":
            row["early_turns"] = early_turns(trace, run)
        if getattr(p, "predicted", None):
            row["ttft_estimate"] = estimate_error(p.predicted, run)
        row["sim_s"] = time.perf_counter() - t0
        rows.append(row)
    return rows


# -- aggregation ------------------------------------------------------------------


def _groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["trace"], r["load"]), []).append(r)
    return out


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def aggregate(rows: list[dict]) -> list[dict]:
    """Per trace, load and policy: median and range over seeds of each metric."""
    out = []
    metrics = ("hit_rate", *PERCENTILES, "ttft_mean_ms", "utilisation", "waited")
    for (trace, load), group in _groups(rows).items():
        for name in dict.fromkeys(r["policy"] for r in group):
            mine = [r for r in group if r["policy"] == name]
            agg = {"trace": trace, "load": load, "policy": name, "seeds": len(mine)}
            agg.update({m: spread([r[m] for r in mine]) for m in metrics})
            agg["shorter_prefix"] = spread([r["shorter_prefix"] for r in mine])
            out.append(agg)
    return out


def ratios(rows: list[dict], policy: str = "router") -> list[dict]:
    """``policy``'s TTFT percentiles over the oracle's and the best simple policy's, per seed."""
    out = []
    for (trace, load), group in _groups(rows).items():
        simple = SIMPLE_MT if trace == "multi_turn" else SIMPLE
        entry = {"trace": trace, "load": load, "policy": policy}
        for p in PERCENTILES:
            vs_oracle, vs_simple, best_names = [], [], []
            for seed in sorted({r["seed"] for r in group}):
                by = {r["policy"]: r for r in group if r["seed"] == seed}
                best = min(simple, key=lambda n, by=by, p=p: by[n][p])
                vs_oracle.append(by[policy][p] / by["oracle"][p])
                vs_simple.append(by[policy][p] / by[best][p])
                best_names.append(best)
            entry[f"{p}_vs_oracle"] = spread(vs_oracle)
            entry[f"{p}_vs_best_simple"] = spread(vs_simple)
            entry[f"{p}_best_simple"] = max(set(best_names), key=best_names.count)
        out.append(entry)
    return out


# -- report -------------------------------------------------------------------------


def _cell(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def markdown(agg: list[dict]) -> str:
    lines = [
        "| trace | load | policy | hit rate | TTFT p50 ms | p90 ms | p99 ms | utilisation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in agg:
        cells = [_cell(a["hit_rate"], ".3f")] + [_cell(a[p], ".0f") for p in PERCENTILES]
        lines.append(
            f"| {a['trace']} | {a['load']} | {a['policy']} | "
            + " | ".join(cells)
            + f" | {a['utilisation']['median']:.2f} |"
        )
    return "\n".join(lines)


README_POLICIES = (
    "router",
    "router_no_reports",
    "round_robin",
    "random",
    "least_loaded",
    "prefix_hash_1",
    "prefix_hash_2",
    "session_affinity",
    "oracle",
)


def readme_table(agg: list[dict]) -> str:
    """Policies as rows, each trace and load a column: hit rate, then TTFT p50 / p90 / p99 ms."""
    groups = list(dict.fromkeys((a["trace"], a["load"]) for a in agg))
    by = {(a["trace"], a["load"], a["policy"]): a for a in agg}
    head = " | ".join(f"{t.replace('_', '-')} {load}" for t, load in groups)
    lines = [f"| policy | {head} |", "|---" * (len(groups) + 1) + "|"]
    for name in README_POLICIES:
        cells = []
        for trace, load in groups:
            a = by.get((trace, load, name))
            cells.append(
                "-"
                if a is None
                else f"{a['hit_rate']['median']:.2f} · "
                + " / ".join(f"{a[p]['median']:.0f}" for p in PERCENTILES)
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_lines(rat: list[dict]) -> str:
    lines = []
    for r in rat:
        parts = []
        for p in PERCENTILES:
            o, s = r[f"{p}_vs_oracle"], r[f"{p}_vs_best_simple"]
            parts.append(
                f"{p[5:8]} {_cell(o, '.2f')} x oracle, {_cell(s, '.2f')} x {r[f'{p}_best_simple']}"
            )
        lines.append(f"{r['trace']} {r['load']}: " + "; ".join(parts))
    return "\n".join(lines)


def plot(agg: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((a["trace"], a["load"]) for a in agg))
    rows = -(-len(groups) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 5 * rows), squeeze=False)
    for ax, (trace, load) in zip(axes.flat, groups, strict=False):
        mine = [a for a in agg if (a["trace"], a["load"]) == (trace, load)]
        x = np.arange(len(mine))
        for k, p in enumerate(PERCENTILES):
            med = np.array([a[p]["median"] for a in mine]) / 1e3
            lo = med - np.array([a[p]["min"] for a in mine]) / 1e3
            hi = np.array([a[p]["max"] for a in mine]) / 1e3 - med
            ax.bar(x + (k - 1) * 0.27, med, 0.27, yerr=[lo, hi], capsize=2, label=p[5:8])
        ax.set_yscale("log")
        ax.set_xticks(x, [a["policy"] for a in mine], rotation=55, ha="right", fontsize=8)
        util = max(a["utilisation"]["median"] for a in mine)
        ax.set_title(f"{trace}, {load} load (util <= {util:.2f})", fontsize=9)
        ax.set_ylabel("TTFT (s), median over seeds, bars = range")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main -----------------------------------------------------------------------------


def router_fingerprint() -> str:
    """sha256 of the router's sources: which router these numbers are of."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "kvstore" / "router").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def host() -> dict:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
    }


def cases(args, model: CostModel) -> list[Case]:
    loads = {
        "mooncake": {"light": args.light_scale, "heavy": args.heavy_scale},
        "multi_turn": {"light": args.mt_light_rate, "heavy": args.mt_heavy_rate},
    }
    limits = {"mooncake": 1500 if args.quick else None, "multi_turn": 800 if args.quick else 3000}
    out = []
    for trace, by_load in loads.items():
        for load, knob in by_load.items():
            for seed in range(args.seeds):
                out.append(
                    Case(
                        trace,
                        load,
                        knob,
                        seed,
                        args.workers,
                        model,
                        args.event_lag_ms,
                        args.report_every_ms,
                        limits[trace],
                        args.trace,
                    )
                )
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter traces, 2 seeds")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per case (default 3, quick 2)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--cache-blocks", type=int, default=1000)
    ap.add_argument("--mt-cache-blocks", type=int, default=300)
    ap.add_argument("--prefill-tokens-per-ms", type=float, default=25.0)
    ap.add_argument("--decode-ms-per-token", type=float, default=20.0)
    ap.add_argument("--decode-interference", type=float, default=0.005)
    ap.add_argument("--event-lag-ms", type=float, default=100.0)
    ap.add_argument("--report-every-ms", type=float, default=100.0)
    ap.add_argument("--light-scale", type=float, default=0.8)
    ap.add_argument("--heavy-scale", type=float, default=0.3)
    ap.add_argument("--mt-light-rate", type=float, default=3.0, help="sessions/s")
    ap.add_argument("--mt-heavy-rate", type=float, default=10.0, help="sessions/s")
    ap.add_argument("--trace", default=str(MOONCAKE), help="the Mooncake trace file")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(RESULTS / "router_trace.json"))
    args = ap.parse_args()
    args.seeds = args.seeds or (2 if args.quick else 3)
    return args


def model_for(args, trace: str) -> CostModel:
    cache = args.cache_blocks if trace == "mooncake" else args.mt_cache_blocks
    return CostModel(
        cache_blocks=cache,
        prefill_tokens_per_ms=args.prefill_tokens_per_ms,
        decode_interference=args.decode_interference,
        decode_ms_per_token=args.decode_ms_per_token,
    )


def main() -> None:
    args = parse_args()
    if not Path(args.trace).is_file():
        raise SystemExit(
            f"Mooncake trace not found at {args.trace}: pass --trace PATH to "
            "mooncake_synthetic_trace.jsonl (the FAST'25 release's synthetic trace)"
        )
    t_start = time.perf_counter()
    todo = [
        c
        for trace in ("mooncake", "multi_turn")
        for c in cases(args, model_for(args, trace))
        if c.trace == trace
    ]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        rows = [r for rs in pool.map(run_case, todo) for r in rs]
    agg, rat = aggregate(rows), ratios(rows)
    print(markdown(agg))
    print(ratio_lines(rat))
    print(readme_table(agg))
    result = {
        "host": host(),
        "parameters": {k: v for k, v in vars(args).items() if k != "out"},
        "cost_models": {t: asdict(model_for(args, t)) for t in ("mooncake", "multi_turn")},
        "load_api": any(r["load_api"] for r in rows),
        "router_sources_sha256": router_fingerprint(),
        "summary": agg,
        "router_ratios": rat,
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(agg, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
