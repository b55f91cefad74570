"""``python -m kvstore.router``: the standalone router (same as ``kvstore router``)."""

from .cli import main

main()
