"""Real processes for engine tests and benches: ``kvstore serve`` and vLLM engines.

:class:`StoreProcess` runs a store server on a free loopback port (and can be
killed and restarted on that port); :class:`Engine` runs one vLLM engine
process (:mod:`kvstore.testing.vllm_engine`) over a JSON spec.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvstore.demo import free_ports

ENGINE_TIMEOUT_S = 600


class StoreProcess:
    """``kvstore serve`` in its own process on a loopback port (restartable on that port)."""

    def __init__(self, log_dir: Path, name: str, *extra: str, transfer: bool = False):
        self.name, self.log_dir = name, log_dir
        self.port, self.ucx_port = free_ports(2) if transfer else (free_ports(1)[0], 0)
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [sys.executable, "-m", "kvstore", "serve", "--port", str(self.port)]
        args += ["--pool-size", "256MiB", "--device", "cpu", "--node-id", self.name, "--no-router"]
        args += ["--ucx-port", str(self.ucx_port)] if self.ucx_port else ["--no-transfer"]
        log = (self.log_dir / f"store-{self.name}.log").open("a")
        self.proc = subprocess.Popen(args + self.extra, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"store {self.name} did not start: see {log.name}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stats(self):
        from kvstore.client.store_client import StoreClient

        client = StoreClient(self.address)
        try:
            return client.stats()
        finally:
            client.close()


class Engine:
    """One vLLM engine process (``kvstore.testing.vllm_engine``) with its spec and log."""

    def __init__(self, workdir: Path, name: str, spec: dict):
        self.workdir, self.name = workdir, name
        self.spec_path = workdir / f"{name}.spec.json"
        self.out_path = workdir / f"{name}.out.json"
        self.log_path = workdir / f"{name}.log"
        self.spec_path.write_text(json.dumps(spec))
        args = [sys.executable, "-m", "kvstore.testing.vllm_engine"]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [*args, str(self.spec_path), str(self.out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )

    def wait(self) -> list[dict]:
        try:
            rc = self.proc.wait(ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "timeout"
        if rc != 0:
            tail = self.log_path.read_text()[-6000:]
            raise AssertionError(f"engine {self.name} ended with {rc}:\n{tail}")
        return json.loads(self.out_path.read_text())

    def log(self) -> str:
        return self.log_path.read_text()
