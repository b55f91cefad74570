"""A store server on a loopback --host binds what it advertises: UCX's tcp transport
listens on loopback only, and a connection to the UCX port through another
interface is rejected by UCX (docs/design.md §8).

ucxx binds the listener itself on every interface (it takes no address), so the
port still accepts a TCP connection there; UCX_NET_DEVICES=lo, which the store
sets before UCX starts, makes UCX refuse the request that arrives on it.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client.store_client import StoreClient
from kvstore.demo import free_ports

pytest.importorskip("ucxx")
pytestmark = pytest.mark.timeout(120)


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this host that is not loopback (None when it has none)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    except OSError:
        return None
    for line in out.splitlines():
        address = line.split()[3].split("/")[0]
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of process ``pid`` in LISTEN state."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            if width == 4:
                address = ipaddress.IPv4Address(raw[::-1])
            else:  # four little-endian 32-bit words; an IPv4-mapped one as IPv4
                words = b"".join(raw[i : i + 4][::-1] for i in (0, 4, 8, 12))
                v6 = ipaddress.IPv6Address(words)
                address = v6.ipv4_mapped or v6
            found.append((str(address), int(port, 16)))
    return found


@pytest.fixture
def loopback_store():
    port, ucx_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--ucx-port",
         str(ucx_port), "--device", "cpu", "--pool-size", "16MiB", "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    client = StoreClient(f"127.0.0.1:{port}", timeout=2)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"store exited with {proc.returncode}"
        try:
            client.stats()
            break
        except Exception:
            assert time.monotonic() < deadline, "store did not start"
            time.sleep(0.2)
    yield proc, ucx_port
    proc.terminate()
    proc.wait(30)


def test_loopback_store_listens_on_loopback_only(loopback_store):
    """Every listening socket is on loopback, but ucxx's own wildcard UCX port."""
    proc, ucx_port = loopback_store
    sockets = listening(proc.pid)
    assert (("0.0.0.0", ucx_port) in sockets) or (("::", ucx_port) in sockets), sockets
    others = [(a, p) for a, p in sockets if p != ucx_port]
    assert len(others) >= 2, sockets  # gRPC, and UCX's tcp transport
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in others), sockets


def test_loopback_store_refuses_ucx_connections_on_other_interfaces(loopback_store, nodes):
    _, ucx_port = loopback_store
    client = nodes()
    assert client.call("open_idle", address=f"127.0.0.1:{ucx_port}", n=1) == 1
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    with pytest.raises(RuntimeError, match=r"PeerUnavailable|rejected"):
        client.call("open_idle", address=f"{address}:{ucx_port}", n=1)
