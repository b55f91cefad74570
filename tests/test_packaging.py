"""A wheel (not an editable checkout) carries what the product loads at run time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_ships_the_cuda_kernel_and_finds_it_installed(tmp_path: Path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("kvstore-*.whl")
    assert "kvstore/copy/kernels/copy.cu" in zipfile.ZipFile(wheel).namelist()

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    probe = (
        "import kvstore.copy.cuda as c, sys; "
        f"assert c.KERNEL_FILE.is_relative_to({str(site)!r}), c.KERNEL_FILE; "
        "assert 'kvstore_copy_chunks' in c.kernel_source()"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
