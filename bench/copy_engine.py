"""Copy-engine benchmark: gather (save) and scatter (load) throughput vs the device's ceiling.

    python bench/copy_engine.py --quick              # < 1 min on a 2-core host
    python bench/copy_engine.py                      # full sweep
    python bench/copy_engine.py --device cuda        # on a GPU (rows merge into the same JSON)

For each layout, slot size (one layer of one block) and block count, a request
moves `num_blocks` random blocks of `num_layers` layers between a paged cache
and randomly placed slots of a pool, through the copier's blocks path
(``save_blocks``/``load_blocks``: a RegionTable built once, per request only
block ids and slot addresses) and, in the same interleaving, through the older
pieces path (``plan()`` + ``save(pieces)``, which sorts every piece). The
ceiling is measured in the same run on the same device, interleaved with the
copier so drift hits both alike: per repeat, the faster of one contiguous torch
``copy_`` of the same bytes and the copier's own routine given those bytes as
ONE piece (same threads, same streaming stores). The ratio is taken per repeat
and reported as its median and p10/p90. On a GPU every op is timed with CUDA
events on the stream (GPU time), after a warm-up of the device, and the host
time of each call (enqueue only) is reported next to it.

Section "plan" (host): the host-side cost of one call before any byte moves,
per call and per block, old (plan + overlap sort + table) against new
(O(blocks) checks of the blocks path), interleaved, p10/p50/p90.

After timing, every config is verified against the torch oracle on both
paths: random bytes saved land in their slots exactly, and loaded into a
zeroed cache they come back whole. Results go to bench/results/copy.json and copy.png; rows
of other devices, and of sections not run, already in the JSON are kept.

Sections are separate functions selected with --sections; an end-to-end gRPC
measurement (bench_e2e) can be registered in SECTIONS next to "copy".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.copy import (
    HostCopier,
    LayerRegion,
    Pieces,
    RegionTable,
    copier_for,
    plan,
    region_from_tensor,
)
from kvstore.copy.testing import reference_gather
from kvstore.wire.kv_layout import KINDS

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = KINDS
SLOT_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
STYLES = ("-", "--", ":", "-.")  # one line style per block count in the plot
GBPS_NOTE = (
    "gbps = payload bytes moved once (each byte read once and written once counts once) "
    "/ median wall time of one call, 1 GB = 1e9 bytes; ratio = ceiling time / copier time "
    "per interleaved repeat (median, and p10/p50/p90 in ratio_p10_p50_p90), the ceiling being "
    "the faster of one contiguous torch uint8 copy_ and the copier's own routine on ONE piece "
    "of the same total bytes, on the same device; every config's bytes are verified"
)


@dataclass(frozen=True)
class Profile:
    """Sizes of one sweep."""

    total_bytes: int  # target bytes per request (layers x blocks x slot size)
    block_counts: tuple[int, ...]
    repeats: int
    warmup: int
    max_layers: int = 1024


QUICK = Profile(total_bytes=128 << 20, block_counts=(64,), repeats=9, warmup=1)
FULL = Profile(total_bytes=256 << 20, block_counts=(16, 64, 256), repeats=9, warmup=2)
CUDA_TOTAL = 1 << 30  # a GPU moves 64 MiB in tens of microseconds: use more


@dataclass(frozen=True)
class Config:
    layout: str
    slot_bytes: int
    num_blocks: int
    num_layers: int

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_blocks * self.num_layers


def configs(profile: Profile) -> list[Config]:
    out = []
    for layout in LAYOUTS:
        for slot in SLOT_SIZES:
            for blocks in profile.block_counts:
                layers = min(profile.max_layers, profile.total_bytes // (slot * blocks))
                if layers >= 1:
                    out.append(Config(layout, slot, blocks, layers))
    return out


# ---------------------------------------------------------------- buffers and layers


class Buffers:
    """Every buffer a sweep needs, allocated and touched once, then viewed per config."""

    def __init__(self, total_bytes: int, device: str, cache_factor: int = 4) -> None:
        def alloc(n: int) -> torch.Tensor:
            return torch.full((n,), 7, dtype=torch.uint8, device=device)

        self.cache_factor = cache_factor  # paged cache holds this many times the request's blocks
        self.paged = alloc(total_bytes * cache_factor)
        self.pool = alloc(total_bytes)
        self.src = alloc(total_bytes)
        self.dst = alloc(total_bytes)


def layer_tensor(buf: torch.Tensor, kind: str, slot_bytes: int, cache_blocks: int) -> torch.Tensor:
    """An fp16 layer of `cache_blocks` blocks whose slot is `slot_bytes`, viewed over `buf`."""
    elems = slot_bytes // 2 // (2 if kind != "mla" else 1)  # elements of one segment
    bs = 16
    if kind == "mla":
        shape: tuple[int, ...] = (cache_blocks, bs, elems // bs)
    else:
        d = min(128, elems // bs)
        inner = (bs, elems // bs // d, d)
        shape = (2, cache_blocks, *inner) if kind == "kv_first" else (cache_blocks, 2, *inner)
    n = slot_bytes * cache_blocks
    return buf[:n].view(torch.float16).view(shape)


@dataclass
class Request:
    """One request: its plan, the layers and blocks it reads, the slots it fills."""

    pieces: Pieces
    plan_ms: float
    tensors: list[torch.Tensor]
    block_ids: np.ndarray
    order: np.ndarray  # (layers, blocks): slot index in the pool of each block's layer
    table: RegionTable  # the layers, derived once (what a registration keeps)
    slots: np.ndarray  # (layers, blocks) uint64 slot addresses


def request(cfg: Config, bufs: Buffers, rng: np.random.Generator) -> Request:
    """Plan of one request (random blocks into randomly placed slots) and planning time (ms)."""
    cache_blocks = cfg.num_blocks * bufs.cache_factor
    layer_bytes = cfg.slot_bytes * cache_blocks
    tensors = [
        layer_tensor(bufs.paged[i * layer_bytes :], cfg.layout, cfg.slot_bytes, cache_blocks)
        for i in range(cfg.num_layers)
    ]
    regions = [region_from_tensor(t, cfg.layout) for t in tensors]
    ids = rng.choice(cache_blocks, size=cfg.num_blocks, replace=False)
    order = rng.permutation(cfg.num_layers * cfg.num_blocks).reshape(cfg.num_layers, -1)
    slots = (bufs.pool.data_ptr() + order * cfg.slot_bytes).astype(np.uint64)
    start = time.perf_counter()
    pieces = plan(regions, ids, slots)
    plan_ms = (time.perf_counter() - start) * 1e3
    return Request(pieces, plan_ms, tensors, ids, order, RegionTable(regions), slots)


def verify(cfg: Config, req: Request, bufs: Buffers, copier, stream_kw: dict) -> None:
    """Both paths moved the right bytes (see verify_path)."""
    blocks = {
        "save": lambda: copier.save_blocks(req.table, req.block_ids, req.slots, **stream_kw),
        "load": lambda: copier.load_blocks(req.table, req.block_ids, req.slots, **stream_kw),
    }
    pieces = {
        "save": lambda: copier.save(req.pieces, **stream_kw),
        "load": lambda: copier.load(req.pieces, **stream_kw),
    }
    for ops in (blocks, pieces):
        verify_path(cfg, req, bufs, ops)


def verify_path(cfg: Config, req: Request, bufs: Buffers, ops: dict) -> None:
    """The timed work moved the right bytes: random blocks saved land in their slots
    exactly (torch oracle), and loaded back into a zeroed cache they are whole again."""
    used = cfg.slot_bytes * cfg.num_blocks * bufs.cache_factor * cfg.num_layers
    bufs.paged[:used].random_(0, 256)
    kinds = [cfg.layout] * cfg.num_layers
    expected = reference_gather(req.tensors, kinds, req.block_ids)
    bufs.pool[: cfg.total_bytes].zero_()
    ops["save"]()
    _sync(cfg, bufs)
    slots = bufs.pool[: cfg.total_bytes].view(-1, cfg.slot_bytes)
    for layer, image in enumerate(expected):
        if not torch.equal(slots[torch.as_tensor(req.order[layer])], image):
            raise AssertionError(f"{cfg}: save moved wrong bytes (layer {layer})")
    bufs.paged[:used].zero_()
    ops["load"]()
    _sync(cfg, bufs)
    back = reference_gather(req.tensors, kinds, req.block_ids)
    if not all(torch.equal(a, b) for a, b in zip(back, expected, strict=True)):
        raise AssertionError(f"{cfg}: load moved wrong bytes")


def _sync(cfg: Config, bufs: Buffers) -> None:
    if bufs.pool.is_cuda:
        torch.cuda.synchronize()


# ---------------------------------------------------------------- timing


class Timer:
    """Time of one op, every op starting from the same machine state.

    On the host, the previous op's dirty cache lines would be written back
    during the next op and bill it (a torch copy leaves up to a last-level
    cache of them; streaming stores leave none), and torch's OpenMP threads
    spin for a while after a parallel copy. So before each op this reads a
    buffer twice the last-level cache, untimed; the time is wall time. On a GPU
    it synchronises first, and the time is GPU time between two CUDA events
    recorded on torch's current stream around the op (the copier's work is
    ordered inside them); `host_s` keeps the host time of the call itself
    (the enqueue), for the host-side cost.
    """

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._scratch = None if self.cuda else np.ones(2 * _llc_bytes() // 8, dtype=np.uint64)
        self.host_s = 0.0

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        else:
            self._scratch.sum()  # one thread; evicts (and writes back) what the last op left

    def __call__(self, fn: Callable[[], object]) -> float:
        self.settle()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            self.host_s = time.perf_counter() - start
            return self.host_s
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        fn()
        self.host_s = time.perf_counter() - start
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def _llc_bytes() -> int:
    """Size of the last-level cache (sysfs), at least 32 MiB when unknown."""
    sizes = [32 << 20]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * mult)
    return max(sizes)


def measure(ops: dict[str, Callable[[], object]], timer: Timer, warmup: int, repeats: int,
            rng: np.random.Generator) -> dict[str, list[float]]:  # fmt: skip
    """Seconds of every repeat per op; ops interleaved in a fresh random order each repeat.

    Each op's host seconds (Timer.host_s) come back under "<op>/host".
    """
    names = list(ops)
    for _ in range(warmup):
        for name in names:
            timer(ops[name])
    samples: dict[str, list[float]] = {k: [] for name in names for k in (name, f"{name}/host")}
    for _ in range(repeats):
        for name in rng.permutation(names):
            samples[name].append(timer(ops[name]))
            samples[f"{name}/host"].append(timer.host_s)
    return samples


def spread(values: list[float]) -> list[float]:
    """[p10, median, p90] of ``values``."""
    q = np.quantile(np.asarray(values), [0.1, 0.5, 0.9])
    return [round(float(x), 3) for x in q]


# ---------------------------------------------------------------- sections


def bench_copy(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Copier save/load vs contiguous copy for every layout x slot size x block count."""
    profile = QUICK if args.quick else FULL
    if args.device.startswith("cuda"):
        profile = Profile(CUDA_TOTAL, profile.block_counts, profile.repeats, profile.warmup)
    if args.total_mib:
        profile = Profile(
            args.total_mib << 20, profile.block_counts, profile.repeats, profile.warmup
        )
    copier = copier_for(args.device)
    if args.no_streaming and isinstance(copier, HostCopier):
        copier = HostCopier(streaming_min_bytes=1 << 62)
    timer = Timer(args.device)
    stream_kw = _cuda_stream_kwargs(args.device)
    bufs = Buffers(profile.total_bytes, args.device)
    if timer.cuda:  # a cold GPU runs its first copies at half speed: warm it first
        for _ in range(20):
            bufs.dst.copy_(bufs.src)
        torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    rows = []
    for cfg in _progress(configs(profile), args):
        req = request(cfg, bufs, rng)
        rows += _copy_rows(cfg, req, bufs, copier, timer, profile, rng, stream_kw, args.device)
        verify(cfg, req, bufs, copier, stream_kw)
    meta = {"profile": profile.__dict__, "copier": _copier_meta(copier)}
    return rows, meta


