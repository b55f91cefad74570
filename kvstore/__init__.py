"""kvstore: a GPU KV-cache block store and KV-aware router for LLM serving."""

__version__ = "0.1.0"
