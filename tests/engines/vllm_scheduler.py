"""vLLM's real scheduler (Scheduler or AsyncScheduler, KVStoreConnector built by
vLLM's factory in its scheduler role) driving a real WorkerSide against a real
store. Only the model's forward is stood in for, by a causal chain over the
paged cache:

    kv[p] = (kv[p-1] * 31 + token[p] + 1) mod 30000      (kv[p-1] read from the cache)

so, as with attention, a position's KV depends on the KV the cache holds for its
prefix: KV computed on top of a block whose load failed (stale bytes) differs.

``async_sched=True`` runs vLLM's batch queue (async scheduling, the GPU default,
or pipeline parallelism): step N+1 is scheduled before update_from_output(step N).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvstore.client.store_client import RankSpec, StoreClient
from kvstore.integrations.vllm.connector import plans_in_flight
from kvstore.integrations.vllm.identity import hash_format, none_hash_seed
from kvstore.integrations.vllm.worker import (
    SharedMemoryKVPool,
    WorkerSide,
    paged_layers,
)

BS, NB, HEADS, C = 16, 64, 2, 128
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NS = "batch-queue"
MOD = 30000


def tiny_model() -> str:
    path = Path(tempfile.gettempdir()) / "kvstore_sched_tiny_llama"
    if not (path / "config.json").exists():
        from kvstore.testing.tiny_model import write_tiny_llama

        write_tiny_llama(path)
    return str(path)


class Harness:
    def __init__(self, address: str, async_sched: bool, budget: int = 64):
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        args = EngineArgs(
            model=tiny_model(),
            skip_tokenizer_init=True,
            block_size=BS,
            max_model_len=512,
            max_num_batched_tokens=budget,
            max_num_seqs=8,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStoreConnector",
                kv_connector_module_path="kvstore.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"address": address, "namespace": NS},
            ),
        )
        cfg = args.create_engine_config()
        cfg.cache_config.num_gpu_blocks = NB
        self.cfg = cfg
        kv_cfg = KVCacheConfig(
            num_blocks=NB,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    LAYERS,
                    FullAttentionSpec(
                        block_size=BS, num_kv_heads=HEADS, head_size=64, dtype=torch.bfloat16
                    ),
                )
            ],
        )
        algo = cfg.cache_config.prefix_caching_hash_algo
        fn = get_hash_fn_by_name(algo)
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(BS, fn)
        cls = AsyncScheduler if async_sched else Scheduler
        self.sched = cls(
            vllm_config=cfg,
            kv_cache_config=kv_cfg,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BS,
            hash_block_size=BS,
        )
        self.async_sched = async_sched
        self.connector = self.sched.connector
        # ---- the worker rank: vLLM's KV cache in shared memory, registered
        self.pool = SharedMemoryKVPool()
        with self.pool:
            buf = torch.zeros(len(LAYERS) * NB * HEADS * BS * C * 2, dtype=torch.int8)
        per = NB * HEADS * BS * C * 2
        self.views = {
            n: buf[i * per : (i + 1) * per].view(torch.bfloat16).view(NB, HEADS, BS, C)
            for i, n in enumerate(LAYERS)
        }
        s = self.connector.settings
        ident = RankSpec(
            s.instance_id,
            NS,
            hash_format(algo, none_hash_seed(algo, s.instance_id)),
            BS,
            0,
            1,
            0,
            1,
        )
        cfg.scheduler_config.async_scheduling = async_sched
        self.worker = WorkerSide(
            StoreClient(address),
            ident,
            seal_timeout=10,
            retry_s=0.0,
            plans_in_flight=plans_in_flight(cfg),
        )
        self.worker.register(paged_layers(self.views, BS, "LBHNC", self.pool))
        assert self.worker.wait_ready(10)
        self.tables: dict[str, list[int]] = {}
        self.fail_loads = 0  # the next plans with loads whose Load the store refuses
        self.then_add: tuple[str, list[int]] | None = None  # added after a plan with loads
        self.pending = None
        self.step_no = 0
        self.log: list[str] = []

    # ------------------------------------------------------------ requests
    def add(self, rid: str, tokens: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(temperature=0.0, max_tokens=1)
        req = Request(rid, list(tokens), sp, None, block_hasher=self.hasher)
        self.sched.add_request(req)

    # ------------------------------------------------------------ KV cells
    def cell(self, block: int, slot: int) -> int:
        v = self.views[LAYERS[0]].view(torch.int16)
        return int(v[block, 0, slot, 0])

    def write(self, block: int, slot: int, value: int) -> None:
        for v in self.views.values():
            v.view(torch.int16)[block, :, slot, :] = value

    # ------------------------------------------------------------ one worker step
    def execute(self, out):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.step_no += 1
        plan = out.kv_connector_metadata.plan
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[0]) if ids else []
            elif ids:
                self.tables.setdefault(rid, []).extend(ids[0])
        # start_load_kv
        if self.fail_loads and plan.loads:
            self.fail_loads -= 1
            saved = self.worker.rpc_timeout
            self.worker.rpc_timeout = 0.03  # the store refuses: cannot finish in time
            self.worker.load(plan.loads, plan.step)
            self.worker.rpc_timeout = saved
        else:
            self.worker.load(plan.loads, plan.step)
        # forward: the causal chain over the paged cache
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests.get(rid)
            toks = list(req.all_token_ids) if req is not None else []
            table = self.tables[rid]
            c = computed[rid]
            for p in range(c, c + n):
                prev = 7 if p == 0 else self.cell(table[(p - 1) // BS], (p - 1) % BS)
                tok = toks[p] if p < len(toks) else 0
                self.write(table[p // BS], p % BS, (prev * 31 + tok + 1) % MOD)
            done = req is not None and c + n >= req.num_prompt_tokens
            sampled[rid] = [5] if done else []
        # wait_for_save
        self.worker.save(plan.saves, plan.step)
        invalid = self.worker.take_load_errors()
        self.log.append(
            f"step {self.step_no}: plan.step={plan.step} loads={[p.block_id for p in plan.loads]}"
            f" saves={[p.block_id for p in plan.saves]} invalid={sorted(invalid)}"
            f" sched={dict(out.num_scheduled_tokens)}"
        )
        if self.then_add is not None and plan.loads:  # scheduled, and loaded, in the next plan
            self.add(*self.then_add)
            self.then_add = None
        rids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[sampled[r] for r in rids],
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
        )

    def run(self, max_steps: int = 100) -> None:
        """Until every request is done; the batch queue of depth 2 when async."""
        for _ in range(max_steps):
            if not self.sched.has_requests() and self.pending is None:
                return
            out = self.sched.schedule()
            res = self.execute(out)
            if self.async_sched:
                if self.pending is not None:
                    self.sched.update_from_output(*self.pending)
                self.pending = (out, res)
                if not self.sched.has_requests():
                    self.sched.update_from_output(*self.pending)
                    self.pending = None
            else:
                self.sched.update_from_output(out, res)
        raise AssertionError("did not finish")

    def reset_local_cache(self) -> None:
        assert self.sched.reset_prefix_cache()

    def close(self) -> None:
        self.worker.close([self.pool])


def chain(tokens: list[int]) -> list[int]:
    """The correct KV of every position of ``tokens``."""
    out, prev = [], 7
    for t in tokens:
        prev = (prev * 31 + t + 1) % MOD
        out.append(prev)
    return out
