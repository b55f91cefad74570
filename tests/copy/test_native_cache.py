"""The host copier's compiled helper is loaded only from this user's private directory.

The attack (issue 12, item 4): with ``~/.cache`` unwritable the helper was
cached in ``$TMPDIR/kvstore-<uid>``, an existing directory was accepted
whoever owned it, and a library planted there ran inside the server.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from kvstore.copy import host
from kvstore.private_dir import private_cache_dir

OTHER_UID = 65534  # nobody


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """Point both candidate directories into tmp_path; the first is unusable."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, so no directory can be made under it")
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(blocked / "kvstore"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    host.tempfile.tempdir = None  # re-read TMPDIR
    yield tmp_path / "tmp" / f"kvstore-{os.getuid()}"
    host.tempfile.tempdir = None


def test_a_fresh_fallback_directory_is_private(cache_env):
    path = private_cache_dir("the host copy helper")
    assert path == cache_env
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory of another user needs root")
def test_a_directory_planted_by_another_user_is_refused(cache_env):
    cache_env.mkdir(mode=0o755)
    os.chown(cache_env, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match="no private cache directory"):
        private_cache_dir("the host copy helper")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_directory_others_can_write_is_refused(cache_env, mode):
    cache_env.mkdir()
    os.chmod(cache_env, mode)
    with pytest.raises(OSError, match="closed to others"):
        private_cache_dir("the host copy helper")


def test_a_symlinked_directory_is_refused(cache_env, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    cache_env.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="no private cache directory"):
        private_cache_dir("the host copy helper")


def test_a_planted_library_is_rebuilt_never_loaded(cache_env, tmp_path):
    """A library that would print when loaded sits where the helper goes, writable by
    others: a fresh process builds its own and never runs the planted one."""
    marker = tmp_path / "ran"
    planted_src = tmp_path / "evil.c"
    planted_src.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void run(void) {{ fopen("{marker}", "w"); }}\n'
    )
    cache_env.mkdir(mode=0o700)
    probe = (
        "from kvstore.copy import host; import hashlib, os, shutil;"
        "from kvstore.private_dir import private_cache_dir;"
        "cc = os.environ.get('CC') or shutil.which('cc') or shutil.which('gcc');"
        "d = hashlib.sha256(f'{cc}\\n{host._C_SOURCE}'.encode()).hexdigest()[:16];"
        "print(private_cache_dir('the host copy helper') / f'hostcopy-{d}.so')"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    target = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", target, str(planted_src)], check=True)
    os.chmod(target, 0o777)
    load = "from kvstore.copy import host; assert host.native_copy_function() is not None"
    subprocess.run([sys.executable, "-c", load], env=env, check=True)
    assert not marker.exists(), "the planted library ran"
    assert stat.S_IMODE(os.stat(target).st_mode) & 0o022 == 0
