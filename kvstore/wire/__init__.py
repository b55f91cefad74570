"""Formats every kvstore process agrees on: pure data, no I/O, no grpc.

Errors and their codes, the one bounds file, names and their rules, block
hashes, the layout fingerprint, layout kinds, store events and the canonical
framing that identities hash. Every other room imports these; this room imports
nothing else of kvstore. The contracts are in ``docs/design.md``.
"""
