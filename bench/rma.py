"""One-sided peer reads (NIXL READ, kvstore.transfer.rma) against raw two-sided ucxx,
host memory, two processes (issue 15 item 3; docs/design.md §4).

    python bench/rma.py --quick     # about five minutes on a 2-core host
    python bench/rma.py             # full: more repeats (about ten minutes)

Two spawned processes, each with a host pool registered once with its own NIXL
agent (RmaEndpoint) and a ucxx worker (the project's UCX defaults,
kvstore.transfer.ucx). The serving pool holds the pattern (8-byte word j = j *
an odd constant + 1, distinct everywhere); the fetching pool is poisoned (0xEE,
untimed) before every op, and after every op every byte it should have
received is compared (untimed).

Per slot size (16 KiB .. 4 MiB, --total-mib bytes a fetch, default 256 MiB, so
16384 .. 64 slots), each repeat runs these ops in a fresh random order:

  nixl_read   RmaEndpoint.read of every slot as one run: remote slots in a random
              order of the serving pool, landing in a random order of the
              fetching pool (so no two runs merge), default chunking
              (DEFAULT_CHUNK_BYTES a NIXL request); descriptor building included
  nixl_1req   the same with every run in one NIXL request (no chunking)
  raw_one     the same bytes as ONE ucxx tag message, pool to pool, the request
              round trip included (bench/transfer.py's raw_one)
  memcpy      one in-process numpy copyto of the same bytes (one thread)
  torch_copy  one in-process torch copy_ of the same bytes, torch's threads set to
              the cores this process may run on (torch_threads)
  nixl_one    the same bytes as ONE NIXL READ run, serving pool start to fetching
              pool start (bench/transfer.py's nixl_one), default chunking

The ceiling of a repeat is the fastest of memcpy, torch_copy and nixl_one in that
repeat (ceiling_won counts which op it was). Ratios are per repeat (ceiling time /
nixl_read time, raw_one time / nixl_read time, memcpy time / nixl_read time),
reported as p10/p50/p90. Then:

  control floor   a 16 KiB one-slot nixl_read (SlotRuns built, checked,
                  described, posted, waited) vs a 16 KiB raw_one round trip,
                  interleaved, --floor-repeats each, p10/p50/p90 in microseconds;
                  the landing bytes poisoned before and compared after every op
                  (untimed, warm-up included: verified_ops)
  prep per slot   host time to build the descriptors of N slot runs (plan_chunks,
                  get_xfer_descs, initialize_xfer; released unposted) for N = 1,
                  1024, 16384, p50 per slot in microseconds

Sweeps (--sweeps): "default", the project's UCX defaults (ucxx between peers on
one host over tcp, kvstore/transfer/README.md "Peer death"), and "mm", with
UCX_MM_ERROR_HANDLING=y (ucxx may use shared memory). NIXL reads host memory of
a peer on the same host with cma in both (kvstore.transfer.rma keeps ucxx's
UCX_RNDV_THRESH away from it).

JSON to bench/results/rma.json: benchmark, note, generated, quick, host,
nixl_version, sweeps[]: sweep, env (UCX_* / UCXPY_* both processes ran with),
transports (ucxx's active transports), torch_threads, rows[] (slot_bytes, slots,
total_bytes, repeats, ms_p10_p50_p90 per op, gbps_p50 per op, ceiling_ms_p10_p50_p90,
ceiling_gbps_p50, ceiling_won ({op: repeats it was the ceiling}),
ratio_ceiling_p10_p50_p90 (ceiling time / nixl_read time), ratio_raw_one_p10_p50_p90,
ratio_memcpy_p10_p50_p90, ratio_1req_p10_p50_p90, verified_reads (scattered NIXL
reads checked so far in the sweep), verified_ops (ops of the row checked, warm-up
included)), control_floor, prep_per_slot.

Shared with bench/transfer.py (it imports them from here): the raw ucxx baseline's
request protocol (RAW_ONE, RAW_REQUEST_TAG, RAW_DATA_TAG), ucx_env, one_run and
timed_read (a raw NIXL READ, its ceiling for one-sided fetches), quantiles.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.transfer import rma
from kvstore.transfer.ucx import loop_progress, post_recv

CTX = mp.get_context("spawn")
KIB, MIB = 1 << 10, 1 << 20
SLOT_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB)
POISON = 0xEE
FLOOR_SLOT = 16 * KIB
PREP_COUNTS = (1, 1024, 16384)
OUT = Path(__file__).parent / "results" / "rma.json"
# The raw ucxx baseline's protocol, shared with bench/transfer.py: a request
# (mode, nbytes) on RAW_REQUEST_TAG, the bytes back on RAW_DATA_TAG (+ i).
RAW_ONE = 0  # mode: the first nbytes of the serving pool as ONE message
RAW_REQUEST_TAG, RAW_DATA_TAG = 1, 2
CEILING_OPS = ("memcpy", "torch_copy", "nixl_one")  # per repeat the fastest is the ceiling


# ---- shared with bench/transfer.py: the raw baselines ----------------------------------


def polled() -> contextlib.AbstractContextManager:
    """UCX progressed on every turn of the loop while the block runs, as it is for
    kvstore's own operations (kvstore.transfer.progress): raw ucxx ops get the
    progress a fetch gets, not the armed fd's wake-ups."""
    progress = loop_progress()
    return progress.polling() if progress is not None else contextlib.nullcontext()


