"""The store server's expiry of leases and stale inflight blocks outlives a failure."""

from __future__ import annotations

from tests.conftest import wait_for


def test_a_failed_expiry_pass_is_logged_and_the_next_one_runs(server, caplog):
    """One exception from a pass ended the expiry task silently: from then on no
    lease expired and no stale inflight block was dropped, for the process's life."""
    node = server.server.node
    passes = []
    expire = node.expire

    def failing_once() -> None:
        passes.append(1)
        if len(passes) == 1:
            raise RuntimeError("an injected failure")
        expire()

    node.expire = failing_once  # injected: the server calls it every second
    try:
        assert wait_for(lambda: len(passes) >= 3, timeout=15)
    finally:
        del node.expire
    assert any("expiring leases" in r.getMessage() for r in caplog.records)