def _copy_rows(cfg, req, bufs, copier, timer, profile, rng, stream_kw, device) -> list[dict]:
    """Time save and load (blocks path and pieces path) against the ceiling, interleaved.

    The ceiling is the fastest way to move the same bytes on the device: the
    faster (per repeat) of one torch ``copy_`` and the copier's own routine given
    ONE contiguous piece of the same total bytes (same threads, same stores).
    """
    n = cfg.total_bytes
    src, dst = bufs.src[:n], bufs.dst[:n]
    one = Pieces(
        paged_addr=np.array([src.data_ptr()], dtype=np.uint64),
        slot_addr=np.array([dst.data_ptr()], dtype=np.uint64),
        nbytes=np.array([n], dtype=np.uint64),
    )
    table, ids, slots = req.table, req.block_ids, req.slots
    times = measure(
        {
            "torch_copy": lambda: dst.copy_(src),
            "one_range": lambda: copier.save(one, **stream_kw),
            "save": lambda: copier.save_blocks(table, ids, slots, **stream_kw),
            "load": lambda: copier.load_blocks(table, ids, slots, **stream_kw),
            "save_pieces": lambda: copier.save(plan(req.table.regions, ids, slots), **stream_kw),
            "load_pieces": lambda: copier.load(plan(req.table.regions, ids, slots), **stream_kw),
        },
        timer,
        profile.warmup,
        profile.repeats,
        rng,
    )
    ceiling = [min(a, b) for a, b in zip(times["torch_copy"], times["one_range"], strict=True)]
    gbps = {op: n / statistics.median(t) / 1e9 for op, t in times.items() if "/" not in op}
    rows = []
    for op in ("save", "load"):
        ratios = [c / t for c, t in zip(ceiling, times[op], strict=True)]  # same repeat
        old = [c / t for c, t in zip(ceiling, times[f"{op}_pieces"], strict=True)]
        rows.append({
            "section": "copy", "device": device, "layout": cfg.layout,
            "slot_bytes": cfg.slot_bytes, "num_blocks": cfg.num_blocks,
            "num_layers": cfg.num_layers, "total_bytes": n, "pieces": len(req.pieces),
            "op": op, "path": "blocks", "gbps": round(gbps[op], 3),
            "ceiling_gbps": round(n / statistics.median(ceiling) / 1e9, 3),
            "torch_copy_gbps": round(gbps["torch_copy"], 3),
            "one_range_gbps": round(gbps["one_range"], 3),
            "ratio": round(statistics.median(ratios), 3), "ratio_p10_p50_p90": spread(ratios),
            "pieces_path_gbps": round(gbps[f"{op}_pieces"], 3),
            "pieces_path_ratio": round(statistics.median(old), 3),
            "pieces_path_ratio_p10_p50_p90": spread(old),
            "host_us_p10_p50_p90": spread([t * 1e6 for t in times[f"{op}/host"]]),
            "pieces_path_host_us_p10_p50_p90": spread(
                [t * 1e6 for t in times[f"{op}_pieces/host"]]),
            "timing": "cuda events" if timer.cuda else "wall",
            "plan_ms": round(req.plan_ms, 3), "verified": True,
        })  # fmt: skip
    return rows


