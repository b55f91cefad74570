"""``kvstore demo``: the whole save / query / load cycle with real processes.

1. start a store server process on a free loopback port;
2. instance A: two TP worker processes with KV caches in shared memory (or on
   the GPU), fill blocks for prompts that share a long prefix, save them;
3. instance B: fresh processes, same layout: query the longest prefix, load it
   into other block ids, compare every byte with A's (by checksum);
4. instance C: the same model with MTP on (one extra layer) seals in another
   namespace and gets no hits;
5. print a table of namespaces, hits, bytes moved and GB/s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.client.store_client import StoreClient
from kvstore.testing.worker import WorkerGroup
from kvstore.wire.errors import KVError
from kvstore.wire.hashing import block_hashes

log = logging.getLogger("kvstore.demo")


@dataclass
class Row:
    instance: str
    namespace: str
    step: str
    blocks: int
    hits: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def free_port() -> int:
    return free_ports(1)[0]


FIRST_PICKED_PORT = 10000


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (all held until all are picked).

    Picked below the kernel's ephemeral range: a port from ``bind(0)`` lies in
    it, and so may be taken, before the caller binds it, by any outgoing
    connection or by UCX's tcp transport (which listens on ephemeral ports)."""
    low = _ephemeral_start()
    rng = random.SystemRandom()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            port = rng.randrange(FIRST_PICKED_PORT, low)
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: another pick
                continue
            ports.append(port)
        return ports


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where
    unreadable; past every port where that range starts too low to leave room)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    if low <= FIRST_PICKED_PORT + 1000:  # a host that made almost every port ephemeral
        return 65536
    return low


class ServerDidNotStart(RuntimeError):
    """The demo's store server exited (it logged why) or did not serve in time."""


def start_server(
    port: int, device: str, pool_size: int, *extra: str, log_level: str = "error"
) -> subprocess.Popen:
    """``kvstore serve`` on ``port`` (no router, no peer transfer), ``extra`` flags added;
    returns once it serves, else ServerDidNotStart (the process is gone then)."""
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "serve",
        "--port",
        str(port),
        "--device",
        device,
        "--pool-size",
        str(pool_size),
        "--no-router",
        "--no-transfer",
        "--log-level",
        log_level,
        *extra,
    ]
    proc = subprocess.Popen(cmd)
    client = StoreClient(f"127.0.0.1:{port}", timeout=2)
    try:
        if _wait_serving(proc, client, deadline=time.monotonic() + 60):
            return proc
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        client.close()
    proc.kill()
    proc.wait()
    raise ServerDidNotStart("the store server did not come up within 60 s")


