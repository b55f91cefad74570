"""Engine integrations: kvstore behind vLLM and SGLang.

Each integration is a client of the store (``kvstore.client``) and imports
its engine lazily, so ``import kvstore`` never needs vLLM or SGLang.
"""
