"""A stand-in inference worker rank, for the demo, tests and benchmarks.

It owns a paged KV cache (shared memory on the host, or a CUDA tensor),
registers it with a store server, and obeys commands from its parent over a
multiprocessing pipe (local IPC between our own processes): fill blocks with
deterministic random KV, save, load, and report checksums of blocks so the
parent can compare bytes across processes without shipping them.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import traceback
from dataclasses import dataclass

import torch

from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "uint8": torch.uint8,
}


@dataclass
class WorkerSpec:
    address: str
    instance_id: str
    client_namespace: str
    tp_rank: int
    tp_size: int
    layers: int = 4
    extra_layers: int = 0  # MTP: one more layer, another namespace
    heads: int = 8  # in total; each rank holds heads // tp_size
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 64
    dtype: str = "float16"
    kind: str = "kv_first"
    kv_layout: str = "NHD"
    device: str = "cpu"

    def layer_names(self) -> list[str]:
        names = [f"model.layers.{i}.self_attn" for i in range(self.layers)]
        return names + [f"mtp.layers.{i}.self_attn" for i in range(self.extra_layers)]


class WorkerRank:
    """The in-process state of one rank."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.client = StoreClient(spec.address)
        dtype = DTYPES[spec.dtype]
        heads = spec.heads // spec.tp_size
        self.layers: list[KVLayer] = []
        for name in spec.layer_names():
            if spec.device == "cpu":
                shm = kv_cache_shm(
                    spec.kind,
                    spec.num_blocks,
                    spec.block_size,
                    heads,
                    spec.head_dim,
                    dtype,
                    spec.kv_layout,
                )
                self.layers.append(KVLayer(name, shm.tensor, spec.kind, spec.kv_layout, shm))
            else:  # "cuda" spreads ranks over the visible GPUs
                device = (
                    f"cuda:{spec.tp_rank % torch.cuda.device_count()}"
                    if spec.device == "cuda"
                    else spec.device
                )
                t = torch.zeros(_shape(spec, heads), dtype=dtype, device=device)
                self.layers.append(KVLayer(name, t, spec.kind, spec.kv_layout))
        self.session = self.client.register(
            spec.instance_id,
            spec.client_namespace,
            self.layers,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            block_size=spec.block_size,
        )

    def blocks_of(self, layer: KVLayer, block_id: int) -> list[torch.Tensor]:
        t = layer.tensor
        return [t[0, block_id], t[1, block_id]] if layer.kind == "kv_first" else [t[block_id]]

    def fill(self, seeds: list[tuple[int, int]]) -> None:
        """Fill block ids with random KV determined by (seed, layer, rank) only."""
        for seed, block_id in seeds:
            for li, layer in enumerate(self.layers):
                g = torch.Generator().manual_seed((seed * 1_000_003 + li) * 64 + self.spec.tp_rank)
                for part in self.blocks_of(layer, block_id):
                    raw = part.view(torch.uint8)
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def digest(self, block_ids: list[int]) -> list[str]:
        """One checksum per block over every layer's bytes of that block."""
        out = []
        for block_id in block_ids:
            h = hashlib.blake2b(digest_size=16)
            for layer in self.layers:
                for part in self.blocks_of(layer, block_id):
                    h.update(part.contiguous().cpu().view(torch.uint8).numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def clear(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            for layer in self.layers:
                for part in self.blocks_of(layer, block_id):
                    part.zero_()

    def close(self) -> None:
        self.session.close()
        self.client.close()
        for layer in self.layers:
            if layer.shm is not None:
                layer.shm.close()


def _shape(spec: WorkerSpec, heads: int) -> tuple[int, ...]:
    inner = (
        (spec.block_size, heads, spec.head_dim)
        if spec.kv_layout == "NHD"
        else (heads, spec.block_size, spec.head_dim)
    )
    return {
        "kv_first": (2, spec.num_blocks, *inner),
        "blocks_first": (spec.num_blocks, 2, *inner),
        "mla": (spec.num_blocks, spec.block_size, spec.head_dim),
    }[spec.kind]


def _serve(spec: WorkerSpec, conn) -> None:
    try:
        rank = WorkerRank(spec)
    except Exception as exc:  # report the refusal to the parent, then exit
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", rank.session.session))
    while True:
        op, arg = conn.recv()
        try:
            if op == "close":
                rank.close()
                conn.send(("ok", None))
                return
            result = _dispatch(rank, op, arg)
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _dispatch(rank: WorkerRank, op: str, arg):
    if op == "wait_sealed":
        seal = rank.session.wait_sealed(arg)
        return {
            "fingerprint": seal.fingerprint,
            "final_namespace": seal.final_namespace,
            "layer_ids": seal.layer_ids,
        }
    if op == "fill":
        return rank.fill(arg)
    if op == "save":
        r = rank.session.save(arg)
        return {"written": r.written, "skipped": r.skipped, "sealed": r.sealed, "bytes": r.bytes}
    if op == "load":
        return rank.session.load(arg).bytes
    if op == "digest":
        return rank.digest(arg)
    if op == "clear":
        return rank.clear(arg)
    if op == "state":
        return {"state": rank.session.state, "ranks": rank.session.ranks_registered}
    raise ValueError(f"unknown worker command {op!r}")


class WorkerProcess:
    """Parent-side handle of a worker rank running in its own process."""

    def __init__(self, spec: WorkerSpec, timeout: float = 60.0):
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.timeout = timeout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(spec, child),
            daemon=True,
            name=f"kvstore-worker-{spec.instance_id}-{spec.tp_rank}",
        )
        self.proc.start()
        self.session = self._reply()

    def _reply(self):
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"worker {self.proc.name} did not answer in {self.timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, op: str, arg=None):
        self.conn.send((op, arg))
        return self._reply()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close")
            except (RuntimeError, TimeoutError, OSError, EOFError):
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)


class WorkerGroup:
    """The ranks of one instance, each in its own process, driven together."""

    def __init__(
        self,
        address: str,
        instance_id: str,
        tp_size: int = 2,
        client_namespace: str = "llama",
        seal_timeout: float = 60.0,
        **spec,
    ):
        self.workers = [
            WorkerProcess(WorkerSpec(address, instance_id, client_namespace, rank, tp_size, **spec))
            for rank in range(tp_size)
        ]
        self.seal = self.workers[0].call("wait_sealed", seal_timeout)
        self.namespace: str = self.seal["final_namespace"]

    def each(self, op: str, arg=None) -> list:
        """Send one command to every rank at once, then gather the replies."""
        for w in self.workers:
            w.conn.send((op, arg))
        return [w._reply() for w in self.workers]

    def __getitem__(self, rank: int) -> WorkerProcess:
        return self.workers[rank]

    def close(self) -> None:
        for w in self.workers:
            w.close()
