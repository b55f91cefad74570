"""The wheels a lent GPU machine needs, in the sizes a device call carries.

    python3 bench/device_wheels.py            # .whl/ (about 20 s from a local index)
    python3 bench/device_wheels.py --check    # only re-measure what is there

The device image (bench/H200_NOTES.md) has CPython 3.12, torch, cupy-cuda13x, numpy
and msgpack, and reaches no package index. The rest travels in ``.whl/`` (name it in
the device call's ``carry``; ``bench/device_run.sh`` installs it): every runtime
dependency of kvstore the image lacks (``WHEELS``: ucxx for CUDA 13 with its UCX and
RMM, nixl-cu13 for the one-sided READ path, grpcio, protobuf, aetcd, cryptography,
...). As downloaded they are ~125 MB, past the 64 MiB a call carries with the
working tree, so two are pruned of what is never loaded, their RECORD rewritten:

``libucx-cu13``  static archives (``*.a``), the perftest modules and tools, headers:
                 ucxx loads UCX's shared libraries and transport modules only.
``nixl-cu13``    the expert-parallel kernels (``nixl_ep_cu13/``, 91 MiB unpacked), C++
                 headers, example programs, and the other backends' plugins (object
                 stores, GDS, libfabric, ...) with the shared libraries only they
                 need. What stays is the ELF ``NEEDED`` closure (``readelf``) of the
                 Python bindings, the UCX plugin and UCX's transport modules.

The set is refused (exit 1) when it and the working tree (what git does not ignore)
are past ``CARRY_LIMIT_MIB``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT_MIB = 64  # a device call's working tree and carried paths together
PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux2014_x86_64",
]  # fmt: skip
# What the device image has (bench/H200_NOTES.md): torch (CUDA 13) with its own
# dependencies (cuda-bindings and typing-extensions among them), cupy-cuda13x with
# cuda-pathfinder, numpy, msgpack, pytest, pytest-timeout and hypothesis. kvstore's
# dependencies named for CUDA 12 here are CUDA 13 there (CUDA_13).
# tests/test_device_script.py checks that every runtime dependency of kvstore,
# transitively, is in the image or in WHEELS, but for NOT_CARRIED: ucxx's cuda-core
# (6.6 MB) serves only UCXPY_PROGRESS_MODE=thread (the script's optional cuda_thread
# step); kvstore progresses UCX itself.
IMAGE = ("torch", "cupy-cuda13x", "cuda-bindings", "cuda-pathfinder", "typing-extensions",
         "numpy", "msgpack")  # fmt: skip
NOT_CARRIED = ("cuda-core",)
CUDA_13 = {
    name: name.replace("cuda12x", "cuda13x").replace("cu12", "cu13")
    for name in ("cupy-cuda12x", "ucxx-cu12", "libucxx-cu12", "libucx-cu12", "rmm-cu12",
                 "librmm-cu12", "nixl-cu12")
}  # fmt: skip
WHEELS = [
    "ucxx-cu13==0.52.0", "libucxx-cu13==0.52.0", "libucx-cu13", "rmm-cu13==26.10.0",
    "librmm-cu13==26.10.0", "rapids-logger==0.3.0", "nvidia-ml-py",
    "nixl-cu13==1.5.1", "blake3", "grpcio==1.85.3", "grpcio-health-checking==1.85.1",
    "protobuf==7.36.2", "pyzmq", "prometheus-client", "aetcd==1.0.0", "cryptography",
    "cffi", "pycparser",
]  # fmt: skip
DROPPED_PACKAGE = "nixl_ep_cu13/"
UCX_DROPPED = ("libucx/include/", "libucx/bin/ucx_perftest", "libucx/bin/io_demo")


def download(specs: list[str], into: Path) -> None:
    """CPython 3.12 manylinux wheels of ``specs``, no dependencies (the image has them)."""
    into.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into),
         *specs],
        check=True,
    )  # fmt: skip


def needed(path: Path) -> list[str]:
    """The shared libraries ``path`` names in its ELF dynamic section."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if "(NEEDED)" in line]
    return [line.split("[", 1)[1].split("]", 1)[0] for line in lines]


