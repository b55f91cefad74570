"""Harness for the demo, tests and benches; no product code imports it except ``kvstore demo``.

- ``store.py``: the store's core built in one line, in-process (``make_store``).
- ``worker.py``: a stand-in inference worker rank in its own process.
- ``raw_client.py``: requests a well-behaved client never sends, for refusal tests.
- ``vllm_events.py``: vLLM KV event payloads, encoded as vLLM does.
- ``cluster_sim.py``: a discrete-event serving cluster (LRU prefix caches, FIFO prefill,
  decode interference) that replays traces through routing policies
  (``cluster_policies.py``), traces (``cluster_traces.py``), summaries (``cluster_metrics.py``).
"""
