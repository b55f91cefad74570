"""The cluster benchmark's quick mode end to end: real etcd, 3 replicas, 20 stores.

Runs ``python -m bench.cluster --quick`` as its own process and checks what its JSON
must say whatever the machine's speed: every store joined every replica, each
replica indexed exactly the expected blocks before and after the failure, the
replicas answered every sampled Route identically, and the killed stores left
through lease expiry (not a revoke). Times are recorded, never bounded above.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.membership.conftest import require_etcd

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    require_etcd()
    out = tmp_path_factory.mktemp("cluster-bench") / "cluster.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.cluster", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(out.read_text()), out


def test_every_store_joins_every_replica_with_its_blocks(quick_run):
    result, _ = quick_run
    stores, join = result["shape"]["stores"], result["join"]
    assert result["replicas"] == 3
    assert set(join["all_peers_visible_s"]) == {"r0", "r1", "r2"}
    assert join["stores"] == stores
    fill = result["fill"]
    assert set(fill["indexed_blocks"].values()) == {fill["expected_indexed_blocks"]}
    assert result["indexed_stable_while_idle"] is True


def test_replicas_give_identical_routes(quick_run):
    result, _ = quick_run
    for phase in ("agreement_after_join", "agreement_after_failure"):
        agreement = result[phase]
        assert agreement["requests"] > 0
        assert agreement["fraction"] == 1.0, phase
        assert agreement["picked_holder"] == 1.0, phase


def test_killed_stores_are_dropped_by_lease_expiry(quick_run):
    result, _ = quick_run
    failure, stores = result["failure"], result["shape"]["stores"]
    assert failure["killed"] == round(stores * 0.1)
    assert set(failure["peers_after"].values()) == {stores - failure["killed"]}
    assert set(failure["indexed_blocks"].values()) == {failure["expected_indexed_blocks"]}
    assert failure["expected_indexed_blocks"] < result["fill"]["expected_indexed_blocks"]
    # A revoked lease would vanish at once; an expiring one lives at least
    # TTL - TTL/3 (the last keepalive) after the kill.
    assert min(failure["all_dropped_s"].values()) >= failure["ttl_s"] / 3


def test_report_has_latencies_etcd_cpu_machine_and_plot(quick_run):
    result, out = quick_run
    for side in ("client_grpc", "router_core"):
        assert set(result["route_ms"][side]) == {"r0", "r1", "r2"}
        for q in result["route_ms"][side].values():
            assert q["calls"] > 0 and 0 < q["p50"] <= q["p99"]
    assert set(result["etcd_cpu"]) == {
        "baseline_no_stores",
        "join",
        "fill",
        "steady_idle",
        "routing",
        "failure",
    }
    assert result["machine"]["cpu_count"] >= 1
    assert out.with_suffix(".png").stat().st_size > 0