async def idle_recv(ep: Any, buffer: Any, tag: int) -> None:
    """Receive the next raw request as a PeerServer waits for a REQUEST: posted at
    once, the loop asleep until UCX's fd tells it came (kvstore.transfer.ucx)."""
    await post_recv(ep, buffer, tag)


def ucx_env(tls: str) -> dict:
    """The project's UCX defaults, then every UCX_* / UCXPY_* variable already set here
    (e.g. UCX_MM_ERROR_HANDLING=y for shared memory between same-host peers)."""
    from kvstore.transfer.ucx import UCX_DEFAULTS

    env = dict(UCX_DEFAULTS)
    env.update({k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_"))})
    if tls != "default":
        env["UCX_TLS"] = tls
    return env


def one_run(remote: int, local: int, nbytes: int) -> rma.SlotRuns:
    """``nbytes`` as ONE run: the fewest descriptors a NIXL READ of them can have."""
    return rma.SlotRuns.of([remote], [local], [nbytes])


def timed_read(
    endpoint: rma.RmaEndpoint,
    peer: rma.Peer,
    runs: rma.SlotRuns,
    chunk_bytes: int = rma.DEFAULT_CHUNK_BYTES,
    timeout_s: float = 60.0,
) -> float:
    """Seconds one raw NIXL READ of ``runs`` takes, descriptors built and checked,
    posted, waited (a blocking wait: nothing else runs meanwhile)."""
    start = time.perf_counter()
    endpoint.read(peer, runs, timeout_s, chunk_bytes=chunk_bytes)
    return time.perf_counter() - start


def pattern_words(first_word: int, count: int) -> np.ndarray:
    j = np.arange(first_word, first_word + count, dtype=np.uint64)
    return j * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)


def quantiles(samples: list[float] | np.ndarray, scale: float = 1.0, digits: int = 3) -> list:
    q = np.quantile(np.asarray(samples) * scale, [0.1, 0.5, 0.9])
    return [round(float(v), digits) for v in q]


# ---- serving process --------------------------------------------------------------------


def serve_main(ctrl: Any, env: dict, pool_bytes: int) -> None:
    os.environ.update(env)
    code = 1
    try:
        asyncio.run(_serve(ctrl, pool_bytes))
        code = 0
    except BaseException:
        ctrl.send((False, traceback.format_exc()))
    finally:
        os._exit(code)  # skip UCX finalizers, which can stall interpreter exit


async def _serve(ctrl: Any, pool_bytes: int) -> None:
    from kvstore.transfer.ucx import ucxx_module

    ucxx = ucxx_module()
    pool = np.empty(pool_bytes, dtype=np.uint8)
    pool.view(np.uint64)[:] = pattern_words(0, pool_bytes // 8)
    endpoint = rma.RmaEndpoint(rma.Region(pool.ctypes.data, pool_bytes))

    async def raw_handler(ep: Any) -> None:
        request = np.zeros(2, dtype=np.uint64)
        try:
            while True:
                await idle_recv(ep, request, RAW_REQUEST_TAG)
                with polled():
                    await ep.send(pool[: int(request[1])], tag=RAW_DATA_TAG)
        except Exception:  # the fetching process went away: done
            ep.abort()

    loop_progress()  # kvstore's progress on this loop (kvstore.transfer.progress), not ucxx's
    listener = ucxx.create_listener(raw_handler, port=0)
    ctrl.send((True, (endpoint.card().encode(), listener.port)))
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, ctrl.recv)
    while not stop.done():  # progress NIXL (a peer's first read connects through it)
        endpoint.progress()
        await asyncio.sleep(0.001)
    listener.close()


# ---- fetching process -------------------------------------------------------------------


class Fetching:
    """The fetching process's side: its pool, its NIXL endpoint, its ucxx endpoint."""

    def __init__(self, card: bytes, raw_ep: Any, pool_bytes: int):
        self.pool = np.empty(pool_bytes, dtype=np.uint8)
        self.base = self.pool.ctypes.data
        self.endpoint = rma.RmaEndpoint(rma.Region(self.base, pool_bytes))
        self.card = rma.PeerCard.decode(card)
        self.peer = self.endpoint.connect(self.card)
        self.raw_ep = raw_ep
        self.request = np.zeros(2, dtype=np.uint64)
        self.expected = np.empty(pool_bytes, dtype=np.uint8)  # the serving pool's bytes
        self.expected.view(np.uint64)[:] = pattern_words(0, pool_bytes // 8)
        self.verified = 0
        self.threads = len(os.sched_getaffinity(0))  # torch_copy's threads: every core
        torch.set_num_threads(self.threads)
        self.pool_t, self.expected_t = torch.from_numpy(self.pool), torch.from_numpy(self.expected)

    def scattered(self, slot: int, count: int, seed: int) -> tuple[rma.SlotRuns, np.ndarray]:
        """``count`` slot runs, random slots on both sides; and the local slot offsets."""
        rng = np.random.default_rng(seed)
        src = rng.permutation(count).astype(np.uint64) * np.uint64(slot)
        dst = rng.permutation(count).astype(np.uint64) * np.uint64(slot)
        runs = rma.SlotRuns.of(
            src + np.uint64(self.card.region.addr), dst + np.uint64(self.base), np.full(count, slot)
        )
        return runs, np.stack([src, dst], axis=1)

    def poison(self, nbytes: int) -> None:
        self.pool[:nbytes] = POISON

    def nixl_read(self, runs: rma.SlotRuns, chunk: int) -> float:
        return timed_read(self.endpoint, self.peer, runs, chunk)

    def check_slots(self, offsets: np.ndarray, slot: int) -> None:
        """Every fetched slot holds the serving pool's bytes at its remote offset."""
        count = len(offsets)
        got = self.pool[: count * slot].reshape(count, slot)
        order = np.argsort(offsets[:, 1])  # local slot k came from remote offsets[order[k], 0]
        source = (offsets[order, 0] // np.uint64(slot)).astype(np.int64)
        want = self.expected[: count * slot].reshape(count, slot)[source]
        if not np.array_equal(got, want):
            raise AssertionError(f"slot bytes differ ({slot} B slots)")
        self.verified += 1

    async def raw_one(self, nbytes: int) -> float:
        self.request[:] = (RAW_ONE, nbytes)
        start = time.perf_counter()
        with polled():
            recv = asyncio.ensure_future(self.raw_ep.recv(self.pool[:nbytes], tag=RAW_DATA_TAG))
            await asyncio.sleep(0)  # the receive is posted before the request goes
            await self.raw_ep.send(self.request, tag=RAW_REQUEST_TAG)
            await recv
        return time.perf_counter() - start

    def check_contiguous(self, nbytes: int) -> None:
        if not np.array_equal(self.pool[:nbytes], self.expected[:nbytes]):
            raise AssertionError("contiguous bytes differ")

    def memcpy(self, nbytes: int) -> float:
        start = time.perf_counter()
        np.copyto(self.pool[:nbytes], self.expected[:nbytes])
        return time.perf_counter() - start

    def torch_copy(self, nbytes: int) -> float:
        start = time.perf_counter()
        self.pool_t[:nbytes].copy_(self.expected_t[:nbytes])
        return time.perf_counter() - start

    def nixl_one(self, nbytes: int) -> float:
        """The first ``nbytes`` of the serving pool as ONE run into the fetching pool's."""
        return timed_read(
            self.endpoint, self.peer, one_run(self.card.region.addr, self.base, nbytes)
        )


async def measure_row(f: Fetching, slot: int, total: int, repeats: int, seed: int) -> dict:
    count = total // slot
    runs, offsets = f.scattered(slot, count, seed)
    contiguous = {"memcpy": f.memcpy, "torch_copy": f.torch_copy, "nixl_one": f.nixl_one}
    verified = 0

    async def op(name: str) -> float:
        nonlocal verified
        f.poison(total)
        if name == "raw_one":
            t = await f.raw_one(total)
            f.check_contiguous(total)
        elif name in contiguous:
            t = contiguous[name](total)
            f.check_contiguous(total)
        else:
            chunk = rma.DEFAULT_CHUNK_BYTES if name == "nixl_read" else total
            t = f.nixl_read(runs, chunk)
            f.check_slots(offsets, slot)
        verified += 1
        return t

    names = ["nixl_read", "nixl_1req", "raw_one", *CEILING_OPS]
    for name in names:  # warm-up
        await op(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        for name in rng.permutation(names):
            times[str(name)].append(await op(str(name)))
    nixl = np.asarray(times["nixl_read"])
    candidates = np.stack([np.asarray(times[n]) for n in CEILING_OPS])
    ceiling, won = candidates.min(axis=0), candidates.argmin(axis=0)
    return {
        "slot_bytes": slot,
        "slots": count,
        "total_bytes": total,
        "repeats": repeats,
        "ms_p10_p50_p90": {n: quantiles(t, 1e3) for n, t in times.items()},
        "gbps_p50": {n: round(total / float(np.median(t)) / 1e9, 3) for n, t in times.items()},
        "ceiling_ms_p10_p50_p90": quantiles(ceiling, 1e3),
        "ceiling_gbps_p50": round(total / float(np.median(ceiling)) / 1e9, 3),
        "ceiling_won": {n: int((won == i).sum()) for i, n in enumerate(CEILING_OPS)},
        "ratio_ceiling_p10_p50_p90": quantiles(ceiling / nixl),
        "ratio_raw_one_p10_p50_p90": quantiles(np.asarray(times["raw_one"]) / nixl),
        "ratio_memcpy_p10_p50_p90": quantiles(np.asarray(times["memcpy"]) / nixl),
        "ratio_1req_p10_p50_p90": quantiles(np.asarray(times["nixl_1req"]) / nixl),
        "verified_reads": f.verified,
        "verified_ops": verified,
    }


async def control_floor(f: Fetching, repeats: int) -> dict:
    """A one-slot read, SlotRuns to done, against a one-message ucxx round trip; the
    slot poisoned before and compared after every op (untimed)."""
    remote, local = f.card.region.addr, f.base
    times: dict[str, list[float]] = {"nixl_read_1slot": [], "raw_one_1slot": []}
    verified = 0
    for r in range(repeats + 5):
        first = r % 2 == 0
        for name in ("nixl_read_1slot", "raw_one_1slot")[:: 1 if first else -1]:
            f.poison(FLOOR_SLOT)
            if name == "raw_one_1slot":
                t = await f.raw_one(FLOOR_SLOT)
            else:
                start = time.perf_counter()
                f.endpoint.read(f.peer, one_run(remote, local, FLOOR_SLOT), 10.0)
                t = time.perf_counter() - start
            f.check_contiguous(FLOOR_SLOT)
            verified += 1
            if r >= 5:
                times[name].append(t)
    return {n: {"us_p10_p50_p90": quantiles(t, 1e6, 1)} for n, t in times.items()} | {
        "repeats": repeats,
        "verified_ops": verified,
    }


def prep_per_slot(f: Fetching, repeats: int) -> dict:
    """Host time to describe N runs (no posting): plan, NIXL descriptor lists, request."""
    agent, out = f.endpoint.agent, {}
    for count in PREP_COUNTS:
        count = min(count, f.endpoint.region.nbytes // FLOOR_SLOT)
        runs, _ = f.scattered(FLOOR_SLOT, count, count)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            rma.check_runs(runs, f.endpoint.region, f.peer.region)
            chunks = rma.plan_chunks(runs, rma.DEFAULT_CHUNK_BYTES, 0, 0)
            handles = [
                agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(c.local, "DRAM"),
                    agent.get_xfer_descs(c.remote, "DRAM"),
                    f.peer.name,
                )
                for c in chunks
            ]
            samples.append(time.perf_counter() - start)
            for h in handles:
                agent.release_xfer_handle(h)
        p50 = float(np.median(samples))
        out[str(count)] = {
            "ms_p50": round(p50 * 1e3, 4),
            "us_per_slot": round(p50 / count * 1e6, 4),
        }
    return out


async def _measure(ctrl: Any, args: dict) -> dict:
    from kvstore.transfer.ucx import ucxx_module

    ucxx = ucxx_module()
    ok, reply = ctrl.recv()
    if not ok:
        raise RuntimeError(f"serving process:\n{reply}")
    card, port = reply
    loop_progress()  # kvstore's progress on this loop, as the serving side
    raw_ep = await ucxx.create_endpoint("127.0.0.1", port)
    f = Fetching(card, raw_ep, args["pool_bytes"])
    rows = []
    for i, slot in enumerate(args["slot_sizes"]):
        row = await measure_row(f, slot, args["total"], args["repeats"], seed=i + 1)
        print_row(row)
        rows.append(row)
    floor = await control_floor(f, args["floor_repeats"])
    print("control floor", floor)
    prep = prep_per_slot(f, args["prep_repeats"])
    print("prep per slot", prep)
    return {
        "rows": rows,
        "control_floor": floor,
        "prep_per_slot": prep,
        "transports": sorted(ucxx.get_active_transports()),
        "torch_threads": f.threads,
    }


def fetch_main(result: Any, ctrl: Any, env: dict, args: dict) -> None:
    os.environ.update(env)
    try:
        out = (True, asyncio.run(_measure(ctrl, args)))
    except BaseException:
        out = (False, traceback.format_exc())
    try:
        ctrl.send("stop")
    except OSError:
        pass  # the serving process is gone already
    result.send(out)
    os._exit(0)  # skip UCX finalizers, which can stall interpreter exit


def print_row(row: dict) -> None:
    ms, gbps = row["ms_p10_p50_p90"], row["gbps_p50"]
    print(
        f"{row['slot_bytes'] // KIB:>5} KiB x {row['slots']:>5}: "
        + "  ".join(f"{n} {ms[n][1]:.2f} ms ({gbps[n]:.2f} GB/s)" for n in ms)
        + f"  raw/nixl {row['ratio_raw_one_p10_p50_p90']}"
        + f"  ceiling/nixl {row['ratio_ceiling_p10_p50_p90']} (won: {row['ceiling_won']})",
        flush=True,
    )


SWEEPS = {
    "default": {},  # the project's UCX defaults: ucxx between same-host peers over tcp
    "mm": {"UCX_MM_ERROR_HANDLING": "y"},  # ucxx may use shared memory (README's trade-off)
}


def run_sweep(name: str, opts: dict, timeout_s: float) -> dict:
    """Both processes under one UCX environment; the fetching one's measurements."""
    env = ucx_env("default") | SWEEPS[name]
    print(f"== sweep {name}: {env}", flush=True)
    serve_ctrl, fetch_ctrl = CTX.Pipe()
    result_recv, result_send = CTX.Pipe(duplex=False)
    server = CTX.Process(target=serve_main, args=(serve_ctrl, env, opts["pool_bytes"]))
    fetcher = CTX.Process(target=fetch_main, args=(result_send, fetch_ctrl, env, opts))
    server.start()
    fetcher.start()
    try:
        if not result_recv.poll(timeout_s):
            raise TimeoutError(f"no result within {timeout_s} s")
        ok, out = result_recv.recv()
    finally:
        for proc in (fetcher, server):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if not ok:
        raise RuntimeError(f"fetching process:\n{out}")
    return {"sweep": name, "env": env, **out}


def run(args: argparse.Namespace) -> dict:
    total = args.total_mib * MIB
    opts = {
        "slot_sizes": list(SLOT_SIZES),
        "total": total,
        "pool_bytes": total,
        "repeats": args.repeats or (5 if args.quick else 11),
        "floor_repeats": 100 if args.quick else 400,
        "prep_repeats": 9 if args.quick else 31,
    }
    return {
        "benchmark": "one-sided NIXL READ vs raw two-sided ucxx, host memory, 2 processes",
        "note": (
            "per repeat ops interleaved in random order; ratio = other op time / nixl_read "
            "time (ratio_raw_one > 1: NIXL faster than one raw ucxx message); ceiling = per "
            "repeat the fastest of memcpy (numpy, 1 thread), torch_copy (all cores) and "
            "nixl_one (ONE NIXL READ run), ceiling_won says which; every byte of every op "
            "verified; GB = 1e9 bytes; one sweep per UCX environment"
        ),
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "nixl_version": rma.nixl_version(),
        "sweeps": [run_sweep(name, opts, args.timeout_s) for name in args.sweeps.split(",")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--sweeps", default="default,mm", help=f"of {', '.join(SWEEPS)}")
    args = parser.parse_args()
    ok = rma.available()
    if not ok:
        raise SystemExit(f"one-sided reads unavailable: {ok.reason}")
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
