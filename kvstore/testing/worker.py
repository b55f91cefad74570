"""A stand-in inference worker rank, for the demo, tests and benchmarks.

It owns a paged KV cache (shared memory on the host, or a CUDA tensor),
registers it with a store server through the product client, and obeys
commands from its parent over a multiprocessing pipe (local IPC between our
own processes): fill blocks with deterministic random KV, save, load, and
report checksums of blocks so the parent can compare bytes across processes
without shipping them.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import traceback
from dataclasses import dataclass

import torch

from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.wire.kv_layout import LayoutKind

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
    kv_dtype: str = ""  # the KV's format where dtype holds raw bytes (KVLayer.kv_dtype)
    kind: str = "kv_first"
    kv_layout: str = "NHD"
    device: str = "cpu"

    def layer_names(self) -> list[str]:
        names = [f"model.layers.{i}.self_attn" for i in range(self.layers)]
        return names + [f"mtp.layers.{i}.self_attn" for i in range(self.extra_layers)]

    def shape(self) -> tuple[int, ...]:
        """The KV tensor shape of one layer of this rank."""
        heads = self.heads // self.tp_size
        return LayoutKind(self.kind).shape(
            self.num_blocks, self.block_size, heads, self.head_dim, self.kv_layout
        )

    def torch_device(self) -> str:
        """The torch device of this rank; "cuda" spreads ranks over the visible GPUs."""
        if self.device == "cuda":
            return f"cuda:{self.tp_rank % torch.cuda.device_count()}"
        return self.device


class WorkerRank:
    """The in-process state of one rank."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.client = StoreClient(spec.address)
        self.layers = [self._make_layer(name) for name in spec.layer_names()]
        self.session = self.client.register(
            spec.instance_id,
            spec.client_namespace,
            self.layers,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            block_size=spec.block_size,
        )

    def _make_layer(self, name: str) -> KVLayer:
        spec, dtype = self.spec, DTYPES[self.spec.dtype]
        if spec.device == "cpu":
            heads = spec.heads // spec.tp_size
            shm = kv_cache_shm(
                spec.kind,
                spec.num_blocks,
                spec.block_size,
                heads,
                spec.head_dim,
                dtype,
                spec.kv_layout,
            )
            return KVLayer(name, shm.tensor, spec.kind, spec.kv_layout, shm, kv_dtype=spec.kv_dtype)
        tensor = torch.zeros(spec.shape(), dtype=dtype, device=spec.torch_device())
        return KVLayer(name, tensor, spec.kind, spec.kv_layout, kv_dtype=spec.kv_dtype)

    def blocks_of(self, layer: KVLayer, block_id: int) -> list[torch.Tensor]:
        t = layer.tensor
        if layer.kind is LayoutKind.KV_FIRST:
            return [t[0, block_id], t[1, block_id]]
        return [t[block_id]]

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

    def wait_sealed(self, timeout: float) -> dict:
        seal = self.session.wait_sealed(timeout)
        return {
            "fingerprint": seal.fingerprint,
            "final_namespace": seal.final_namespace,
            "layer_ids": seal.layer_ids,
        }

    def save(self, blocks: list[tuple[int, int]]) -> dict:
        r = self.session.save(blocks)
        return {"written": r.written, "skipped": r.skipped, "sealed": r.sealed, "bytes": r.bytes}

    def load(self, blocks: list[tuple[int, int]]) -> int:
        return self.session.load(blocks).bytes

    def state(self, _arg=None) -> dict:
        return {"state": self.session.state, "ranks": self.session.ranks_registered}

    def close(self) -> None:
        self.session.close()
        self.client.close()
        for layer in self.layers:
            if layer.shm is not None:
                layer.shm.close()


# The commands a parent may send: name -> WorkerRank method taking one argument.
COMMANDS = {
    "wait_sealed": WorkerRank.wait_sealed,
    "fill": WorkerRank.fill,
    "save": WorkerRank.save,
    "load": WorkerRank.load,
    "digest": WorkerRank.digest,
    "clear": WorkerRank.clear,
    "state": WorkerRank.state,
}


def _serve(spec: WorkerSpec, conn) -> None:
    try:
        rank = WorkerRank(spec)
    except Exception as exc:  # noqa: BLE001 - any refusal goes to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", rank.session.session))
    op = None
    while op != "close":
        op, arg = conn.recv()
        try:
            conn.send(("ok", _run(rank, op, arg)))
        except Exception as exc:  # noqa: BLE001 - any failure goes to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(rank: WorkerRank, op: str, arg):
    if op == "close":
        return rank.close()
    command = COMMANDS.get(op)
    if command is None:
        raise ValueError(f"unknown worker command {op!r}")
    return command(rank, arg)


class WorkerProcess:
    """Parent-side handle of a worker rank running in its own process."""

    def __init__(self, spec: WorkerSpec, timeout: float = 60.0, *, wait: bool = True):
        """Start the rank's process; with ``wait``, return once it has registered
        (else :meth:`start_all` reads its answer)."""
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
        self.session = self.reply() if wait else None

    @classmethod
    def start_all(cls, specs: list[WorkerSpec], timeout: float = 60.0) -> list[WorkerProcess]:
        """Several ranks, their processes started at once (their imports overlap,
        so they register in no set order), each registered when this returns."""
        workers: list[WorkerProcess] = []
        try:
            for spec in specs:
                workers.append(cls(spec, timeout, wait=False))
            for w in workers:
                w.session = w.reply()
        except BaseException:
            for w in workers:
                w.kill()
            raise
        return workers

    def send(self, op: str, arg=None) -> None:
        """Send one command without waiting (pair it with :meth:`reply`)."""
        self.conn.send((op, arg))

    def reply(self):
        """The answer to the oldest unanswered command; RuntimeError if it failed."""
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"worker {self.proc.name} did not answer in {self.timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, op: str, arg=None):
        self.send(op, arg)
        return self.reply()

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
        self.workers = WorkerProcess.start_all(
            [
                WorkerSpec(address, instance_id, client_namespace, rank, tp_size, **spec)
                for rank in range(tp_size)
            ]
        )
        try:
            self.seal = self.workers[0].call("wait_sealed", seal_timeout)
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        self.namespace: str = self.seal["final_namespace"]

    def each(self, op: str, arg=None) -> list:
        """Send one command to every rank at once, then gather the replies."""
        for w in self.workers:
            w.send(op, arg)
        return [w.reply() for w in self.workers]

    def __getitem__(self, rank: int) -> WorkerProcess:
        return self.workers[rank]

    def close(self) -> None:
        for w in self.workers:
            w.close()
