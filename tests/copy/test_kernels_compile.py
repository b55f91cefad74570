"""Every CUDA source in kernels/ must build for Ampere and Hopper and stay NVRTC-friendly.

Runs wherever nvcc is on PATH, GPU or not. The host harness test also runs the
copy kernel's per-thread arithmetic on the CPU (it is __host__ __device__), so
head / body / tail handling is checked on machines without a GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.copy.cuda import KERNEL_FILE, KERNELS_DIR

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
SOURCES = sorted(KERNELS_DIR.glob("*.cu"))


def test_kernel_sources_exist():
    assert KERNEL_FILE in SOURCES


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "compute_75"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles(source: Path, arch: str, tmp_path: Path):
    """Cubins for Ampere and Hopper, and PTX for a generic (virtual) architecture."""
    kind = "-ptx" if arch.startswith("compute_") else "-cubin"
    out = tmp_path / f"{source.stem}.{arch}{kind.replace('-', '.')}"
    cmd = [NVCC, f"-arch={arch}", kind, "-Werror", "all-warnings", "-o", str(out), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    assert out.stat().st_size > 0


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compatible(source: Path):
    """NVRTC has no host headers: no #include at all, and entry points are extern "C"."""
    text = source.read_text()
    assert not re.search(r"^\s*#\s*include", text, re.MULTILINE), f"{source.name} includes a header"
    assert re.search(r'extern\s+"C"\s+__global__', text), f'{source.name} has no extern "C" kernel'


HARNESS = r"""
#include <cstdio>
#include <cstring>
#include "copy.cu"

// Run copy_range for every thread of a block, one after another, and compare
// the whole buffer (so stray writes outside the range are caught too).
int main() {
    const int size = 2048 + 64;
    alignas(16) static unsigned char src[size], dst[size], want[size];
    for (int i = 0; i < size; ++i) src[i] = (unsigned char)(i * 131 + 7);
    const unsigned long long lengths[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64,
                                          65, 100, 255, 256, 257, 1000, 1024, 2047, 2048};
    const unsigned threads[] = {1, 3, 32, 256};
    long cases = 0;
    for (int so = 0; so < 16; ++so)
        for (int d0 = 0; d0 < 16; ++d0)
            for (unsigned long long n : lengths)
                for (unsigned nt : threads) {
                    memset(want, 0xEE, size);
                    memcpy(want + d0, src + so, n);
                    for (int deep = 0; deep < 2; ++deep) {  // depth 4 (chunks), 8 (blocks)
                        memset(dst, 0xEE, size);
                        for (unsigned tid = 0; tid < nt; ++tid) {
                            if (deep) copy_range<8>(dst + d0, src + so, n, tid, nt);
                            else copy_range(dst + d0, src + so, n, tid, nt);
                        }
                        if (memcmp(dst, want, size) != 0) {
                            printf("FAIL src+%d dst+%d n=%llu threads=%u deep=%d\n", so, d0, n,
                                   nt, deep);
                            return 1;
                        }
                        ++cases;
                    }
                }
    printf("ok %ld\n", cases);
    return 0;
}
"""


@needs_nvcc
def test_copy_kernel_logic_on_host(tmp_path: Path):
    """Every src/dst misalignment mod 16, many lengths and thread counts, byte-exact."""
    harness = tmp_path / "harness.cu"
    harness.write_text(HARNESS)
    exe = tmp_path / "harness"
    build = [NVCC, "-std=c++17", f"-I{KERNELS_DIR}", "-o", str(exe), str(harness)]
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
