"""Generate the Python gRPC stubs from ``proto/*.proto``.

The stubs are committed under ``kvstore/_proto`` so a clean clone imports
without grpcio-tools; ``tests/test_protogen.py`` regenerates them into a
temporary folder and fails when the committed copies are stale.

    python -m kvstore.protogen          # rewrite kvstore/_proto
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "_proto"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc on every proto file; return the generated files.

    protoc runs in a child process (grpcio-tools, a dev dependency): its bundled
    protobuf and abseil must not share a process with NIXL's, which aborts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.name) for p in PROTO_DIR.glob("*.proto"))
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    run = subprocess.run(args, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"protoc failed on {protos}: {run.stderr.strip()}")
    generated = sorted(out_dir.glob("*_pb2*.py"))
    for path in generated:
        _make_imports_relative(path)
    (out_dir / "__init__.py").write_text('"""Generated gRPC stubs: do not edit."""\n')
    return generated


def _make_imports_relative(path: Path) -> None:
    """protoc writes ``import x_pb2``; inside a package it must be relative."""
    text = path.read_text()
    text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
    path.write_text(text)


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p)
