"""A tiny Llama checkpoint written on the spot, for running real vLLM offline.

No model can be downloaded in CI, and none is needed: ``write_tiny_llama``
writes a ``config.json`` (hidden 128, 2 layers, 2 heads, head_dim 64, vocab
1024) and random weights from ``transformers`` (~1 MB of safetensors). The
weights are a function of ``seed`` alone, so two seeds give two models of one
architecture that differ only in their weights. ``initializer_range`` 0.2
makes the output depend on the KV (vLLM's dummy ±1e-3 weights would not).
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_tiny_llama(path: str | Path, seed: int = 0, layers: int = 2) -> Path:
    """Write the checkpoint into ``path`` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    (path / "kvstore-tiny.json").write_text(json.dumps({"seed": seed, "layers": layers}))
    return path