def bench_plan(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Host-side cost of one call before any byte moves: pieces path vs blocks path.

    Old: plan() + HostCopier.prepare (overlap sort, thread split, table). New:
    HostCopier.prepare_blocks (O(blocks) checks, byte split; the native helper
    computes the pieces while it copies). Interleaved, `repeats` x 3 samples.
    """
    if args.device != "cpu":
        return [], {"what": "host only: see host_us in the copy rows for the GPU's host side"}
    profile = QUICK if args.quick else FULL
    copier = HostCopier()
    rng = np.random.default_rng(1)
    rows = []
    for cfg in configs(profile):
        cache_blocks = cfg.num_blocks * 4  # as Buffers.cache_factor
        layer_bytes = cfg.slot_bytes * cache_blocks
        regions = [_region(i * layer_bytes, cfg, cache_blocks) for i in range(cfg.num_layers)]
        table = RegionTable(regions)
        ids = rng.choice(cache_blocks, size=cfg.num_blocks, replace=False)
        order = rng.permutation(cfg.num_layers * cfg.num_blocks).reshape(cfg.num_layers, -1)
        slots = (order * cfg.slot_bytes).astype(np.uint64)  # addresses only: nothing moves
        for op in ("save", "load"):
            ops = _plan_ops(copier, op, regions, table, ids, slots)
            samples = _time_host(ops, 3 * profile.repeats, rng)
            old, new = (spread([t * 1e6 for t in samples[k]]) for k in ("old", "new"))
            rows.append({
                "section": "plan", "device": "cpu", "layout": cfg.layout,
                "slot_bytes": cfg.slot_bytes, "num_blocks": cfg.num_blocks,
                "num_layers": cfg.num_layers, "op": op,
                "pieces": len(plan(regions, ids, slots, merge=False)),
                "old_us_p10_p50_p90": old, "new_us_p10_p50_p90": new,
                "old_us_per_block": round(old[1] / cfg.num_blocks, 3),
                "new_us_per_block": round(new[1] / cfg.num_blocks, 3),
                "speedup": round(old[1] / new[1], 2),
            })  # fmt: skip
    return rows, {"what": "host-side planning per call (no bytes moved), us, p10/p50/p90"}


def _plan_ops(copier, op, regions, table, ids, slots) -> dict[str, Callable[[], object]]:
    return {
        "old": lambda: copier.prepare(plan(regions, ids, slots), op),
        "new": lambda: copier.prepare_blocks(table, ids, slots, op),
    }


def _region(base: int, cfg: Config, cache_blocks: int) -> LayerRegion:
    """The region layer_tensor() would give for this config, without its memory."""
    if cfg.layout == "kv_first":
        seg = cfg.slot_bytes // 2
        return LayerRegion(base, cache_blocks, 2, seg, seg, seg * cache_blocks)
    return LayerRegion(base, cache_blocks, 1, cfg.slot_bytes, cfg.slot_bytes, 0)


def _time_host(ops: dict[str, Callable[[], object]], repeats: int, rng) -> dict[str, list[float]]:
    for fn in ops.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for name in rng.permutation(list(ops)):
            start = time.perf_counter()
            ops[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def bench_e2e(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Save / Load of 256 blocks x 32 layers through a real server (bench/e2e_store.py)."""
    from e2e_store import bench_e2e as run  # bench/ is sys.path[0] when run as a script

    return run(args)


SECTIONS: dict[str, Callable[[argparse.Namespace], tuple[list[dict], dict]]] = {
    "copy": bench_copy,
    "plan": bench_plan,
    "e2e": bench_e2e,
}


def _cuda_stream_kwargs(device: str) -> dict:
    """Run CUDA copies on torch's current stream so torch.cuda.synchronize covers them."""
    if not device.startswith("cuda"):
        return {}
    import cupy

    return {"stream": cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)}


