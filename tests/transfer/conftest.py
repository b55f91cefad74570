"""The ``nodes`` fixture: spawned transfer nodes, closed (or killed) after the test."""

from __future__ import annotations

import pytest

from tests.transfer.nodes import Node, close_all


@pytest.fixture
def nodes():
    """``nodes(**env)`` spawns a node whose environment also holds ``env``."""
    made: list[Node] = []

    def make(**env: str) -> Node:
        made.append(Node(env))
        return made[-1]

    yield make
    close_all(made)
