"""The command line explains itself and refuses bad flags clearly."""

import subprocess
import sys

import pytest

from kvstore.cli import parse_size


def kvstore(*args):
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("cmd", [[], ["serve"], ["router"], ["demo"], ["stats"], ["events"]])
def test_help(cmd):
    out = kvstore(*cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: kvstore" in out.stdout


def test_serve_help_explains_every_flag():
    text = kvstore("serve", "--help").stdout
    for flag in ("--host", "--port", "--pool-size", "--device", "--log-level"):
        assert flag in text
    assert "127.0.0.1" in text


def test_bad_pool_size_is_refused():
    out = kvstore("serve", "--pool-size", "lots")
    assert out.returncode == 2
    assert "4GiB" in out.stderr


@pytest.mark.parametrize("text,value", [
    ("1048576", 1 << 20), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 << 30),
    ("64KiB", 64 << 10),
])
def test_parse_size(text, value):
    assert parse_size(text) == value
