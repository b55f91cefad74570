"""This user's private cache directory: for what the server loads or trusts later.

The host copier's compiled helper and the checkpoint digests are kept here: a
file another user could plant or rewrite would run inside the server (the
helper) or put two engines' different weights in one namespace (a digest), so
a directory or file is used only when this user owns it and neither group nor
others can write it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def private_cache_dir(purpose: str) -> Path:
    """The first private directory of: $KVSTORE_CACHE_DIR (or $XDG_CACHE_HOME/kvstore,
    ~/.cache/kvstore), then $TMPDIR/kvstore-<uid>; created with mode 0700.

    A directory that exists but is not private (another owner, writable by group
    or others, a symlink) is skipped: in a shared temp directory anyone could
    have made it first. OSError, naming ``purpose`` and every refusal, when none is.
    """
    home = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstore"
    )
    refused = []
    for path in (Path(home), Path(tempfile.gettempdir()) / f"kvstore-{os.getuid()}"):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError as err:
            refused.append(f"{path}: {err}")
            continue
        if is_private(path, directory=True):
            return path
        refused.append(f"{path}: not a directory owned by uid {os.getuid()} and closed to others")
    raise OSError(f"no private cache directory for {purpose}: " + "; ".join(refused))


def is_private(path: Path, directory: bool) -> bool:
    """``path`` itself (not a link) is a directory / regular file of this user that
    neither group nor others can write."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind and st.st_uid == os.getuid() and not st.st_mode & 0o022
