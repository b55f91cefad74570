"""bench/device_run.sh, the one script a lent GPU machine runs, names files and flags
that exist.

A GPU machine comes to a few sessions, for minutes: a bench flag renamed or a test
file moved since the script was last run would cost that run. Here, without a GPU,
every bench command of the script is parsed by the bench's own argparse (stopped
before it runs) and every test file it names must hold GPU tests."""

from __future__ import annotations

import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_run.sh"

# Runs a script as __main__ with the given argv, parses its arguments and exits before
# the script does anything else: exit 0 and PARSED when argparse accepts them, 2 when not.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_only(self, *a, **k):
    parse(self, *a, **k)
    print("PARSED")
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])  # as `python3 bench/x.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _commands() -> list[list[str]]:
    """Each python3 command of the script, from python3 on, continuation lines joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "python3" not in line:
            continue
        words = shlex.split(line, comments=True)
        if "python3" in words:
            found.append(words[words.index("python3") :])
    return found


def _bench_commands() -> list[list[str]]:
    return [c[1:] for c in _commands() if len(c) > 1 and c[1].startswith("bench/")]


def _test_files() -> list[str]:
    files = []
    for c in _commands():
        if c[1:3] == ["-m", "pytest"]:
            files += [w for w in c[3:] if w.endswith(".py")]
    return files


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_script_runs_benches_and_tests():
    """The parsing below sees the commands (an empty list would prove nothing)."""
    benches = {c[0] for c in _bench_commands()}
    assert {"bench/copy_engine.py", "bench/transfer.py"} <= benches
    assert "tests/copy/test_copy.py" in _test_files()


@pytest.mark.parametrize("argv", _bench_commands(), ids=lambda a: " ".join(a))
def test_each_bench_command_parses(argv: list[str], tmp_path: Path):
    assert (ROOT / argv[0]).is_file(), f"{argv[0]} is gone"
    done = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, *(a.replace("$OUT", str(tmp_path)) for a in argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and "PARSED" in done.stdout, done.stderr[-2000:]


def test_each_test_file_holds_gpu_tests():
    files = _test_files()
    for f in files:
        assert (ROOT / f).is_file(), f"{f} is gone"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "gpu", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert collected == set(files), f"no GPU test collected in {set(files) - collected}"


def test_pruned_wheel_keeps_what_is_loaded_and_its_record_matches(tmp_path: Path):
    """bench/device_wheels.py's pruning of libucx-cu13: static archives, perftest and
    headers go, shared libraries and modules stay, RECORD names exactly what is left."""
    from bench.device_wheels import prune, ucx_dropped

    names = [
        "libucx/lib/libucp.so.0",
        "libucx/lib/libucp.a",
        "libucx/lib/ucx/libuct_cuda.so.0",
        "libucx/lib/ucx/libucx_perftest_cuda.so.0",
        "libucx/bin/ucx_perftest",
        "libucx/bin/ucx_info",
        "libucx/include/ucp/api/ucp.h",
    ]
    record = "libucx_cu13-1.22.0.dist-info/RECORD"
    wheel = tmp_path / "libucx_cu13-1.22.0-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, name.encode())
        z.writestr(record, "".join(f"{n},sha256=x,{len(n)}\n" for n in [*names, record]))
    (tmp_path / "out").mkdir()
    out = prune(wheel, ucx_dropped, tmp_path / "out")
    kept = ["libucx/lib/libucp.so.0", "libucx/lib/ucx/libuct_cuda.so.0", "libucx/bin/ucx_info"]
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == sorted([*kept, record])
        assert z.read("libucx/lib/libucp.so.0") == b"libucx/lib/libucp.so.0"
        listed = [line.split(",")[0] for line in z.read(record).decode().splitlines()]
    assert sorted(listed) == sorted([*kept, record])


def test_every_runtime_dependency_is_in_the_image_or_carried():
    """kvstore's runtime dependencies (and the rma extra's), transitively as installed
    here, are in the device image or among bench/device_wheels.py's WHEELS (CUDA 12
    names as CUDA 13). aetcd, cryptography and prometheus-client came after the last
    GPU run and were in neither: the GPU tests' conftest could not import the server."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from bench.device_wheels import CUDA_13, IMAGE, NOT_CARRIED, WHEELS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    carried = {canonicalize_name(Requirement(spec).name) for spec in WHEELS}
    stop = {canonicalize_name(n) for n in (*IMAGE, *NOT_CARRIED)}
    todo = [
        Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["rma"]
    ]
    seen, missing = set(), set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        there = CUDA_13.get(name, name)
        if name in seen or there in stop:
            continue
        seen.add(name)
        if there not in carried:
            missing.add(there)
        todo += [Requirement(r) for r in md.distribution(name).requires or []]
    assert not missing, f"neither in the device image nor in .whl/: {sorted(missing)}"
    assert {"aetcd", "cryptography", "prometheus-client", "nixl-cu13"} <= carried