def _wait_serving(proc: subprocess.Popen, client: StoreClient, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerDidNotStart(f"the store server exited with code {proc.returncode}")
        try:
            client.stats()
            return True
        except KVError:  # not listening yet
            time.sleep(0.2)
    return False


def make_prompts(args, rng: np.random.Generator) -> list[list[int]]:
    prefix = rng.integers(0, 128_000, args.prefix_tokens).tolist()
    return [
        prefix + rng.integers(0, 128_000, args.suffix_tokens).tolist() for _ in range(args.prompts)
    ]


@dataclass
class Workload:
    """The demo's prompts as block hashes, and where each unique block lives in a KV cache."""

    per_prompt: list[list[int]]
    unique: list[int]
    slot_of: dict[int, int]

    @property
    def total(self) -> int:
        return sum(map(len, self.per_prompt))


def make_workload(args) -> Workload:
    rng = np.random.default_rng(int(os.environ.get("KVSTORE_DEMO_SEED", "0")))
    per_prompt = [block_hashes(p, args.block_size) for p in make_prompts(args, rng)]
    unique = list(dict.fromkeys(h for hs in per_prompt for h in hs))
    return Workload(per_prompt, unique, {h: i for i, h in enumerate(unique)})


def start_instance(
    name: str, address: str, args, device: str, extra_layers: int = 0, num_blocks: int = 0
) -> WorkerGroup:
    """Two TP worker processes that form one sealed instance."""
    return WorkerGroup(
        address,
        name,
        2,
        "demo-llama",
        layers=args.layers,
        extra_layers=extra_layers,
        heads=args.heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        num_blocks=num_blocks,
        device=device,  # cpu; cuda (ranks spread over the GPUs); cuda:N (both on GPU N)
    )


def run_demo(args) -> int:
    """The demo; 0 when every loaded byte matched, 1 when not, 2 for flags the
    demo or its server refused, 130 / 143 when interrupted (SIGINT / SIGTERM):
    the workers and the server are stopped on every way out."""
    problem = _problem(args)
    if problem:
        print(f"kvstore demo: {problem}", file=sys.stderr)
        return 2
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    port = free_port()
    server: subprocess.Popen | None = None
    client: StoreClient | None = None
    instances: list[WorkerGroup] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server = start_server(port, device, args.pool_size, log_level=args.log_level)
        client = StoreClient(f"127.0.0.1:{port}")
        rows, ok = _cycle(args, client, device, instances)
    except ServerDidNotStart as exc:
        print(f"kvstore demo: {exc} (its log is above)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstore demo: interrupted; workers and server stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(server, client, instances)
    print_table(rows, device, args)
    print("bytes loaded into the fresh instance match the saved ones:", "yes" if ok else "NO")
    return 0 if ok else 1


def _problem(args) -> str:
    """What is wrong with the demo's flags ("" when nothing)."""
    if args.heads % 2:
        return f"--heads {args.heads}: the two TP ranks split the heads, so it must be even"
    if args.prefix_tokens < args.block_size:
        return (
            f"--prefix-tokens {args.prefix_tokens} is less than one block "
            f"(--block-size {args.block_size}): there would be nothing to share"
        )
    return ""


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _stop(
    server: subprocess.Popen | None, client: StoreClient | None, instances: list[WorkerGroup]
) -> None:
    """Close the client, the workers, then the server (SIGTERM, then SIGKILL after 30 s)."""
    if client is not None:
        client.close()
    for inst in instances:
        inst.close()
    if server is not None:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _cycle(
    args, client: StoreClient, device: str, instances: list[WorkerGroup]
) -> tuple[list[Row], bool]:
    """Steps 2-4 of the module docstring; ``instances`` collects what to close."""
    work = make_workload(args)
    num_blocks = 2 * len(work.unique)
    address = client.address

    a = start_instance("demo-a", address, args, device, num_blocks=num_blocks)
    instances.append(a)
    save_row, saved = _save(a, work)

    b = start_instance("demo-b", address, args, device, num_blocks=num_blocks)
    instances.append(b)
    load_row, loaded = _load(b, work, client)
    ok = b.namespace == a.namespace and loaded == saved and load_row.hits == work.total

    c = start_instance("demo-c-mtp", address, args, device, extra_layers=1, num_blocks=num_blocks)
    instances.append(c)
    misses = sum(client.query(c.namespace, hs).prefix_blocks for hs in work.per_prompt)
    query_row = Row("C (MTP on)", c.namespace, "query", work.total, misses, 0, 0.0)
    ok = ok and misses == 0 and c.namespace != a.namespace
    return [save_row, load_row, query_row], ok


def _save(a: WorkerGroup, work: Workload) -> tuple[Row, list]:
    """Instance A fills every unique block, saves each prompt, returns the blocks' digests."""
    slot_of = work.slot_of
    a.each("fill", [(h & 0x7FFFFFFF, slot_of[h]) for h in work.unique])
    t0, moved = time.perf_counter(), 0
    for hs in work.per_prompt:
        moved += sum(r["bytes"] for r in a.each("save", [(h, slot_of[h]) for h in hs]))
    row = Row("A", a.namespace, "save", len(work.unique), 0, moved, time.perf_counter() - t0)
    return row, a.each("digest", [slot_of[h] for h in work.unique])


def _load(b: WorkerGroup, work: Workload, client: StoreClient) -> tuple[Row, list]:
    """Instance B loads each prompt's stored prefix into other block ids; returns digests."""
    slot_of, offset = work.slot_of, len(work.unique)
    hits = moved = 0
    t0 = time.perf_counter()
    for hs in work.per_prompt:
        reply = client.query(b.namespace, hs, lease=True)
        hits += reply.prefix_blocks
        target = [(h, offset + slot_of[h]) for h in hs[: reply.prefix_blocks]]
        moved += sum(b.each("load", target))
        client.release(reply.lease_id)
    row = Row("B", b.namespace, "load", work.total, hits, moved, time.perf_counter() - t0)
    return row, b.each("digest", [offset + slot_of[h] for h in work.unique])


def print_table(rows: list[Row], device: str, args) -> None:
    print(
        f"\nkvstore demo: {args.layers} layers, {args.heads} KV heads x {args.head_dim}, "
        f"{args.block_size} tokens/block, fp16, TP 2, device {device}"
    )
    header = (
        f"{'instance':<12} {'namespace':<36} {'step':<6} {'blocks':>6} {'hits':>6} "
        f"{'MiB moved':>10} {'GB/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.instance:<12} {r.namespace:<36} {r.step:<6} {r.blocks:>6} {r.hits:>6} "
            f"{r.nbytes / 2**20:>10.1f} {r.gbps:>7.2f}"
        )
    print()


if __name__ == "__main__":  # ``python -m kvstore.demo``: as ``kvstore demo``
    from kvstore.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
