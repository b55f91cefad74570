"""What a per-block blake3 checksum of slot bytes would cost, against moving them.

    python bench/checksum_cost.py            # 7 rounds, 64 MiB per size and arm
    python bench/checksum_cost.py --quick    # 3 rounds, 16 MiB

For slot sizes 16 KiB .. 4 MiB, each round hashes the same host buffer (cut
into slots of that size) with blake3 single-threaded, blake3 with its
multithreading (``max_threads=AUTO``, one hasher per slot), and, as the
baseline of the same run, copies it once (numpy, i.e. memcpy): the floor of
any pass over the bytes. Arms and sizes are interleaved within a round so that
drift hits them alike. Digests of both blake3 arms are compared per slot
(bytes verified). Reported: GB/s per arm and size, p10/p50/p90 over rounds.
Writes bench/results/checksum_cost.json. docs/design.md §8 puts these next to
the transfer rates (tcp about 1 GB/s, shared memory 5-7 GB/s, GPU far more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from blake3 import blake3

OUT = Path(__file__).parent / "results" / "checksum_cost.json"
SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def digests(buf: np.ndarray, slot: int, threads: int) -> list[bytes]:
    return [
        blake3(buf[i : i + slot], max_threads=threads).digest() for i in range(0, len(buf), slot)
    ]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(rounds: int, total: int) -> dict:
    buf = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(buf)
    arms = {
        "memcpy": lambda s: np.copyto(dst, buf),
        "blake3_1thread": lambda s: digests(buf, s, 1),
        "blake3_auto": lambda s: digests(buf, s, blake3.AUTO),
    }
    samples: dict[str, dict[int, list[float]]] = {a: {s: [] for s in SIZES} for a in arms}
    for r in range(rounds):
        order = SIZES if r % 2 == 0 else SIZES[::-1]
        for size in order:
            out = {}
            names = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in names:
                seconds, out[name] = timed(lambda n=name, s=size: arms[n](s))
                samples[name][size].append(total / seconds / 1e9)
            assert out["blake3_1thread"] == out["blake3_auto"], "digests differ"
        assert np.array_equal(dst, buf), "copy differs"
    return {
        name: {
            str(size): dict(zip(("p10", "p50", "p90"), np.percentile(v, [10, 50, 90]).round(3)))
            for size, v in per_size.items()
        }
        for name, per_size in samples.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, total = (3, 16 << 20) if args.quick else (7, 64 << 20)
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "rounds": rounds,
        "bytes_per_measure": total,
        "gb_per_s": run(rounds, total),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, default=float) + "\n")
    for name, per_size in result["gb_per_s"].items():
        row = "  ".join(f"{int(s) >> 10:>5}K {v['p50']:6.2f}" for s, v in per_size.items())
        print(f"{name:>15}: {row}   (GB/s p50)")


if __name__ == "__main__":
    main()
