"""Run a real vLLM engine (CPU build) over token-id prompts and write what it produced.

    python -m kvstore.testing.vllm_engine SPEC.json OUT.json

Tests and ``bench/vllm_ttft.py`` start one engine per process with this, so
every engine is fresh. The spec (JSON):

    model        path of a checkpoint (``kvstore.testing.tiny_model``)
    prompts      {"name": [token ids]}
    phases       list of steps, run in order:
                   {"run": [names], "repeat": 1}   greedy generation, results kept
                   {"reset": true}                 drop vLLM's own prefix cache
                   {"until_cached": name, "min_tokens": n, "timeout": s}
                                                   reset and run the prompt until vLLM
                                                   reports n cached tokens (a store that
                                                   just came back is found within the
                                                   client's reconnect backoff); keeps the
                                                   last run, with its ``attempts``
                   {"wait_file": path}             block until the file exists
                   {"touch": path}                 create a file (a signal to the test)
    connector    null, or kv_connector_extra_config of KVStoreConnector
    connector_by_name   find the connector through kvstore's vLLM plugin entry
                 point instead of kv_connector_module_path
    tp, block_size, max_tokens, dtype, max_model_len   engine settings
    one_process  run the engine core and its worker in this process (tp 1 only):
                 two fewer processes importing vLLM, about 30 s less a start on
                 two cores; the default, vLLM's own three processes, is what a
                 deployment runs

OUT gets one record per run prompt: tokens, logprobs (of the chosen tokens),
num_cached_tokens (vLLM's count of prefix tokens it did not compute) and the
wall time of the generate call (``wall_ms``; with ``max_tokens`` 1 it is the
time to the first token).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def engine(spec: dict):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    one_process = spec.get("one_process", False)
    if one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(spec["tp"]))))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("connector") is not None:
        by_name = spec.get("connector_by_name", False)  # the vllm.general_plugins entry point
        kv = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path=None if by_name else "kvstore.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec["connector"],
        )
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "bfloat16"),
        block_size=spec.get("block_size", 32),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        tensor_parallel_size=spec.get("tp", 1),
        distributed_executor_backend="uni" if one_process else None,
        kv_transfer_config=kv,
        seed=0,
    )


def generate(llm, prompt: list[int], max_tokens: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall_ms = (time.perf_counter() - start) * 1000
    completion = out.outputs[0]
    logprobs = [lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs)]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens or 0,
        "wall_ms": wall_ms,
    }


def until_cached(llm, spec: dict, phase: dict) -> dict:
    name, deadline = phase["until_cached"], time.monotonic() + phase.get("timeout", 30)
    attempts = 0
    while True:
        llm.reset_prefix_cache()
        record = generate(llm, spec["prompts"][name], spec.get("max_tokens", 8))
        attempts += 1
        if record["num_cached_tokens"] >= phase["min_tokens"] or time.monotonic() > deadline:
            return {"prompt": name, "attempts": attempts, **record}
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    llm = engine(spec)
    results = []
    for phase in spec["phases"]:
        if "run" in phase:
            for _ in range(phase.get("repeat", 1)):
                for name in phase["run"]:
                    record = generate(llm, spec["prompts"][name], spec.get("max_tokens", 8))
                    results.append({"prompt": name, **record})
        elif phase.get("reset"):
            llm.reset_prefix_cache()
        elif "until_cached" in phase:
            results.append(until_cached(llm, spec, phase))
        elif "wait_file" in phase:
            deadline = time.monotonic() + phase.get("timeout", 120)
            while not Path(phase["wait_file"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{phase['wait_file']} never appeared")
                time.sleep(0.05)
        elif "touch" in phase:
            Path(phase["touch"]).touch()
        Path(argv[1]).write_text(json.dumps(results))
    Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
