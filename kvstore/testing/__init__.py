"""Harness for the demo, tests and benches: a stand-in worker and in-process stores.

Nothing in the product imports this package except ``kvstore demo``.
"""