def _copier_meta(copier) -> dict:
    if isinstance(copier, HostCopier):
        return {"kind": "host", "backend": copier.backend, "threads": copier.num_threads,
                "streaming_min_bytes": copier.streaming_min_bytes}  # fmt: skip
    return {"kind": "cuda", "chunk_bytes": copier.chunk_bytes,
            "threads_per_block": copier.threads_per_block,
            "blocks_grid": copier.occupancy_grid()}  # fmt: skip


def _progress(items: list, args: argparse.Namespace):
    if args.no_progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="copy bench", unit="cfg")


# ---------------------------------------------------------------- output


def run_meta(args: argparse.Namespace) -> dict:
    meta = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "loadavg_start": _loadavg(),
        "quick": args.quick,
    }
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return meta


def _loadavg() -> list[float] | None:
    """1/5/15-minute load: other work on the host skews both the copier and the baseline."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: Path, device: str, meta: dict, rows: list[dict], sections: list[str]) -> None:
    """Replace this device's rows and metadata of the sections run; keep everything else."""
    old = json.loads(path.read_text()) if path.exists() else {}
    runs = dict(old.get("runs", {}))
    runs[device] = {**{k: v for k, v in runs.get(device, {}).items() if k in SECTIONS}, **meta}
    kept = [
        r for r in old.get("rows", [])
        if r.get("device") != device or r.get("section") not in sections
    ]  # fmt: skip
    doc = {"gbps_note": GBPS_NOTE, "runs": runs, "rows": kept + rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def plot(json_path: Path, png_path: Path) -> None:
    """Ratio vs slot size, one panel per device x op, one line per layout (x block count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(json_path.read_text())["rows"] if r.get("section") == "copy"]
    devices = sorted({r["device"] for r in rows})
    if not devices:
        return
    fig, axes = plt.subplots(len(devices), 2, figsize=(11, 4 * len(devices)), squeeze=False)
    for axrow, device in zip(axes, devices, strict=True):
        for ax, op in zip(axrow, ("save", "load"), strict=True):
            sel = [r for r in rows if r["device"] == device and r["op"] == op]
            for color, layout in zip(("C0", "C1", "C2", "C3"), LAYOUTS, strict=True):
                for style, blocks in zip(
                    STYLES, sorted({r["num_blocks"] for r in sel}), strict=False
                ):
                    pts = sorted(
                        (r["slot_bytes"], r["ratio"])
                        for r in sel
                        if r["layout"] == layout and r["num_blocks"] == blocks
                    )
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        ax.plot(xs, ys, style, color=color, marker="o", ms=4,
                                label=f"{layout}, {blocks} blocks")  # fmt: skip
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.axhline(0.8, color="red", lw=0.8, ls="--", label="0.8 target")
            ax.set_xscale("log", base=2)
            ax.set_xticks(SLOT_SIZES, [_human(s) for s in SLOT_SIZES])
            ax.set_xlabel("slot size (one layer of one block)")
            ax.set_ylabel("copier / ceiling (same bytes as one piece)")
            ax.set_title(f"{device}: {op} ({'gather' if op == 'save' else 'scatter'})")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def print_table(rows: list[dict]) -> None:
    print(f"{'layout':<13}{'slot':>8}{'blocks':>7}{'layers':>7}{'op':>6}"
          f"{'GB/s':>8}{'ceil':>8}{'ratio':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['layout']:<13}{_human(r['slot_bytes']):>8}{r['num_blocks']:>7}"
            f"{r['num_layers']:>7}{r['op']:>6}{r['gbps']:>8.2f}{r['ceiling_gbps']:>8.2f}"
            f"{r['ratio']:>7.2f}"
        )


def print_summary(rows: list[dict]) -> None:
    """Median, min and max ratio per device, op and slot size over layouts and block counts."""
    print("ratio (copier / ceiling) by slot size, over layouts and block counts:")
    keys = sorted({(r["device"], r["op"], r["slot_bytes"]) for r in rows})
    for device, op, slot in keys:
        ratios = [
            r["ratio"]
            for r in rows
            if (r["device"], r["op"], r["slot_bytes"]) == (device, op, slot)
        ]
        old = [
            r["pieces_path_ratio"]
            for r in rows
            if (r["device"], r["op"], r["slot_bytes"]) == (device, op, slot)
        ]
        print(f"  {device:<7}{op:<5}{_human(slot):>8}  median {statistics.median(ratios):.2f}"
              f"  min {min(ratios):.2f}  max {max(ratios):.2f}"
              f"   (pieces path median {statistics.median(old):.2f})")  # fmt: skip


def print_plan_summary(rows: list[dict]) -> None:
    """Host planning per call (median us) and per block, old vs new, by layout and slot size."""
    if rows:
        print("host planning per call, p50 us (us per block): pieces path -> blocks path")
    for r in rows:
        old, new = r["old_us_p10_p50_p90"][1], r["new_us_p10_p50_p90"][1]
        print(f"  {r['layout']:<13}{_human(r['slot_bytes']):>8}{r['num_blocks']:>6} blk "
              f"{r['num_layers']:>5} L {r['op']:<5}{old:>10.1f} ({r['old_us_per_block']:.2f})"
              f" -> {new:>7.1f} ({r['new_us_per_block']:.3f})  x{r['speedup']}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sweep, under a minute on 2 cores")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--sections", default="copy,plan,e2e", help=f"comma list of {sorted(SECTIONS)}")
    p.add_argument("--total-mib", type=int, default=0, help="override bytes per request")
    p.add_argument("--out", type=Path, default=RESULTS / "copy.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--gpu-copy",
        choices=("pieces", "blocks"),
        default="pieces",
        help="e2e on a GPU: the server's --gpu-copy (how Save/Load copy in GPU pools)",
    )
    p.add_argument(
        "--no-streaming",
        action="store_true",
        help="host: plain memcpy only (no cache-bypassing stores), for comparison",
    )
    args = p.parse_args(argv)
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    meta = run_meta(args)
    rows: list[dict] = []
    for name in args.sections.split(","):
        section_rows, section_meta = SECTIONS[name](args)
        rows += section_rows
        meta[name] = section_meta
    meta["loadavg_end"] = _loadavg()
    copy_rows = [r for r in rows if r.get("section") == "copy"]
    print_table(copy_rows)
    print_summary(copy_rows)
    print_plan_summary([r for r in rows if r.get("section") == "plan"])
    write_json(args.out, args.device, meta, rows, args.sections.split(","))
    plot(args.out, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
