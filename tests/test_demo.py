"""``kvstore demo``: the README's first command, end to end on a small model, and
its way out when stopped (the server and the workers go with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["--layers", "2", "--heads", "2", "--head-dim", "16", "--prompts", "2",
         "--prefix-tokens", "64", "--suffix-tokens", "16", "--pool-size", "64MiB",
         "--device", "cpu"]  # fmt: skip


def demo(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvstore", "demo", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_demo_saves_loads_every_byte_and_keeps_mtp_apart():
    proc = demo(*SMALL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("A ", "B ", "C "))
    }
    assert rows["A"][2:5] == ["save", "6", "0"]  # 4 shared prefix blocks, 1 own per prompt
    assert rows["B"][2] == "load" and rows["B"][3] == rows["B"][4]  # every block a hit
    assert rows["C"][4:7] == ["query", "10", "0"] and rows["C"][3] != rows["A"][1]  # MTP
    assert "match the saved ones: yes" in out


def children(pid: int) -> set[int]:
    """Every descendant of ``pid`` now."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            kids = {int(k) for k in (task / "children").read_text().split()}
            todo += kids - found
            found |= kids
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_demo_stopped_by_sigterm_takes_its_server_and_workers_along():
    proc = demo(*SMALL)
    deadline = time.monotonic() + 120
    while not any("kvstore serve" in command(p) for p in children(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(1.0)  # the workers start meanwhile
    spawned = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    left = [p for p in spawned if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], [command(p) for p in left]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--heads", "3"], "--heads 3: the two TP ranks split the heads"),
        (["--prefix-tokens", "8"], "--prefix-tokens 8 is less than one block"),
        (["--layers", "0"], "argument --layers: '0' is not a whole number >= 1"),
        (["--pool-size", "1MiB"], "the store server exited with code 2"),
    ],
)
def test_bad_demo_flags_are_refused_with_exit_2(args, words):
    proc = demo(*SMALL, *args)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert words in err and "Traceback" not in err