def is_root(name: str) -> bool:
    """What NIXL's UCX backend loads by name: the bindings, the plugin, UCX's modules."""
    base = name.rsplit("/", 1)[-1]
    return (
        base.startswith("_bindings")
        or base == "libplugin_UCX.so"
        or ("/ucx/" in name and "perftest" not in base)
    )


def kept_libraries(unpacked: Path) -> set[str]:
    """Every shared library in ``unpacked`` (relative paths) the roots need, transitively."""
    by_name: dict[str, list[str]] = {}
    for path in unpacked.rglob("*.so*"):
        if path.is_file() and not str(path.relative_to(unpacked)).startswith(DROPPED_PACKAGE):
            by_name.setdefault(path.name, []).append(str(path.relative_to(unpacked)))
    todo = [rel for rels in by_name.values() for rel in rels if is_root(rel)]
    seen: set[str] = set()
    while todo:
        rel = todo.pop()
        if rel not in seen:
            seen.add(rel)
            todo += [dep for lib in needed(unpacked / rel) for dep in by_name.get(lib, [])]
    if not any(r.endswith("libplugin_UCX.so") for r in seen):
        raise SystemExit("nixl wheel: no libplugin_UCX.so found; its layout changed")
    return seen


def ucx_dropped(name: str) -> bool:
    """What of libucx-cu13 ucxx never loads."""
    return name.endswith(".a") or "perftest" in name or name.startswith(UCX_DROPPED)


def nixl_dropped(wheel: Path) -> Callable[[str], bool]:
    """What of nixl-cu13 its UCX backend never loads."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as src:
        src.extractall(tmp)
        keep = kept_libraries(Path(tmp))

    def dropped(name: str) -> bool:
        if name.startswith(DROPPED_PACKAGE) or "/headers/" in name or "/scripts/" in name:
            return True  # the kernels, C++ headers, example programs
        return ".so" in name.rsplit("/", 1)[-1] and name not in keep

    return dropped


def prune(wheel: Path, dropped: Callable[[str], bool], out_dir: Path) -> Path:
    """``wheel`` without the files ``dropped`` names, its RECORD rewritten to match."""
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, 9) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(
                    f"{line}\n" for line in lines if not dropped(line.split(",", 1)[0])
                ).encode()
            dst.writestr(info, data)
    return out


def tree_mib() -> float:
    """The working tree a device call copies: tracked files and untracked unignored ones."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = (ROOT / os.fsdecode(name) for name in listed if name)
    return sum(p.stat().st_size for p in paths if p.is_file()) / (1 << 20)


def report(folder: Path) -> bool:
    """Print the set's wheels and size; False when it and the tree are past the limit."""
    wheels = sorted(folder.glob("*.whl"))
    mib, tree = sum(p.stat().st_size for p in wheels) / (1 << 20), tree_mib()
    print(f"{folder.name}: {mib:.1f} MiB ({', '.join(p.name.split('-')[0] for p in wheels)})")
    print(f"with the working tree ({tree:.1f} MiB): {mib + tree:.1f} of {CARRY_LIMIT_MIB} MiB")
    return mib + tree <= CARRY_LIMIT_MIB


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="measure the sets there, download nothing")
    args = p.parse_args(argv)
    out = ROOT / ".whl"
    if not args.check:
        out.mkdir(exist_ok=True)
        for old in out.glob("*.whl"):
            old.unlink()
        with tempfile.TemporaryDirectory() as tmp:
            download(WHEELS, Path(tmp))
            for wheel in Path(tmp).glob("*.whl"):
                if wheel.name.startswith("libucx_cu13-"):
                    prune(wheel, ucx_dropped, out)
                elif wheel.name.startswith("nixl_cu13-"):
                    prune(wheel, nixl_dropped(wheel), out)
                else:
                    shutil.copy2(wheel, out)
    if not report(out):
        raise SystemExit(1)
    print('carry [".whl"] in the device call (bench/device_run.sh installs it)')


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
